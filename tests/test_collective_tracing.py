"""Every collective of ``ops/collectives.py`` under ``torch.compile(fullgraph=True)`` on 2 real gloo ranks.

Under compile the ops run functional collectives (one buffer along dim 0, ``funcol``), which Dynamo traces:
``fullgraph=True`` turns any graph break (the list-form ``dist.reduce_scatter`` of the sequence ops
was one) into an error. Each public op, compiled, gives the eager forward values and input gradients, and
under no_grad the eager values (even, uneven and segmented gathers, sequence ops with and without a merged
batch dim); the eager ops give the values of their definition; then a tiny Llama
with sequence parallelism at tp=2 whose decoder layers are compiled with ``fullgraph=True``
(``runtime.compile_layers``) gives the eager loss and gradients within 1e-5 (and the eager loss that of
transformers' model on one process). The backend is ``aot_eager``
(Dynamo and AOTAutograd, where tracing breaks; inductor only adds code generation).
"""
from __future__ import annotations

import pytest
import torch

from distributed import run_ranks
from fxparallel.ops import collectives as c

TOL = 1e-5

# name, op (a function of the tensor, the group's handle and the rank), this rank's input shape
CASES = {
    "all_reduce": (lambda x, h, r: c.all_reduce(x, h), lambda r: (3, 4)),
    "copy_to_tp": (lambda x, h, r: c.copy_to_tp(x, h), lambda r: (3, 4)),
    "partial_grad": (lambda x, h, r: c.partial_grad(x, h), lambda r: (3, 4)),
    "all_gather dim 0": (lambda x, h, r: c.all_gather(x, 0, h), lambda r: (3, 4)),
    "all_gather dim -1": (lambda x, h, r: c.all_gather(x, -1, h), lambda r: (2, 3, 4)),
    "all_gather uneven": (lambda x, h, r: c.all_gather(x, 1, h, None, ((3, 2),)), lambda r: (2, 3 - r, 4)),
    # fused q, k, v (8, 4, 4 over 2 ranks); then k held whole by both ranks
    "all_gather segments": (lambda x, h, r: c.all_gather(x, -1, h, (8, 4, 4)), lambda r: (3, 8)),
    "all_gather whole segment": (lambda x, h, r: c.all_gather(x, -1, h, (8, 4, 4), None, (1,)), lambda r: (3, 10)),
    "all_gather uneven segments": (lambda x, h, r: c.all_gather(x, 0, h, (5, 3), ((3, 2), (2, 1))),
                                   lambda r: (5 - 2 * r, 2)),
    "local_chunk": (lambda x, h, r: c.local_chunk(x, 1, h, (8, 4)), lambda r: (2, 12)),
    "local_chunk uneven": (lambda x, h, r: c.local_chunk(x, 0, h, None, ((3, 2),)), lambda r: (5, 2)),
    "reduce_scatter_seq": (lambda x, h, r: c.reduce_scatter_seq(x, 1, h), lambda r: (2, 6, 4)),
    "reduce_scatter_seq dim 0": (lambda x, h, r: c.reduce_scatter_seq(x, 0, h), lambda r: (6, 4)),
    "reduce_scatter_seq batch": (lambda x, h, r: c.reduce_scatter_seq(x, 0, h, 2), lambda r: (12, 4)),
    "gather_seq_to_tp": (lambda x, h, r: c.gather_seq_to_tp(x, 1, h), lambda r: (2, 3, 4)),
    "gather_seq_to_tp dim 0": (lambda x, h, r: c.gather_seq_to_tp(x, 0, h), lambda r: (3, 4)),
    "gather_seq_to_tp batch": (lambda x, h, r: c.gather_seq_to_tp(x, 0, h, 2), lambda r: (6, 4)),
    "sum_grad_rows": (lambda x, h, r: c.sum_grad_rows(x, 0, ((0, 2), (4, 5)), h), lambda r: (6, 3)),
    # an activation and a rank-r value made from it, as a LoRA adapter's joins its base layer's collective
    "all_reduce_many": (lambda x, h, r: torch.cat([t.reshape(-1) for t in c.all_reduce_many((x, x[:, :2] * 2.0), h)]),
                        lambda r: (3, 4)),
    "copy_to_tp_many": (lambda x, h, r: torch.cat([t.reshape(-1) for t in c.copy_to_tp_many((x, x[:, :2] * 2.0), h)]),
                        lambda r: (3, 4)),
    # the same along the sequence: [batch, seq, features] and a rank-r value, joined after the token dim
    "reduce_scatter_seq_many": (lambda x, h, r: torch.cat([t.reshape(-1) for t in c.reduce_scatter_seq_many(
        (x, x[..., :2] * 2.0), 1, h)]), lambda r: (2, 6, 4)),
    "gather_seq_to_tp_many": (lambda x, h, r: torch.cat([t.reshape(-1) for t in c.gather_seq_to_tp_many(
        (x, x[..., :2] * 2.0), 1, h)]), lambda r: (2, 3, 4)),
    "gather_seq_to_tp_many batch": (lambda x, h, r: torch.cat([t.reshape(-1) for t in c.gather_seq_to_tp_many(
        (x, x[:, :1] * 2.0), 0, h, 2)]), lambda r: (6, 4)),
}


