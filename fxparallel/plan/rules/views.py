"""View-like ops: reshape, transpose, expand, indexing, ...

The rule follows the sharded dimension through the shape change. Reshapes are
matched by groups of dimensions with equal products; a shard survives a reshape
only if it is the outermost dimension of its group on both sides (so each rank's
chunk stays contiguous). Literal sizes of the sharded dimension in the op's
arguments (hard-coded head counts, hidden sizes) are rewritten to local sizes.
"""
from __future__ import annotations

import builtins
import operator
from typing import Optional

import sympy
import torch
import torch.fx as fx

from ...errors import ShardingError
from ..placement import R, S
from .base import Strategy, arg, handles_blocks, handles_whole, norm_dim, register, tensor_inputs
from .experts import gather_index, gather_strategies, input_choices, is_expert_weight


def _expr(size):
    return size.node.expr if isinstance(size, torch.SymInt) else sympy.Integer(int(size))


def _hint(size) -> int:
    if isinstance(size, torch.SymInt):
        return int(size.node.hint)
    return int(size)


def _same(a, b) -> bool:
    return sympy.expand(_expr(a) - _expr(b)) == 0


def dim_groups(in_shape, out_shape) -> Optional[list]:
    """Pair dims of a reshape: a list of (input dims, output dims) with equal element counts."""
    i = j = 0
    groups = []
    n_in, n_out = len(in_shape), len(out_shape)
    try:
        while i < n_in or j < n_out:
            if i < n_in and j < n_out and _same(in_shape[i], out_shape[j]):
                groups.append(([i], [j]))
                i, j = i + 1, j + 1
                continue
            if i < n_in and _hint(in_shape[i]) == 1:
                groups.append(([i], []))
                i += 1
                continue
            if j < n_out and _hint(out_shape[j]) == 1:
                groups.append(([], [j]))
                j += 1
                continue
            gi, gj = [i], [j]
            pi, pj = _expr(in_shape[i]), _expr(out_shape[j])
            hi, hj = _hint(in_shape[i]), _hint(out_shape[j])
            i, j = i + 1, j + 1
            while sympy.expand(pi - pj) != 0:
                if hi < hj:
                    gi.append(i)
                    pi, hi = pi * _expr(in_shape[i]), hi * _hint(in_shape[i])
                    i += 1
                else:
                    gj.append(j)
                    pj, hj = pj * _expr(out_shape[j]), hj * _hint(out_shape[j])
                    j += 1
            groups.append((gi, gj))
    except IndexError:
        return None
    return groups


