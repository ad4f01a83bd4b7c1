"""Autograd-aware collectives over the tensor-parallel group (Megatron's conjugate pairs).

Each op states which collective it runs in the forward and in the backward pass
(``FORWARD`` / ``BACKWARD``), so the plan can count them from the graph.

* ``all_reduce``:   forward all-reduce,  backward identity   (partial -> replicated)
* ``copy_to_tp``:   forward identity,    backward all-reduce (replicated value used on shards)
* ``all_gather``:   forward all-gather,  backward local slice (shard -> replicated)
* ``local_chunk``:  forward local slice, backward zero-padding (replicated -> shard, no communication)

A segment held whole by every rank (``plan/placement.py``) has a replicated value and a
partial gradient. Two ops keep that true:

* ``partial_grad``:   forward identity, backward: the first rank keeps the (replicated)
  gradient, the others send zero (replicated -> partial, no communication)
* ``sum_grad_rows``:  forward identity, backward all-reduce of the whole segments' rows of a
  weight's gradient (once per step, not per token)

Sequence parallelism (``fxparallel.rewrite.sequence_parallel``) adds two ops on the
token dimension of activations (``dim``; with ``batch`` given, ``dim`` merges batch and
sequence, batch outermost, and the op acts on the sequence inside it):

* ``reduce_scatter_seq``:  forward reduce-scatter, backward all-gather  (partial -> sequence shard)
* ``gather_seq_to_tp``:    forward all-gather,     backward reduce-scatter (shard -> value used on tp shards)

With a group of size 1 every op is the identity and runs no collective.

A shard may be uneven (``sizes``: per segment, each rank's size along ``dim``; see
``plan/layout.py``). The all-gather then pads every rank's piece to the largest, since
gloo's all_gather needs equal sizes, and trims after.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

from ..errors import ShardingError
from ..group import group_by_handle


def _all_reduce(x: torch.Tensor, handle: int) -> torch.Tensor:
    group = group_by_handle(handle)
    if group.size == 1:
        return x
    if torch.compiler.is_compiling():  # traceable: Dynamo keeps one graph across it (no graph break)
        return funcol.wait_tensor(funcol.all_reduce(x.contiguous(), "sum", group.process_group))
    x = x.contiguous().clone()
    dist.all_reduce(x, group=group.process_group)
    return x


def _split_sizes(full_parts, tp: int, sizes=None, whole=()) -> list:
    """Per segment, each rank's size: ``sizes`` when uneven, else ``segment // tp`` (the segment if whole)."""
    if sizes:
        return [list(s) for s in sizes]
    return [[seg] * tp if i in whole else [seg // tp] * tp for i, seg in enumerate(full_parts)]


def gather_parts(x: torch.Tensor, dim: int, process_group, world: int, sizes=None) -> list:
    """Every rank's ``x`` along ``dim``, in rank order; ``sizes``: each rank's size there when they differ
    (sent padded to the largest: all_gather takes equal shapes)."""
    x = x.contiguous()
    if sizes is not None and x.shape[dim] < max(sizes):
        pad = list(x.shape)
        pad[dim] = max(sizes) - x.shape[dim]
        x = torch.cat([x, x.new_zeros(pad)], dim=dim)
    parts = [torch.empty_like(x) for _ in range(world)]
    dist.all_gather(parts, x, group=process_group)
    return parts if sizes is None else [p.narrow(dim, 0, n) for p, n in zip(parts, sizes)]


def _all_gather(x: torch.Tensor, dim: int, handle: int, segments=None, sizes=None, whole=()) -> torch.Tensor:
    group = group_by_handle(handle)
    if group.size == 1:
        return x
    dim = dim % x.dim()
    local = [sum(s[r] for s in sizes) for r in range(group.size)] if sizes else None  # uneven: each rank's size
    parts = gather_parts(x, dim, group.process_group, group.size, local)
    if not segments and not sizes:
        return torch.cat(parts, dim=dim)
    # each rank holds its part of every segment: regroup segment by segment (a whole one from the first rank)
    per_segment = _split_sizes(segments or (None,), group.size, sizes, whole)
    split = [p.split([s[r] for s in per_segment], dim=dim) for r, p in enumerate(parts)]
    return torch.cat([split[r][i] for i in range(len(per_segment))
                      for r in (range(1) if i in whole else range(group.size))], dim=dim)


def _chunk(x: torch.Tensor, dim: int, handle: int, segments=None, sizes=None, whole=(), whole_grad=False):
    """This rank's part of every segment of ``x``; a whole segment entire (or, with ``whole_grad``, for
    the gradient of a gather: entire on the first rank and zero on the others, since it is partial)."""
    group = group_by_handle(handle)
    if group.size == 1:
        return x
    dim = dim % x.dim()
    per_segment = _split_sizes(segments or (x.shape[dim],), group.size, sizes, whole)
    pieces, offset = [], 0
    for i, s in enumerate(per_segment):
        if i in whole:
            piece = x.narrow(dim, offset, s[0])
            pieces.append(torch.zeros_like(piece) if whole_grad and group.rank else piece)
            offset += s[0]
            continue
        pieces.append(x.narrow(dim, offset + sum(s[:group.rank]), s[group.rank]))
        offset += sum(s)
    return pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=dim)


def _token_view(x: torch.Tensor, dim: int, batch):
    """(view, seq dim): with ``batch``, split the merged (batch, sequence) dim ``dim`` in two."""
    if batch is None:
        return x, dim
    return x.unflatten(dim, (int(batch), -1)), dim + 1


def _token_merge(x: torch.Tensor, dim: int, batch) -> torch.Tensor:
    return x if batch is None else x.flatten(dim, dim + 1)


def _reduce_scatter_seq(x: torch.Tensor, dim: int, handle: int, batch=None) -> torch.Tensor:
    group = group_by_handle(handle)
    if group.size == 1:
        return x
    view, d = _token_view(x, dim, batch)
    if view.shape[d] % group.size:
        raise ShardingError(f"sequence parallelism: sequence length {view.shape[d]} does not divide by tp size "
                            f"{group.size}")
    parts = [p.contiguous() for p in view.chunk(group.size, dim=d)]
    out = torch.empty_like(parts[0])
    dist.reduce_scatter(out, parts, group=group.process_group)
    return _token_merge(out, dim, batch)


def _all_gather_seq(x: torch.Tensor, dim: int, handle: int, batch=None) -> torch.Tensor:
    group = group_by_handle(handle)
    if group.size == 1:
        return x
    view, d = _token_view(x, dim, batch)
    view = view.contiguous()
    parts = [torch.empty_like(view) for _ in range(group.size)]
    dist.all_gather(parts, view, group=group.process_group)
    return _token_merge(torch.cat(parts, dim=d), dim, batch)


def _sequence_pair(fwd, bwd, name: str):
    """An autograd op along the sequence: ``fwd`` and, on the gradient, ``bwd``
    (each ``f(x, dim, handle, batch)``)."""

    class Pair(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, dim, handle, batch):
            ctx.args = (dim, handle, batch)
            return fwd(x, dim, handle, batch)

        @staticmethod
        def backward(ctx, grad):
            return bwd(grad, *ctx.args), None, None, None

    Pair.__name__ = Pair.__qualname__ = name
    return Pair


_ReduceScatterSeq = _sequence_pair(_reduce_scatter_seq, _all_gather_seq, "_ReduceScatterSeq")
_GatherSeqToTP = _sequence_pair(_all_gather_seq, _reduce_scatter_seq, "_GatherSeqToTP")


class _AllReduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, handle):
        return _all_reduce(x, handle)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _AllGather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, handle, segments, sizes, whole):
        ctx.args = (dim, handle, segments, sizes, whole)
        return _all_gather(x, dim, handle, segments, sizes, whole)

    @staticmethod
    def backward(ctx, grad):
        return (_chunk(grad, *ctx.args, whole_grad=True).contiguous(),) + (None,) * 5


