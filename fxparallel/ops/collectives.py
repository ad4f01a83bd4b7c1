"""Autograd-aware collectives over the tensor-parallel group (Megatron's conjugate pairs).

Each op states which collective it runs in the forward and in the backward pass
(``FORWARD`` / ``BACKWARD``), so the plan can count them from the graph.

* ``all_reduce``:   forward all-reduce,  backward identity   (partial -> replicated)
* ``copy_to_tp``:   forward identity,    backward all-reduce (replicated value used on shards)
* ``all_gather``:   forward all-gather,  backward local slice (shard -> replicated)
* ``local_chunk``:  forward local slice, backward zero-padding (replicated -> shard, no communication)

``all_reduce_many`` / ``copy_to_tp_many`` (and ``reduce_scatter_seq_many`` / ``gather_seq_to_tp_many``
below) are those ops for several tensors at once, with one collective each way (a LoRA adapter's rank-r values
joining its base layer's: ``rewrite/coalesce_collectives.py``).

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
the collectives take equal sizes, and trims after.

Every collective goes through one contiguous buffer laid out along dim 0 (``[world, *piece]``:
``all_gather_single`` / ``reduce_scatter_single``), so a gather holds that buffer and the result
(a view of it where the gathered dim is the first) and nothing else, where list-form collectives
held every part, their concatenation and, on NCCL, a flat staging buffer besides (gloo stages
through a flat buffer of its own in either form: there the peak stays at twice the result). Under
``torch.compile`` the same buffers go through functional collectives (``funcol``), which Dynamo
traces into one graph (it cannot trace the list-form ``dist.reduce_scatter``: a graph break, and an
error with ``fullgraph=True``; ``tests/test_collective_tracing.py``).
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.utils.checkpoint

from ..errors import ShardingError
from ..group import group_by_handle


def _dist(name: str, older: str):
    """``torch.distributed.<name>``, else ``<older>`` (the *_single names replace *_into_tensor / *_tensor in
    recent torch, same semantics), looked up at each call so that wrappers of ``dist`` (collective
    counters, recorders) see it."""
    return getattr(dist, name, None) or getattr(dist, older)


_TRACED_GATHER = getattr(funcol, "all_gather_single", None) or funcol.all_gather_tensor
_TRACED_REDUCE_SCATTER = getattr(funcol, "reduce_scatter_single", None) or funcol.reduce_scatter_tensor


def _all_reduce(x: torch.Tensor, handle: int, owned: bool = False) -> torch.Tensor:
    """``x`` summed over the ranks; in place when ``owned`` (a buffer nothing else reads), else in a copy."""
    group = group_by_handle(handle)
    if group.size == 1:
        return x
    if torch.compiler.is_compiling():  # traceable: Dynamo keeps one graph across it (no graph break)
        return funcol.wait_tensor(funcol.all_reduce(x.contiguous(), "sum", group.process_group))
    if in_selective_checkpointing():
        return functional_all_reduce(x, group.process_group)
    if not owned:
        x = x.contiguous().clone()
    dist.all_reduce(x, group=group.process_group)
    return x


# ---- selective activation checkpointing keeps the all-reduces' outputs ----------------------------------
# (``runtime/activation_checkpointing.py``). Its policy sees the ops a layer dispatches and caches the outputs
# of those it saves for the recomputation; ``dist.all_reduce`` dispatches ``c10d.allreduce_``, in place on
# the clone, whose result the caller reads from its input, so caching it would hand the recomputation an
# unreduced clone. Inside such a region the all-reduce is the functional op instead (a new tensor, cacheable),
# in the forward and in its recomputation alike, which must dispatch the same ops. Elsewhere it stays
# ``dist.all_reduce`` (the same cost on gloo: ~32 us per call either way at world 1).

_SAC_MODES = tuple(getattr(torch.utils.checkpoint, name) for name in
                   ("_CachingTorchDispatchMode", "_CachedTorchDispatchMode") if hasattr(torch.utils.checkpoint, name))
FUNCTIONAL_ALL_REDUCE = (torch.ops._c10d_functional.all_reduce.default,)
"""The op that ``functional_all_reduce`` runs the collective with: what a selective policy saves."""
FUNCTIONAL_SEQUENCE = (torch.ops._c10d_functional.all_gather_into_tensor.default,
                       torch.ops._c10d_functional.reduce_scatter_tensor.default)
"""The ops sequence parallelism's gathers and reduce-scatters run with inside such a region: saved too."""