def reshape_shard_dim(in_shape, out_shape, dim: int, tp: int, split_sizes=None) -> Optional[int]:
    """Output dim that carries input shard ``dim`` through a reshape, or None if it cannot.

    ``split_sizes(size)``: each rank's part of a dimension (default: even); the input's and the
    output's parts must be proportional, so every rank's block stays the same elements."""
    if split_sizes is None:
        split_sizes = lambda n: (n // tp,) * tp if isinstance(n, int) and n % tp == 0 else None  # noqa: E731
    groups = dim_groups(in_shape, out_shape)
    if groups is None:
        return None
    for gi, gj in groups:
        if dim in gi:
            outer_in = [d for d in gi if _hint(in_shape[d]) != 1]
            outer_out = [d for d in gj if _hint(out_shape[d]) != 1]
            if not outer_in or outer_in[0] != dim or not outer_out:
                return None
            o = outer_out[0]
            size, full = out_shape[o], in_shape[dim]
            if isinstance(size, int) and _same(size, full):
                return o  # the sharded dim passes unchanged, and so does its split
            out_parts, in_parts = split_sizes(size), split_sizes(full)
            if out_parts is None or in_parts is None:
                return None
            if any(i * size != j * full for i, j in zip(in_parts, out_parts)):
                return None  # e.g. whole heads on one side, whole columns on the other
            return o
    return None


def _size_args(node: fx.Node):
    """(list of sizes, rebuild function) for view/reshape/expand style size arguments."""
    args = list(node.args)
    start = 1 if node.op == "call_method" or node.target in (torch.reshape,) else 1
    rest = args[start:]
    if len(rest) == 1 and isinstance(rest[0], (tuple, list)):
        sizes = list(rest[0])

        def rebuild(new):
            node.args = tuple(args[:start]) + (type(rest[0])(new),)

    else:
        sizes = rest

        def rebuild(new):
            node.args = tuple(args[:start]) + tuple(new)

    if not rest and "size" in node.kwargs:
        sizes = list(node.kwargs["size"])

        def rebuild(new):
            node.kwargs = {**node.kwargs, "size": tuple(new)}

    return sizes, rebuild


def rewrite_size(out_dim: int, full: int, segmented=None):
    """A rewrite that replaces the literal size ``full`` at ``out_dim`` with its local size
    (this rank's part of each segment, for the segmented shard ``segmented``)."""

    def apply(node, ctx):
        sizes, rebuild = _spelled_out_sizes(node, ctx)
        if out_dim >= len(sizes):
            return
        value = sizes[out_dim]
        if isinstance(value, int) and value != -1:
            if value != full:
                raise ShardingError(f"{node.format_node()}: size {value} at dim {out_dim} is not the expected {full}")
            sizes[out_dim] = sum(ctx.local_parts(segmented)) if segmented else ctx.local_size(full)
            rebuild(sizes)

    return apply


def _spelled_out_sizes(node, ctx):
    """(sizes, rebuild) of a view/reshape, one entry per output dim even when the shape is one
    value computed in the graph."""
    sizes, rebuild = _size_args(node)
    if len(sizes) == 1 and isinstance(sizes[0], fx.Node) and not isinstance(
        sizes[0].meta.get("example_value"), (int, torch.SymInt)
    ):
        sizes, rebuild = _explode_size_node(node, sizes[0], ctx)
    return sizes, rebuild


def _explode_size_node(node, size_node, ctx):
    """``x.view(shape)`` where ``shape`` is computed in the graph (e.g. ``x.size()[:-1] + (heads, dim)``):
    spell it out element by element, static sizes as literals, symbolic ones read from ``shape``."""
    out = node.meta["example_value"]
    sizes = []
    for i, s in enumerate(out.shape):
        if isinstance(s, int):
            sizes.append(s)
        else:
            with ctx.graph.inserting_before(node):
                sizes.append(ctx.graph.call_function(operator.getitem, (size_node, i)))

    def rebuild(new):
        node.args = (node.args[0], tuple(new))

    return sizes, rebuild


def _reshape(node, placements, ctx):
    inputs = tensor_inputs(node)
    if not inputs or node.args[0] is not inputs[0]:
        return []
    x = inputs[0]
    p = placements[x]
    out = ctx.fake(node)
    strategies = []
    sized = node.target in ("view", "reshape", torch.reshape)  # sizes spelled out in the arguments
    if p.is_shard and p.block is not None and out is not None:
        strategies.extend(_from_block(node, x, p, out, ctx, sized))
    elif p.is_shard and out is not None:
        o = reshape_shard_dim(ctx.fake(x).shape, out.shape, p.dim, ctx.tp, ctx.split_sizes)
        if p.segments and (o is None or not _same(ctx.fake(x).shape[p.dim], out.shape[o])):
            strategies.extend(_segments_by_head(node, x, p, out, ctx, sized))
            o = None  # a segmented dim survives a reshape otherwise only unchanged
        if o is not None:
            rw = rewrite_size(o, int(out.shape[o]), p if p.segments else None) if sized else None
            strategies.append(Strategy({x: p}, p.with_dim(o), rewrite=rw))
        elif not p.segments:
            strategies.extend(_into_block(node, x, p, out, ctx, sized))
    strategies.append(Strategy({x: R}, R))
    return strategies


register("view", "reshape", "flatten", "unflatten", "squeeze", "unsqueeze", torch.reshape, torch.flatten,
         torch.squeeze, torch.unsqueeze)(handles_whole(handles_blocks(_reshape)))


def _segments_by_head(node, x, p, out, ctx, sized) -> list:
    """A segmented dim with whole parts viewed as ``[heads, head_dim]`` (Falcon-7B's
    ``fused.view(b, s, heads + 2, head_dim)``): the segments, counted in heads, on the heads dim."""
    in_shape = ctx.fake(x).shape
    big_in, big_out = _group_of(in_shape, out.shape, p.dim)
    if not p.whole or big_in != [p.dim] or len(big_out) != 2 or not isinstance(out.shape[big_out[1]], int):
        return []
    unit = int(out.shape[big_out[1]])
    if any(seg % unit for seg in p.segments):
        return []
    heads = S(big_out[0], tuple(seg // unit for seg in p.segments), whole=p.whole)
    if not all(ctx.can_split(seg) for i, seg in enumerate(heads.segments) if i not in heads.whole):
        return []
    return [Strategy({x: p}, heads, rewrite=rewrite_size(heads.dim, int(out.shape[heads.dim]), heads) if sized else None,
                     note="fused projection viewed by head")]


def _group_of(in_shape, out_shape, dim):
    """(input dims, output dims) of the reshape group holding input ``dim``, size-1 dims left out."""
    for gi, gj in dim_groups(in_shape, out_shape) or ():
        if dim in gi:
            return [d for d in gi if _hint(in_shape[d]) != 1], [d for d in gj if _hint(out_shape[d]) != 1]
    return None, None


def _into_block(node, x, p, out, ctx, sized) -> list:
    """A sharded dim merged as the inner factor of one output dim (``(b, heads, s, d) -> (b * heads, s, d)``):
    a blocked shard of that dim."""
    in_shape = ctx.fake(x).shape
    big_in, big_out = _group_of(in_shape, out.shape, p.dim)
    block = in_shape[p.dim]
    if not big_in or len(big_in) < 2 or big_in[-1] != p.dim or len(big_out) != 1 or not isinstance(block, int):
        return []
    o = big_out[0]
    return [Strategy({x: p}, S(o, block=block), rewrite=rewrite_block_size(o, block) if sized else None,
                     note="sharded heads merged with the batch (blocked shard)")]


def _from_block(node, x, p, out, ctx, sized) -> list:
    """A blocked dim kept whole, or split back so that its block is a dim of its own (a plain shard)."""
    in_shape = ctx.fake(x).shape
    big_in, big_out = _group_of(in_shape, out.shape, p.dim)
    if big_in != [p.dim] or not big_out:
        return []
    if len(big_out) == 1 and _same(in_shape[p.dim], out.shape[big_out[0]]):
        o = big_out[0]
        return [Strategy({x: p}, p.with_dim(o), rewrite=rewrite_block_size(o, p.block) if sized else None)]
    inner = out.shape[big_out[-1]]
    if len(big_out) >= 2 and isinstance(inner, int) and inner == p.block:
        o = big_out[-1]
        return [Strategy({x: p}, S(o), rewrite=rewrite_size(o, p.block) if sized else None)]
    return []


def rewrite_block_size(out_dim: int, block: int):
    """A rewrite of the size at ``out_dim`` of a blocked dim: ``outer * block`` becomes ``outer * local``,
    for a literal and for a size computed in the graph (``batch * heads``) alike."""

    def apply(node, ctx):
        sizes, rebuild = _spelled_out_sizes(node, ctx)
        if out_dim >= len(sizes) or sizes[out_dim] == -1:
            return
        value, local = sizes[out_dim], ctx.local_size(block)
        if isinstance(value, int):
            sizes[out_dim] = value // block * local
        else:
            with ctx.graph.inserting_before(node):
                outer = ctx.graph.call_function(operator.floordiv, (value, block))
                sizes[out_dim] = ctx.graph.call_function(operator.mul, (outer, local))
        rebuild(sizes)

    return apply


def _view_as(node, placements, ctx):
    """``x.view_as(other)``: a reshape to ``other``'s shape, so ``other`` must hold the same shard."""
    x, other = node.args[0], arg(node, 1, "other")
    p, out = placements[x], ctx.fake(node)
    strategies = []
    if p.is_shard and not p.segments and p.block is None and isinstance(other, fx.Node):
        o = reshape_shard_dim(ctx.fake(x).shape, out.shape, p.dim, ctx.tp, ctx.split_sizes)
        if o is not None:
            strategies.append(Strategy({x: p, other: S(o)}, S(o)))
    strategies.append(Strategy({t: R for t in tensor_inputs(node)}, R))
    return strategies


register("view_as")(_view_as)


def _complex_view(node, placements, ctx):
    """view_as_complex (last dim of 2 floats -> one complex) and view_as_real (the reverse): every
    other dim maps to itself, so a shard of another dim stays (Llama 4's complex rotary)."""
    x = node.args[0]
    p = placements[x]
    strategies = []
    if p.is_shard and not p.segments and p.block is None and p.dim < min(ctx.ndim(x), ctx.ndim(node)) - 1:
        strategies.append(Strategy({x: p}, p))
    strategies.append(Strategy({x: R}, R))
    return strategies


register(torch.view_as_complex, torch.view_as_real)(_complex_view)


def _expand(node, placements, ctx):
    x = node.args[0]
    p = placements[x]
    out = ctx.fake(node)
    strategies = []
    if p.is_shard:
        o = p.dim + out.dim() - ctx.ndim(x)
        if p.segments or ctx.can_split(out.shape[o]):
            strategies.append(Strategy({x: p}, p.with_dim(o),
                                       rewrite=rewrite_size(o, int(out.shape[o]), p if p.segments else None)))
    strategies.append(Strategy({x: R}, R))
    return strategies


register("expand")(_expand)


def _permutation(node, ndim):
    if node.target in ("transpose", torch.transpose, "swapaxes", "swapdims"):
        a = norm_dim(node.args[1], ndim)
        b = norm_dim(node.args[2], ndim)
        perm = list(range(ndim))
        perm[a], perm[b] = perm[b], perm[a]
        return perm
    if node.target in ("permute", torch.permute):
        dims = node.args[1:] if not isinstance(node.args[1], (tuple, list)) else node.args[1]
        return [norm_dim(d, ndim) for d in dims]
    if node.target in ("t",):
        return list(reversed(range(ndim)))
    if node.target is builtins.getattr and node.args[1] in ("T", "mT"):  # Falcon's ``x @ self.weight.T``
        perm = list(range(ndim))
        if node.args[1] == "T":
            return list(reversed(perm))
        perm[-1], perm[-2] = perm[-2], perm[-1]
        return perm
    return None


def _permute(node, placements, ctx):
    x = node.args[0]
    strategies = []
    for p in input_choices(x, placements, ctx, matrices=True):  # a weight transposed first is decided here
        if p.is_shard:
            perm = _permutation(node, ctx.ndim(x))
            if perm is not None:
                note = "expert weights (each rank its slice of every expert)" if is_expert_weight(x) else ""
                strategies.append(Strategy({x: p}, p.with_dim(perm.index(p.dim)), note=note))
    strategies.append(Strategy({x: R}, R))
    return strategies


register("transpose", "permute", "swapaxes", "swapdims", "t", torch.transpose, torch.permute,
         builtins.getattr)(handles_whole(handles_blocks(_permute)))


def index_shard_dim(index, ndim: int, dim: int) -> Optional[int]:
    """Output dim of input dim ``dim`` after basic indexing ``x[index]``, or None."""
    if not isinstance(index, tuple):
        index = (index,)
    consumed = sum(1 for i in index if isinstance(i, (int, slice)))
    out = 0
    src = 0
    for item in index:
        if item is None:
            out += 1
        elif item is Ellipsis:
            span = ndim - consumed
            if src <= dim < src + span:
                return out + (dim - src)
            src += span
            out += span
        elif isinstance(item, int):
            if src == dim:
                return None
            src += 1
        elif isinstance(item, slice):
            if src == dim:
                return out if item == slice(None) else None
            src += 1
            out += 1
        else:
            return None  # tensor or symbolic index
    if dim >= src:
        return out + (dim - src)
    return None


def _getitem(node, placements, ctx):
    x = node.args[0]
    if ctx.fake(x) is None:
        return []  # indexing a tuple: the solver handles it
    ids = gather_index(node)
    if ids is not None:
        return gather_strategies(node, x, ids, placements, ctx)
    p = placements[x]
    index = node.args[1]
    plain = all(
        i is None or i is Ellipsis or isinstance(i, int) or isinstance(i, slice)
        for i in (index if isinstance(index, tuple) else (index,))
    ) and not any(
        isinstance(getattr(i, a, None), fx.Node)
        for i in (index if isinstance(index, tuple) else (index,)) if isinstance(i, slice)
        for a in ("start", "stop", "step")
    )
    inputs = tensor_inputs(node)
    strategies = []
    if plain and inputs == [x]:
        if p.is_shard:
            o = index_shard_dim(index, ctx.ndim(x), p.dim)
            if o is not None:
                strategies.append(Strategy({x: p}, p.with_dim(o)))
            elif p.segments:
                strategies.extend(segment_slice_strategy(node, x, p, index, ctx))
            elif p.block is None:
                strategies.extend(strided_slice_strategy(x, p, index, ctx))
    elif p.is_shard and p.whole and inputs == [x] and _one_item_list_as_slice(index, ctx.fake(x).shape):
        # ``fused[..., [-2], :]``: one head picked by a list, as the slice it equals (Falcon-7B's k and v)
        strategies.extend(segment_slice_strategy(node, x, p, _one_item_list_as_slice(index, ctx.fake(x).shape), ctx))
    elif p.is_shard and inputs == [x]:
        # slices with symbolic bounds on other dims are fine too
        o = _symbolic_index_dim(index, ctx.ndim(x), p.dim)
        if o is not None:
            strategies.append(Strategy({x: p}, p.with_dim(o)))
    strategies.append(Strategy({i: R for i in inputs}, R))
    return strategies


def _one_item_list_as_slice(index, shape) -> Optional[tuple]:
    """``x[..., [i], :]`` as ``x[..., i:i+1, :]`` (the same values and shape), if the index has exactly one
    such list and otherwise only slices, Ellipsis and None; else None."""
    items = index if isinstance(index, tuple) else (index,)
    lists = [k for k, it in enumerate(items) if isinstance(it, list)]
    if len(lists) != 1 or len(items[lists[0]]) != 1 or not isinstance(items[lists[0]][0], int) or not all(
            it is None or it is Ellipsis or isinstance(it, (slice, list)) for it in items):
        return None
    consumed = sum(1 for it in items if isinstance(it, (slice, list)))
    src = 0
    for k, item in enumerate(items):
        if item is Ellipsis:
            src += len(shape) - consumed
        elif item is not None:
            if k == lists[0]:
                size = shape[src]
                if not isinstance(size, int):
                    return None
                i = item[0] % size
                return tuple(slice(i, i + 1) if j == k else it for j, it in enumerate(items))
            src += 1
    return None


def _symbolic_index_dim(index, ndim, dim):
    items = index if isinstance(index, tuple) else (index,)
    simplified = tuple(
        slice(0, 1) if isinstance(i, slice) and any(isinstance(getattr(i, a), fx.Node) for a in ("start", "stop", "step"))
        else i for i in items
    )
    if any(isinstance(i, fx.Node) for i in simplified):
        return None
    # a symbolic slice on the sharded dim is not allowed
    src = 0
    consumed = sum(1 for i in simplified if isinstance(i, (int, slice)))
    for orig, item in zip(items, simplified):
        if item is Ellipsis:
            src += ndim - consumed
        elif item is None:
            continue
        else:
            if src == dim and orig is not item:
                return None
            src += 1
    return index_shard_dim(simplified, ndim, dim)


register(operator.getitem)(handles_whole(_getitem))


def _join(node, placements, ctx, new_dim: bool):
    """cat (new_dim False) and stack (True): inputs sharded alike on another dim stay sharded."""
    tensors = node.args[0]
    if not isinstance(tensors, (tuple, list)) or not all(isinstance(t, fx.Node) for t in tensors):
        return []
    out = ctx.fake(node)
    join_dim = norm_dim(node.args[1] if len(node.args) > 1 else node.kwargs.get("dim", 0), out.dim())
    strategies = []
    for t in tensors:
        p = placements[t]
        if not p.is_shard or (not new_dim and p.dim == join_dim):
            continue
        o = p.dim + 1 if new_dim and p.dim >= join_dim else p.dim
        if ctx.can_split(out.shape[o]):
            s = Strategy({u: p for u in tensors}, p.with_dim(o))
            if all(s.output != other.output for other in strategies):
                strategies.append(s)
    strategies.append(Strategy({t: R for t in tensors}, R))
    return strategies


def _cat(node, placements, ctx):
    return _join(node, placements, ctx, new_dim=False)


register(torch.cat, torch.concat, torch.concatenate)(_cat)


def _stack(node, placements, ctx):
    return _join(node, placements, ctx, new_dim=True)


register(torch.stack)(_stack)


def _pad(node, placements, ctx):
    x = node.args[0]
    pad = arg(node, 1, "pad")
    p = placements[x]
    inputs = tensor_inputs(node)
    strategies = []
    if p.is_shard and isinstance(pad, (tuple, list)) and p.dim < ctx.ndim(x) - len(pad) // 2 and inputs == [x]:
        strategies.append(Strategy({x: p}, S(p.dim)))
    strategies.append(Strategy({i: R for i in inputs}, R))
    return strategies


register(torch.nn.functional.pad)(_pad)


def _sharded_item(items: tuple, ndim: int, dim: int) -> Optional[int]:
    """Position in ``items`` (slices, ints, Ellipsis, None) of the item that indexes input dim ``dim``."""
    consumed = sum(1 for i in items if isinstance(i, (int, slice)))
    src = 0
    for k, item in enumerate(items):
        if item is Ellipsis:
            src += ndim - consumed
        elif item is not None:
            if src == dim:
                return k
            src += 1
    return None


def strided_slice_strategy(x, p, index, ctx) -> list:
    """``x[..., start::k]`` on the sharded dim, ``0 <= start < k``: every k-th element, as GPT-OSS splits its
    interleaved gate/up (``gate_up[..., ::2]``, ``gate_up[..., 1::2]``). When each rank's block is a multiple
    of k, the same slice of the block is the rank's block of the result (its elements are contiguous there),
    so nothing is rewritten; the result's split must be the one the layout gives its size."""
    items = index if isinstance(index, tuple) else (index,)
    position = _sharded_item(items, ctx.ndim(x), p.dim)
    sl = items[position] if position is not None else None
    if not isinstance(sl, slice) or not isinstance(sl.step, int) or sl.step < 2:
        return []
    k, start, size = sl.step, sl.start or 0, ctx.fake(x).shape[p.dim]
    if not isinstance(size, int) or size % k or not 0 <= start < k or (sl.stop is not None and sl.stop < size):
        return []
    sizes = ctx.split_sizes(size)
    if sizes is None or any(s % k for s in sizes) or ctx.split_sizes(size // k) != tuple(s // k for s in sizes):
        return []
    out_dim = index_shard_dim(tuple(slice(None) if j == position else it for j, it in enumerate(items)),
                              ctx.ndim(x), p.dim)
    return [] if out_dim is None else [Strategy({x: p}, p.with_dim(out_dim), note="every k-th element of a shard")]


def segment_slice_strategy(node, x, p, index, ctx) -> list:
    """``fused[..., a:b]`` where [a, b) is one segment of a segmented shard: a plain shard of it."""
    items = index if isinstance(index, tuple) else (index,)
    ndim = ctx.ndim(x)
    position = _sharded_item(items, ndim, p.dim)  # the item that indexes the sharded dim
    if position is None or not isinstance(items[position], slice) or items[position].step not in (None, 1):
        return []
    sl = items[position]
    size = int(ctx.fake(x).shape[p.dim])
    start = 0 if sl.start is None else (sl.start + size if sl.start < 0 else sl.start)
    stop = size if sl.stop is None else (sl.stop + size if sl.stop < 0 else sl.stop)
    bounds, offset = [], 0
    for seg in p.segments:
        bounds.append((offset, offset + seg))
        offset += seg
    if (start, stop) not in bounds:
        return []
    i = bounds.index((start, stop))
    out_dim = index_shard_dim(tuple(slice(None) if k == position else it for k, it in enumerate(items)), ndim, p.dim)
    if out_dim is None:
        return []

    def rewrite(node, rctx):
        parts = rctx.local_parts(p)  # this rank's parts (may be uneven; a whole one entire)
        local_start = sum(parts[:i])
        new = list(items)
        new[position] = slice(local_start, local_start + parts[i])
        node.args = (node.args[0], tuple(new) if isinstance(index, tuple) else new[0])
        if i in p.whole:
            rctx.partial_grad_after(node)

    if i in p.whole:
        return [Strategy({x: p}, R, rewrite=rewrite, note="a whole part of a fused projection")]
    return [Strategy({x: p}, S(out_dim), rewrite=rewrite, note="one segment of a fused projection")]