def _gradient_only(bwd, name: str):
    """An autograd op that is the identity forward and applies ``bwd(grad, *args)`` to the gradient."""

    class GradientOnly(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, *args):
            ctx.args = args
            return x.view_as(x)

        @staticmethod
        def backward(ctx, grad):
            return (bwd(grad, *ctx.args),) + (None,) * len(ctx.args)

    GradientOnly.__name__ = GradientOnly.__qualname__ = name
    return GradientOnly


def _first_rank_keeps(grad: torch.Tensor, handle: int) -> torch.Tensor:
    """A replicated gradient as a partial one: the first rank's copy, zero on the others."""
    return torch.zeros_like(grad) if group_by_handle(handle).rank else grad


def _sum_rows(grad: torch.Tensor, dim: int, ranges, handle: int) -> torch.Tensor:
    """``grad`` with its [start, stop) ranges along ``dim`` all-reduced (one call for all of them)."""
    if group_by_handle(handle).size == 1:
        return grad
    grad = grad.clone()
    rows = [grad.narrow(dim, start, stop - start) for start, stop in ranges]
    summed = _all_reduce(torch.cat([r.reshape(-1) for r in rows]), handle)
    offset = 0
    for r in rows:
        r.copy_(summed[offset:offset + r.numel()].view_as(r))
        offset += r.numel()
    return grad