def _run(op, shape, handle, rank, compiled: bool):
    """(output, input gradient) of ``op`` on a rank-dependent input and output gradient."""
    x = torch.randn(shape, generator=torch.Generator().manual_seed(10 + rank)).requires_grad_()

    def fn(t):
        return op(t, handle, rank) * 1.0  # an op after it: the output is not the collective's own tensor

    run = torch.compile(fn, fullgraph=True, backend="aot_eager") if compiled else fn
    out = run(x)
    out.backward(torch.randn(out.shape, generator=torch.Generator().manual_seed(20 + rank)))
    return out.detach(), x.grad


def _ops(rank, world):
    import torch.distributed as dist

    from fxparallel.group import resolve_tp_group

    handle = resolve_tp_group(dist.group.WORLD).handle
    errors = {}
    for name, (op, shape) in CASES.items():
        torch._dynamo.reset()  # every case compiles its own graph (no cache limit across the cases)
        out, grad = _run(op, shape(rank), handle, rank, compiled=False)
        c_out, c_grad = _run(op, shape(rank), handle, rank, compiled=True)
        assert c_out.shape == out.shape and c_grad.shape == grad.shape, (name, c_out.shape, out.shape)
        torch._dynamo.reset()
        with torch.no_grad():  # outside autograd the ops skip their autograd.Function (``_direct``)
            direct = torch.compile(lambda t: op(t, handle, rank) * 1.0, fullgraph=True, backend="aot_eager")(
                torch.randn(shape(rank), generator=torch.Generator().manual_seed(10 + rank)))
        errors[name] = max(float((c_out - out).abs().max()), float((c_grad - grad).abs().max()),
                           float((direct - out).abs().max()))
    return errors


@pytest.fixture(scope="module")
def op_errors():
    return run_ranks(2, _ops, timeout=600)


@pytest.mark.parametrize("name", list(CASES))
def test_compiled_op_matches_eager(op_errors, name):
    for rank, errors in enumerate(op_errors):
        assert errors[name] == 0.0, (name, rank, errors[name])


def test_ops_match_reference_values():
    """The buffer-based collectives give the values of their definition (eager, 2 ranks)."""
    for result in run_ranks(2, _reference):
        for name, ok in result.items():
            assert ok, name