def in_selective_checkpointing() -> bool:
    """Whether this thread runs the forward (caching mode) or the recomputation (cached mode) of a region
    under ``torch.utils.checkpoint``'s selective checkpointing; False, and so the in-place all-reduce, if a
    torch release renames those modes (the policy then recomputes it: correct, one more collective)."""
    modes = torch._C._len_torch_dispatch_stack()
    return bool(modes) and any(isinstance(torch._C._get_dispatch_stack_at(i), _SAC_MODES) for i in range(modes))


def functional_all_reduce(x: torch.Tensor, process_group) -> torch.Tensor:
    """``x`` summed over ``process_group`` into a new tensor (the raw ops, not ``funcol``'s wrapper subclass)."""
    ops = torch.ops._c10d_functional
    return ops.wait_tensor(ops.all_reduce(x.contiguous(), "sum", process_group.group_name))


def _gather_stacked(x: torch.Tensor, process_group, world: int) -> torch.Tensor:
    """Every rank's ``x`` (equal shapes) in one buffer ``[world, *x.shape]``, in rank order."""
    x = x.contiguous()
    if torch.compiler.is_compiling():
        out = funcol.wait_tensor(_TRACED_GATHER(x.reshape(-1), 0, process_group))
        return out.view(world, *x.shape)
    if in_selective_checkpointing():  # a new tensor the region's policy can keep
        ops = torch.ops._c10d_functional
        out = ops.wait_tensor(ops.all_gather_into_tensor(x.reshape(-1), world, process_group.group_name))
        return out.view(world, *x.shape)
    out = x.new_empty((world, *x.shape))
    # flat: gloo wants each rank's piece of the output shaped as x
    _dist("all_gather_single", "all_gather_into_tensor")(out.view(-1), x.view(-1), group=process_group)
    return out


def _reduce_scatter_stacked(stacked: torch.Tensor, process_group) -> torch.Tensor:
    """``stacked`` ([world, *shape]) summed over the ranks, this rank's ``[rank]`` entry kept (shape)."""
    stacked = stacked.contiguous()
    if torch.compiler.is_compiling():
        out = funcol.wait_tensor(_TRACED_REDUCE_SCATTER(stacked.reshape(-1), "sum", 0, process_group))
        return out.view(stacked.shape[1:])
    if in_selective_checkpointing():
        ops = torch.ops._c10d_functional
        out = ops.wait_tensor(ops.reduce_scatter_tensor(stacked.reshape(-1), "sum", stacked.shape[0],
                                                        process_group.group_name))
        return out.view(stacked.shape[1:])
    out = stacked.new_empty(stacked.shape[1:])
    _dist("reduce_scatter_single", "reduce_scatter_tensor")(out.view(-1), stacked.view(-1), group=process_group)
    return out


def _padded(x: torch.Tensor, dim: int, sizes=None) -> torch.Tensor:
    """``x`` with zeros after it along ``dim`` up to the largest of ``sizes`` (None: ``x``)."""
    if not sizes or x.shape[dim] >= max(sizes):
        return x
    pad = list(x.shape)
    pad[dim] = max(sizes) - x.shape[dim]
    return torch.cat([x, x.new_zeros(pad)], dim=dim)