_CopyToTP = _gradient_only(_all_reduce, "_CopyToTP")
_PartialGrad = _gradient_only(_first_rank_keeps, "_PartialGrad")
_SumGradRows = _gradient_only(_sum_rows, "_SumGradRows")


def _recorded(x: torch.Tensor) -> bool:
    """Whether autograd records an op on ``x`` (or forward-mode AD / a torch.func transform is active, which the
    Functions refuse by name); where it does not (no_grad, inference, a decode step) the ops below run their
    forward directly: an autograd.Function would only add its dispatch (tens of us per call, 4L+2 calls per
    decoded token)."""
    return ((x.requires_grad and torch.is_grad_enabled()) or torch.autograd.forward_ad._current_level >= 0
            or torch._C._are_functorch_transforms_active())


def _direct(forward, x: torch.Tensor, *args) -> torch.Tensor:
    """``forward(x, *args)`` outside autograd; a view where that is ``x`` itself (as an autograd.Function's
    output is), so that an in-place change of the output's shape cannot reach ``x``."""
    out = forward(x, *args)
    return out.view_as(x) if out is x else out


def _identity(x: torch.Tensor, *args) -> torch.Tensor:
    return x


def all_reduce(x, handle):
    return _AllReduce.apply(x, handle) if _recorded(x) else _direct(_all_reduce, x, handle)


def copy_to_tp(x, handle):
    return _CopyToTP.apply(x, handle) if _recorded(x) else _direct(_identity, x)


def all_gather(x, dim, handle, segments=None, sizes=None, whole=()):
    if not _recorded(x):
        return _direct(_all_gather, x, dim, handle, segments, sizes, whole)
    return _AllGather.apply(x, dim, handle, segments, sizes, whole)


def local_chunk(x, dim, handle, segments=None, sizes=None, whole=()):
    return _chunk(x, dim, handle, segments, sizes, whole)


def partial_grad(x, handle):
    return _PartialGrad.apply(x, handle) if _recorded(x) else _direct(_identity, x)


def sum_grad_rows(w, dim, ranges, handle):
    """``w`` (a weight with whole segments, ``ranges``: their [start, stop) along ``dim``) whose gradient
    rows there are summed over the ranks in the backward pass."""
    return _SumGradRows.apply(w, dim, ranges, handle) if _recorded(w) else _direct(_identity, w)


def reduce_scatter_seq(x, dim, handle, batch=None):
    if not _recorded(x):
        return _direct(_reduce_scatter_seq, x, dim, handle, batch)
    return _ReduceScatterSeq.apply(x, dim, handle, batch)


def gather_seq_to_tp(x, dim, handle, batch=None):
    if not _recorded(x):
        return _direct(_all_gather_seq, x, dim, handle, batch)
    return _GatherSeqToTP.apply(x, dim, handle, batch)


all_reduce.FORWARD, all_reduce.BACKWARD = "all_reduce", None
copy_to_tp.FORWARD, copy_to_tp.BACKWARD = None, "all_reduce"
all_gather.FORWARD, all_gather.BACKWARD = "all_gather", None
local_chunk.FORWARD, local_chunk.BACKWARD = None, None
partial_grad.FORWARD, partial_grad.BACKWARD = None, None
sum_grad_rows.FORWARD, sum_grad_rows.BACKWARD = None, "all_reduce"
reduce_scatter_seq.FORWARD, reduce_scatter_seq.BACKWARD = "reduce_scatter", "all_gather"
gather_seq_to_tp.FORWARD, gather_seq_to_tp.BACKWARD = "all_gather", "reduce_scatter"

COLLECTIVE_OPS = (all_reduce, copy_to_tp, all_gather, reduce_scatter_seq, gather_seq_to_tp, sum_grad_rows)
GRADIENT_OF_CONSUMERS = (copy_to_tp, gather_seq_to_tp)
"""Ops whose backward collective acts on the gradient their (sharded) consumers send back."""