def _reference(rank, world):
    import torch.distributed as dist

    from fxparallel.group import resolve_tp_group

    h = resolve_tp_group(dist.group.WORLD).handle
    full = torch.arange(2 * 6 * 4, dtype=torch.float32).reshape(2, 6, 4)
    mine = full.chunk(2, dim=1)[rank]
    checks = {
        "gather dim 1": torch.equal(c.all_gather(mine, 1, h), full),
        "gather seq": torch.equal(c.gather_seq_to_tp(mine, 1, h), full),
        "gather seq batch": torch.equal(c.gather_seq_to_tp(mine.flatten(0, 1), 0, h, 2), full.flatten(0, 1)),
        "scatter seq": torch.equal(c.reduce_scatter_seq(full * (rank + 1), 1, h), mine * 3),
        "scatter seq batch": torch.equal(c.reduce_scatter_seq((full * (rank + 1)).flatten(0, 1), 0, h, 2),
                                         (mine * 3).flatten(0, 1)),
    }
    uneven = full[:, :5].split([3, 2], dim=1)[rank]
    checks["gather uneven"] = torch.equal(c.all_gather(uneven, 1, h, None, ((3, 2),)), full[:, :5])
    # q (4 rows) and k (2 rows) fused, each split over the ranks
    q, k = full[0, :4], full[1, :2]
    fused = torch.cat([q.chunk(2)[rank], k.chunk(2)[rank]])
    checks["gather segments"] = torch.equal(c.all_gather(fused, 0, h, (4, 2)), torch.cat([q, k]))
    # dim 0, even: the result is a view of the one gathered buffer
    gathered = c.all_gather(full[rank], 0, h)
    checks["gather dim 0 is the buffer"] = gathered._base is not None and gathered._base.shape == (2, 6, 4)
    # several tensors in one collective: the sums of each, and (copy_to_tp_many) each gradient summed
    a, b = full[0] * (rank + 1), full[1, :, :2] * (rank + 1)
    summed = c.all_reduce_many((a, b), h)
    checks["all_reduce_many"] = torch.equal(summed[0], full[0] * 3) and torch.equal(summed[1], full[1, :, :2] * 3)
    xa, xb, xc = (t.clone().requires_grad_() for t in (a, b, a))
    frozen = b.clone()  # a frozen parameter: left out of the collective, as copy_to_tp skips it
    ya, yb, _, yf = c.copy_to_tp_many((xa, xb, xc, frozen), h)  # the third unused: its gradient is zero
    ((ya * (rank + 1)).sum() + (yb * 2 * (rank + 1)).sum()).backward()
    checks["copy_to_tp_many"] = (torch.equal(ya, a) and torch.equal(xa.grad, torch.full_like(a, 3.0))
                                 and torch.equal(xb.grad, torch.full_like(b, 6.0))
                                 and torch.equal(xc.grad, torch.zeros_like(a))
                                 and yf._base is frozen and yf.grad_fn is None)
    # along the sequence: each value's own reduce-scatter / gather, and each gradient its own backward collective
    xa, xb = (t.clone().requires_grad_() for t in (full * (rank + 1), full[..., :1] * (rank + 1)))
    ya, yb = c.reduce_scatter_seq_many((xa, xb), 1, h)
    ((ya * (rank + 1)).sum() + (yb * 2).sum()).backward()
    checks["reduce_scatter_seq_many"] = (torch.equal(ya, mine * 3) and torch.equal(yb, mine[..., :1] * 3)
                                         and torch.equal(xa.grad, torch.cat([torch.full_like(mine, 1.0),
                                                                             torch.full_like(mine, 2.0)], 1))
                                         and torch.equal(xb.grad, torch.full_like(full[..., :1], 2.0)))
    xa, xb = (t.clone().requires_grad_() for t in (mine, mine[..., 1:3].flatten(0, 1)))
    ya, yb = c.gather_seq_to_tp_many((xa.flatten(0, 1), xb), 0, h, 2)
    ((ya * (rank + 1)).sum() + (yb * 2).sum()).backward()
    checks["gather_seq_to_tp_many batch"] = (torch.equal(ya, full.flatten(0, 1))
                                             and torch.equal(yb, full[..., 1:3].flatten(0, 1))
                                             and torch.equal(xa.grad, torch.full_like(mine, 3.0))
                                             and torch.equal(xb.grad, torch.full_like(xb, 4.0)))
    parts = c.gather_parts(uneven, 1, dist.group.WORLD, 2, [3, 2])
    checks["parts share one buffer"] = parts[0].untyped_storage().data_ptr() == parts[1].untyped_storage().data_ptr()
    return checks


def _model(rank, world, path):
    import torch.distributed as dist

    import fxparallel
    from checks import batch
    from fxparallel.runtime import compile_layers
    from models import reference

    model = fxparallel.parallelize(path, dist.group.WORLD, dtype=torch.float32, sequence_parallel=True).train()
    ids = batch(model.config.vocab_size, b=2, s=8)
    runs = {}
    for how in ("eager", "compiled"):
        if how == "compiled":
            torch._dynamo.reset()
            compile_layers(model, fullgraph=True, backend="aot_eager")
        model.zero_grad(set_to_none=True)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        runs[how] = (loss.item(), {n: p.grad.clone() for n, p in model.named_parameters()})
    (loss, grads), (c_loss, c_grads) = runs["eager"], runs["compiled"]
    single = reference(path)(input_ids=ids, labels=ids).loss.item()  # one device, transformers' own model
    return abs(loss - single), abs(c_loss - loss), max(float((c_grads[n] - g).abs().max()) for n, g in grads.items())


def test_sequence_parallel_llama_compiled_fullgraph_matches_eager(checkpoints):
    for eager_err, loss_err, grad_err in run_ranks(2, _model, checkpoints["llama"], timeout=600):
        assert eager_err <= TOL, eager_err
        assert loss_err <= TOL and grad_err <= TOL, (loss_err, grad_err)
