"""Indexing: ``x[...]`` (getitem) on a sharded value: basic indexing that keeps the sharded dim
whole, one index of the sharded dim (a partial sum: its owner's value), expert-id gathers
(``experts.py``), strided slices of a block, and one segment of a fused projection (its local
slice is rewritten by ``rewrite/local_ops.py: segment_slice``)."""
from __future__ import annotations

from typing import Optional

import torch.fx as fx

from ..placement import P, R, S
from .base import LocalOp, Strategy, norm_dim, register, tensor_inputs
from .dim_maps import index_shard_dim
from .experts import gather_index, gather_strategies


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
                strategies.extend(owned_item_strategy(x, p, index, ctx))
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


def _aten_slice(node, placements, ctx):
    """``torch.ops.aten.slice(x, dim, start, end, step)`` (Dynamo's spelling of a slice inside traced
    library code): a shard on another dimension is untouched."""
    x = node.args[0]
    p = placements[x]
    dim = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim", 0)
    strategies = []
    if p.is_shard and isinstance(dim, int) and norm_dim(dim, ctx.ndim(x)) != p.dim:
        strategies.append(Strategy({x: p}, p))
    strategies.append(Strategy({x: R}, R))
    return strategies


register("aten::slice", blocks=True, whole=True)(_aten_slice)


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


register("getitem", whole=True)(_getitem)


def _plain_index(index) -> bool:
    items = index if isinstance(index, tuple) else (index,)
    return all(i is None or i is Ellipsis or isinstance(i, int) or (isinstance(i, slice) and not any(
        isinstance(getattr(i, a), fx.Node) for a in ("start", "stop", "step"))) for i in items)


def _setitem(node, placements, ctx):
    """``x[index] = value`` writes into ``x``: ``x`` keeps its placement (a redistributed copy of it would take
    the write, and the readers of ``x`` would never see it: RecurrentGemma's scan fills
    ``contextualized_states[:, t]``). With basic indexing that keeps ``x``'s sharded dim whole, ``value`` is
    written by its shard of that dim (replicated where it broadcasts along it)."""
    x, index = node.args[0], node.args[1]
    value = node.args[2] if len(node.args) > 2 else None
    p = placements[x]
    inputs = tensor_inputs(node)
    strategies = []
    if p.is_shard and _plain_index(index) and all(i in (x, value) for i in inputs):
        o = index_shard_dim(index, ctx.ndim(x), p.dim)
        if o is not None:
            items = index if isinstance(index, tuple) else (index,)
            view_ndim = ctx.ndim(x) - sum(1 for i in items if isinstance(i, int)) + sum(1 for i in items if i is None)
            req = {x: p}
            if isinstance(value, fx.Node) and value in inputs:
                d = o - (view_ndim - ctx.ndim(value))
                req[value] = R if d < 0 or ctx.fake(value).shape[d] == 1 else p.with_dim(d)
            strategies.append(Strategy(req, p, note="written by its shard"))
    strategies.append(Strategy({i: R for i in inputs}, R))
    return strategies


register("setitem")(_setitem)


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
    if not ctx.splits_in_proportion(size, size // k):
        return []
    out_dim = index_shard_dim(tuple(slice(None) if j == position else it for j, it in enumerate(items)),
                              ctx.ndim(x), p.dim)
    return [] if out_dim is None else [Strategy({x: p}, p.with_dim(out_dim), note="every k-th element of a shard")]


def owned_item_strategy(x, p, index, ctx) -> list:
    """``x[..., k, ...]`` with an int on the sharded dim: the rank holding index k gives its value, the others
    zeros, so the result is a partial sum (one all-reduce of the item where a consumer needs it whole) instead of
    a gather of ``x``. Gemma 4 reads its pad token's row of the vocabulary-split embedding,
    ``embed_tokens.weight[pad_id, :]``: the gather was of the whole table, every step."""
    items = index if isinstance(index, tuple) else (index,)
    position = _sharded_item(items, ctx.ndim(x), p.dim)
    size = ctx.fake(x).shape[p.dim]
    if position is None or type(items[position]) is not int or not isinstance(size, int) or not ctx.can_split(size):
        return []
    return [Strategy({x: p}, P, note="one index of a shard: its owner's value, zeros on the other ranks",
                     local=LocalOp.of("owned_item", dim=p.dim, position=position, item=items[position] % size))]


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

    local = LocalOp.of("segment_slice", placement=p, index=index, position=position, segment=i)
    if i in p.whole:
        return [Strategy({x: p}, R, local=local, note="a whole part of a fused projection")]
    return [Strategy({x: p}, S(out_dim), local=local, note="one segment of a fused projection")]