def _split_sizes(full_parts, tp: int, sizes=None, whole=()) -> list:
    """Per segment, each rank's size: ``sizes`` when uneven, else ``segment // tp`` (the segment if whole)."""
    if sizes:
        return [list(s) for s in sizes]
    return [[seg] * tp if i in whole else [seg // tp] * tp for i, seg in enumerate(full_parts)]


def gather_parts(x: torch.Tensor, dim: int, process_group, world: int, sizes=None) -> list:
    """Every rank's ``x`` along ``dim``, in rank order: views of one gathered buffer. ``sizes``: each
    rank's size there when they differ (sent padded to the largest: the collective takes equal shapes)."""
    return _parts(_gather_stacked(_padded(x, dim, sizes), process_group, world), dim, sizes)


def gather_full(x: torch.Tensor, dim: int, process_group, world: int, sizes=None) -> torch.Tensor:
    """Every rank's ``x`` concatenated along ``dim`` (``sizes`` as in ``gather_parts``): a view of the
    gathered buffer where ``dim`` is the first and the sizes are even, else one copy of it."""
    return _joined(_gather_stacked(_padded(x, dim, sizes), process_group, world), dim, sizes)


def gather_parts_to(x: torch.Tensor, dim: int, process_group, world: int, dst: int, sizes=None):
    """``gather_parts`` received by the group's rank ``dst`` only; None on the other ranks, which send."""
    stacked = _gather_stacked_to(_padded(x, dim, sizes), process_group, world, dst)
    return None if stacked is None else _parts(stacked, dim, sizes)


def gather_full_to(x: torch.Tensor, dim: int, process_group, world: int, dst: int, sizes=None):
    """``gather_full`` received by the group's rank ``dst`` only; None on the other ranks, which send."""
    stacked = _gather_stacked_to(_padded(x, dim, sizes), process_group, world, dst)
    return None if stacked is None else _joined(stacked, dim, sizes)


def _gather_stacked_to(x: torch.Tensor, process_group, world: int, dst: int):
    """``_gather_stacked`` on the group's rank ``dst`` (``dist.gather``); the other ranks send their ``x``,
    receive nothing and get None. Eager only (an export's gather, never in a compiled graph)."""
    x = x.contiguous()
    if dist.get_rank(process_group) != dst:
        dist.gather(x, None, group=process_group, group_dst=dst)
        return None
    out = x.new_empty((world, *x.shape))
    dist.gather(x, list(out.unbind(0)), group=process_group, group_dst=dst)
    return out


def _parts(stacked: torch.Tensor, dim: int, sizes=None) -> list:
    """The per-rank pieces of a gathered ``[world, *padded]`` buffer (views), trimmed to ``sizes``."""
    parts = stacked.unbind(0)
    return list(parts) if sizes is None else [p.narrow(dim, 0, n) for p, n in zip(parts, sizes)]


def _joined(stacked: torch.Tensor, dim: int, sizes=None) -> torch.Tensor:
    """The pieces of a gathered buffer concatenated along ``dim``: a view where ``dim`` is 0 and sizes even."""
    return _merge_ranks(stacked, dim) if sizes is None else torch.cat(_parts(stacked, dim, sizes), dim=dim)


def _merge_ranks(stacked: torch.Tensor, dim: int) -> torch.Tensor:
    """[world, *shape] -> shape with ``dim`` ``world`` times longer, rank after rank (a view for dim 0)."""
    return stacked.movedim(0, dim).flatten(dim, dim + 1)


def _all_gather(x: torch.Tensor, dim: int, handle: int, segments=None, sizes=None, whole=()) -> torch.Tensor:
    group = group_by_handle(handle)
    if group.size == 1:
        return x
    dim = dim % x.dim()
    if not segments and not sizes:
        return gather_full(x, dim, group.process_group, group.size)
    local = [sum(s[r] for s in sizes) for r in range(group.size)] if sizes else None  # uneven: each rank's size
    parts = gather_parts(x, dim, group.process_group, group.size, local)
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
    stacked = view.unflatten(d, (group.size, -1)).movedim(d, 0)  # [rank, ..., its tokens, ...]
    return _token_merge(_reduce_scatter_stacked(stacked, group.process_group), dim, batch)


def _all_gather_seq(x: torch.Tensor, dim: int, handle: int, batch=None) -> torch.Tensor:
    group = group_by_handle(handle)
    if group.size == 1:
        return x
    view, d = _token_view(x, dim, batch)
    stacked = _gather_stacked(view, group.process_group, group.size)
    return _token_merge(_merge_ranks(stacked, d), dim, batch)


def _named(function: type, name: str) -> type:
    """``function`` (an autograd.Function made by a factory here) as a subclass called ``name``: its backward
    node is then ``name + "Backward"`` in profiles and autograd graphs, not the factory's class name."""
    return type(name, (function,), {"__qualname__": name, "__module__": __name__})


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

    return _named(Pair, name)


_ReduceScatterSeq = _sequence_pair(_reduce_scatter_seq, _all_gather_seq, "_ReduceScatterSeq")
_GatherSeqToTP = _sequence_pair(_all_gather_seq, _reduce_scatter_seq, "_GatherSeqToTP")


def _along_tokens(collective, xs, dim: int, handle: int, batch=None) -> tuple:
    """``collective(x, dim, handle, batch)`` of each tensor of ``xs`` (one dtype, the same sizes up to the token
    dim ``dim``) in one call: their features after ``dim`` flattened and concatenated."""
    if group_by_handle(handle).size == 1:
        return tuple(xs)
    flat = [x.reshape(*x.shape[:dim + 1], -1) for x in xs]
    out = collective(torch.cat(flat, dim=-1), dim, handle, batch)
    pieces = out.split([f.shape[-1] for f in flat], dim=-1)
    return tuple(piece.reshape(*piece.shape[:dim + 1], *x.shape[dim + 1:]) for piece, x in zip(pieces, xs))


def _sequence_many(fwd, bwd, name: str):
    """``_sequence_pair`` for several tensors at once, one collective each way (``_along_tokens``)."""

    class Many(torch.autograd.Function):
        @staticmethod
        def forward(ctx, dim, handle, batch, *xs):
            ctx.args = (dim, handle, batch)
            return _along_tokens(fwd, xs, dim, handle, batch)

        @staticmethod
        def backward(ctx, *grads):
            return (None, None, None) + _along_tokens(bwd, grads, *ctx.args)

    return _named(Many, name)


_ReduceScatterSeqMany = _sequence_many(_reduce_scatter_seq, _all_gather_seq, "_ReduceScatterSeqMany")
_GatherSeqToTPMany = _sequence_many(_all_gather_seq, _reduce_scatter_seq, "_GatherSeqToTPMany")


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

    return _named(GradientOnly, name)


def _first_rank_keeps(grad: torch.Tensor, handle: int) -> torch.Tensor:
    """A replicated gradient as a partial one: the first rank's copy, zero on the others."""
    return torch.zeros_like(grad) if group_by_handle(handle).rank else grad


def _sum_rows(grad: torch.Tensor, dim: int, ranges, handle: int) -> torch.Tensor:
    """``grad`` with its [start, stop) ranges along ``dim`` all-reduced (one call for all of them)."""
    if group_by_handle(handle).size == 1:
        return grad
    grad = grad.clone()
    rows = [grad.narrow(dim, start, stop - start) for start, stop in ranges]
    summed = _all_reduce(torch.cat([r.reshape(-1) for r in rows]), handle, owned=True)
    offset = 0
    for r in rows:
        r.copy_(summed[offset:offset + r.numel()].view_as(r))
        offset += r.numel()
    return grad


def _all_reduce_together(xs, handle: int) -> tuple:
    """Each tensor of ``xs`` (one dtype) summed over the ranks, with one all-reduce of their concatenation."""
    if group_by_handle(handle).size == 1:
        return tuple(xs)
    flat = _all_reduce(torch.cat([x.reshape(-1) for x in xs]), handle, owned=True)
    return tuple(piece.view(x.shape) for piece, x in zip(flat.split([x.numel() for x in xs]), xs))


class _AllReduceMany(torch.autograd.Function):
    @staticmethod
    def forward(ctx, handle, *xs):
        return _all_reduce_together(xs, handle)

    @staticmethod
    def backward(ctx, *grads):
        return (None,) + grads


class _CopyToTPMany(torch.autograd.Function):
    @staticmethod
    def forward(ctx, handle, *xs):
        ctx.handle = handle
        return tuple(x.view_as(x) for x in xs)

    @staticmethod
    def backward(ctx, *grads):
        return (None,) + _all_reduce_together(grads, ctx.handle)


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
    # one rank: the identity runs directly, a view of x, not a Function's output that is its input (autograd
    # forbids in-place ops on that, and GPT-OSS adds its expert bias in place after the reduction); forward-mode
    # AD and torch.func still reach the Function, which refuses them
    alone = group_by_handle(handle).size == 1 and torch.autograd.forward_ad._current_level < 0 \
        and not torch._C._are_functorch_transforms_active()
    if alone and x._is_view():  # a view may come from a function that returns several (a layer's output under FSDP
        return x.clone()  # was one), which no view of it may change in place (GPT-OSS adds its experts' bias so)
    return _AllReduce.apply(x, handle) if _recorded(x) and not alone else _direct(_all_reduce, x, handle)


def copy_to_tp(x, handle):
    return _CopyToTP.apply(x, handle) if _recorded(x) else _direct(_identity, x)


def all_reduce_many(xs, handle):
    """``all_reduce`` of each tensor of ``xs`` in one collective (``rewrite/coalesce_collectives.py``)."""
    if any(_recorded(x) for x in xs) and group_by_handle(handle).size > 1:
        return _AllReduceMany.apply(handle, *xs)
    return tuple(out.view_as(x) if out is x else out for out, x in zip(_all_reduce_together(xs, handle), xs))


def copy_to_tp_many(xs, handle):
    """``copy_to_tp`` of each tensor of ``xs``: their gradients all-reduced in one collective. A tensor autograd
    does not record (a frozen parameter) is left out of it, as ``copy_to_tp`` skips it."""
    recorded = [i for i, x in enumerate(xs) if _recorded(x)]
    out = [x.view_as(x) for x in xs]
    if recorded:
        for i, y in zip(recorded, _CopyToTPMany.apply(handle, *(xs[i] for i in recorded))):
            out[i] = y
    return tuple(out)


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


def reduce_scatter_seq_many(xs, dim, handle, batch=None):
    """``reduce_scatter_seq`` of each tensor of ``xs`` in one collective each way."""
    if any(_recorded(x) for x in xs) and group_by_handle(handle).size > 1:
        return _ReduceScatterSeqMany.apply(dim, handle, batch, *xs)
    return tuple(out.view_as(x) if out is x else out for out, x in zip(_along_tokens(_reduce_scatter_seq, xs, dim,
                                                                                      handle, batch), xs))


def gather_seq_to_tp_many(xs, dim, handle, batch=None):
    """``gather_seq_to_tp`` of each tensor of ``xs`` in one collective each way."""
    if any(_recorded(x) for x in xs) and group_by_handle(handle).size > 1:
        return _GatherSeqToTPMany.apply(dim, handle, batch, *xs)
    return tuple(out.view_as(x) if out is x else out for out, x in zip(_along_tokens(_all_gather_seq, xs, dim,
                                                                                      handle, batch), xs))


all_reduce.FORWARD, all_reduce.BACKWARD = "all_reduce", None
copy_to_tp.FORWARD, copy_to_tp.BACKWARD = None, "all_reduce"
all_reduce_many.FORWARD, all_reduce_many.BACKWARD = "all_reduce", None
copy_to_tp_many.FORWARD, copy_to_tp_many.BACKWARD = None, "all_reduce"
all_gather.FORWARD, all_gather.BACKWARD = "all_gather", None
local_chunk.FORWARD, local_chunk.BACKWARD = None, None
partial_grad.FORWARD, partial_grad.BACKWARD = None, None
sum_grad_rows.FORWARD, sum_grad_rows.BACKWARD = None, "all_reduce"
reduce_scatter_seq.FORWARD, reduce_scatter_seq.BACKWARD = "reduce_scatter", "all_gather"
gather_seq_to_tp.FORWARD, gather_seq_to_tp.BACKWARD = "all_gather", "reduce_scatter"
reduce_scatter_seq_many.FORWARD, reduce_scatter_seq_many.BACKWARD = "reduce_scatter", "all_gather"
gather_seq_to_tp_many.FORWARD, gather_seq_to_tp_many.BACKWARD = "all_gather", "reduce_scatter"

COLLECTIVE_OPS = (all_reduce, copy_to_tp, all_gather, reduce_scatter_seq, gather_seq_to_tp, sum_grad_rows,
                  all_reduce_many, copy_to_tp_many, reduce_scatter_seq_many, gather_seq_to_tp_many)
GRADIENT_OF_CONSUMERS = (copy_to_tp, gather_seq_to_tp, copy_to_tp_many, gather_seq_to_tp_many)
"""Ops whose backward collective acts on the gradient their (sharded) consumers send back."""
