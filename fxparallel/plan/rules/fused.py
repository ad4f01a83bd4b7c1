"""Find fused projections: a matmul whose output features are later split into parts.

GPT-2's ``c_attn`` output is ``split`` into q, k, v; Phi-3's ``qkv_proj`` output is
sliced ``[..., :q]``, ``[..., q:q+kv]``, ...; ``gate_up_proj`` is ``chunk``-ed in two.
Sharding such a weight contiguously would give rank 0 all of q and rank 1 all of
v; sharding each part (segment) on its own keeps every rank's heads together.
This analysis follows the output through shape-preserving ops (``op_traits.KEEPS_FEATURES``)
and transposes (Mamba's ``in_proj(x).transpose(1, 2).chunk(2, dim=1)``) to the split and returns
the segment sizes, which the linear rule turns into a segmented shard.

A part of fewer heads than ranks (multi-query attention's single key and value head)
cannot be split by head: every rank keeps it whole (``whole_segments``) and computes it
itself, which is cheaper than gathering it: it is a small share of the projection.
"""
from __future__ import annotations

import operator
from typing import Optional

import torch
import torch.fx as fx

from ..op_traits import KEEPS_FEATURES, op_name
from .dim_maps import permutation


def _value(node):
    return node.meta.get("example_value") if isinstance(node, fx.Node) else None


def _feature_size(node, dim: int = -1) -> Optional[int]:
    """The size of dimension ``dim`` (counted from the end) of a node's value, if a constant."""
    v = _value(node)
    if isinstance(v, torch.Tensor) and v.dim() >= -dim and isinstance(v.shape[dim], int):
        return int(v.shape[dim])
    return None


def _transposed(node: fx.Node, source: fx.Node, dim: int) -> Optional[int]:
    """Where ``node``, a transpose of ``source``, puts its dimension ``dim`` (counted from the end)."""
    if op_name(node) not in ("transpose", "swapaxes", "swapdims") or node.args[0] is not source \
            or not all(isinstance(a, int) for a in node.args[1:3]):
        return None
    ndim = _value(source).dim()
    return permutation(node, ndim).index(dim % ndim) - ndim


def _cuts(node: fx.Node, size: int, feature_dim: int = -1) -> Optional[set]:
    """Boundaries at which ``node``'s dimension ``feature_dim`` (from the end) is split (None: not split)."""
    target = node.target
    value = _value(node)
    if op_name(node) in ("split", "chunk"):
        dim = node.args[2] if len(node.args) > 2 else node.kwargs.get("dim", 0)
        x_dim = _value(node.args[0]).dim()
        if dim % x_dim != feature_dim % x_dim or not isinstance(value, (tuple, list)):
            return None
        sizes = [int(v.shape[feature_dim]) for v in value]
        cuts, offset = set(), 0
        for s in sizes[:-1]:
            offset += s
            cuts.add(offset)
        return cuts
    if feature_dim != -1:
        return None
    if node.op == "call_function" and target is operator.getitem and isinstance(_value(node.args[0]), torch.Tensor):
        index = node.args[1]
        items = index if isinstance(index, tuple) else (index,)
        last = items[-1] if items and items[0] is Ellipsis and len(items) == 2 else None
        if isinstance(last, slice) and last.step in (None, 1):
            start = 0 if last.start is None else last.start % size if last.start < 0 else last.start
            stop = size if last.stop is None else last.stop % size if last.stop < 0 else last.stop
            return {c for c in (start, stop) if 0 < c < size}
    return None


def _head_cuts(node: fx.Node, size: int) -> Optional[set]:
    """Boundaries (in features) at which a view of the last dimension into ``[..., heads, head_dim]``
    is cut by head: ``fused.view(b, s, heads + 2, head_dim)[..., :-2, :]`` and ``[..., [-2], :]``
    (Falcon-7B's multi-query ``query_key_value``)."""
    value = _value(node)
    if not (node.op == "call_method" and node.target in ("view", "reshape")) or not isinstance(value, torch.Tensor) \
            or value.dim() < 2 or not all(isinstance(d, int) for d in value.shape[-2:]):
        return None
    heads, unit = int(value.shape[-2]), int(value.shape[-1])
    if heads * unit != size:
        return None
    cuts = set()
    for user in node.users:
        index = user.args[1] if user.op == "call_function" and user.target is operator.getitem else None
        if not (isinstance(index, tuple) and len(index) == 3 and index[0] is Ellipsis and index[2] == slice(None)):
            return None
        item = index[1]
        if isinstance(item, slice) and item.step in (None, 1):
            bounds = [b if b is None else b % heads for b in (item.start, item.stop)]
            cuts |= {b * unit for b in bounds if b}
        elif isinstance(item, list) and len(item) == 1 and isinstance(item[0], int):
            head = item[0] % heads
            cuts |= {b * unit for b in (head, head + 1) if 0 < b < heads}
        else:
            return None
    return cuts


def output_segments(node: fx.Node, tp: int, can_split=None) -> Optional[tuple]:
    """Segment sizes of a matmul's output features if it is fused and every part splits, else None.

    ``can_split(size)``: can one segment be split over the ranks (default: tp divides it)."""
    segments = _fused_parts(node)
    if segments and all(can_split(s) if can_split else s % tp == 0 for s in segments):
        return segments
    return None


def whole_segments(node: fx.Node, tp: int, head_dim: Optional[int], can_split) -> Optional[tuple]:
    """(segments, indices of the whole ones) of a fused matmul output with parts of fewer heads
    than ranks, the other parts splitting over the ranks; None otherwise."""
    segments = _fused_parts(node)
    if not segments or not head_dim or tp < 2:
        return None
    whole = tuple(i for i, s in enumerate(segments) if s % head_dim == 0 and s // head_dim < tp)
    rest = [s for i, s in enumerate(segments) if i not in whole]
    if not whole or not rest or not all(can_split(s) for s in rest):
        return None
    return segments, whole


def _fused_parts(node: fx.Node) -> Optional[tuple]:
    """Sizes of the parts a matmul's output features are split into later, or None (cached on the node)."""
    if "fxparallel_segments" in node.meta:
        return node.meta["fxparallel_segments"]
    size = _feature_size(node)
    cuts, frontier, seen = set(), [(node, -1)], set()  # (value, its dimension holding the features)
    while size and frontier:
        current, dim = frontier.pop()
        for user in current.users:
            if user in seen:
                continue
            seen.add(user)
            found = _cuts(user, size, dim)
            if found is None and dim == -1:
                found = _head_cuts(user, size)
            moved = _transposed(user, current, dim)
            if found is not None:
                cuts |= found
            elif moved is not None and _feature_size(user, moved) == size:
                frontier.append((user, moved))
            elif op_name(user) in KEEPS_FEATURES and _feature_size(user, dim) == size:
                frontier.append((user, dim))
    segments = None
    if cuts:
        bounds = [0] + sorted(cuts) + [size]
        segments = tuple(b - a for a, b in zip(bounds, bounds[1:]))
    node.meta["fxparallel_segments"] = segments
    return segments
