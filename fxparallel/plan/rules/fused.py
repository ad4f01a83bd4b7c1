"""Find fused projections: a matmul whose output features are later split into parts.

GPT-2's ``c_attn`` output is ``split`` into q, k, v; Phi-3's ``qkv_proj`` output is
sliced ``[..., :q]``, ``[..., q:q+kv]``, ...; ``gate_up_proj`` is ``chunk``-ed in two.
Sharding such a weight contiguously would give rank 0 all of q and rank 1 all of
v; sharding each part (segment) on its own keeps every rank's heads together.
This analysis follows the output through shape-preserving ops (``op_traits.KEEPS_FEATURES``)
and transposes (Mamba's ``in_proj(x).transpose(1, 2).chunk(2, dim=1)``) to the split and returns
the segment sizes, which the linear rule turns into a segmented shard. A part is followed on to a
split of its own: Mamba-2's ``in_proj`` gives z, xBC and dt, and xBC, after its depthwise convolution
over the sequence, is split into x, B and C (five segments).

A part of fewer heads than ranks (multi-query attention's single key and value head)
cannot be split by head: every rank keeps it whole (``whole_segments``) and computes it
itself, which is cheaper than gathering it: it is a small share of the projection.
"""
from __future__ import annotations

import operator
from typing import Optional

import torch
import torch.fx as fx

from ..op_traits import ELEMENTWISE_ACTIVATIONS, KEEPS_FEATURES, op_name
from .base import arg, norm_dim
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
        return {c for c in _starts(value, feature_dim)[1:] if 0 < c < size}
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


def _starts(parts, feature_dim: int) -> list:
    """Where each part of a split begins along ``feature_dim``."""
    starts = [0]
    for part in parts[:-1]:
        starts.append(starts[-1] + int(part.shape[feature_dim]))
    return starts


def _split_parts(split: fx.Node, dim: int, offset: int) -> list:
    """(part, dim, its offset in the projection's features) of each item taken from a split."""
    starts = _starts(_value(split), dim)
    return [(user, dim, offset + starts[user.args[1]]) for user in split.users
            if user.op == "call_function" and user.target is operator.getitem and isinstance(user.args[1], int)]


def _keeps_channels(node: fx.Node, source: fx.Node, dim: int) -> bool:
    """Does ``node`` keep ``source``'s dimension ``dim`` (from the end) feature by feature, though it is not
    the last one: a depthwise convolution's channels (Mamba-2's conv1d over the sequence), a slice of
    another dimension (its ``[:, :, :seq_len]`` after the padded convolution), a join along another
    dimension, an activation."""
    name = op_name(node)
    ndim = _value(source).dim()
    if name == "cat" and isinstance(node.args[0], (list, tuple)) and source in node.args[0]:
        # a causal convolution's window of past steps joined before the new ones (Mamba-2 decoding)
        return norm_dim(arg(node, 1, "dim", 0), ndim) != dim % ndim
    if not node.args or node.args[0] is not source:
        return False
    if name in ("conv1d", "conv2d", "conv3d"):
        weight, groups = _value(arg(node, 1, "weight")), arg(node, 6, "groups", 1)
        return dim % ndim == 1 and isinstance(weight, torch.Tensor) and weight.shape[1] == 1 \
            and groups == weight.shape[0]
    if node.target is operator.getitem:
        index = node.args[1] if isinstance(node.args[1], tuple) else (node.args[1],)
        return Ellipsis not in index and len(index) <= ndim and (
            dim % ndim >= len(index) or index[dim % ndim] == slice(None))
    return name in ELEMENTWISE_ACTIVATIONS


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


def output_segments(node: fx.Node, tp: int, can_split=None, deep: bool = False) -> Optional[tuple]:
    """Segment sizes of a matmul's output features if it is fused and every part splits, else None.

    ``can_split(size)``: can one segment be split over the ranks (default: tp divides it). ``deep``: the parts
    found also past depthwise convolutions, joins and activations, and within parts split again (Mamba-2's
    five); the rules offer both, the shallow first (a gated delta net's q, k and v, found past its convolution,
    would be split only to be gathered again)."""
    segments = _fused_parts(node, deep)
    if segments and all(can_split(s) if can_split else s % tp == 0 for s in segments):
        return segments
    return None


def whole_segments(node: fx.Node, tp: int, head_dim: Optional[int], can_split, shared: tuple = (),
                   deep: bool = False) -> Optional[tuple]:
    """(segments, indices of the whole ones) of a fused matmul output with parts of fewer heads
    than ranks, or read by every head (``shared`` widths: Mamba-2's B and C of one group), the other
    parts splitting over the ranks; None otherwise. ``deep``: as for ``output_segments``."""
    segments = _fused_parts(node, deep)
    if not segments or not (head_dim or shared) or tp < 2:
        return None
    whole = tuple(i for i, s in enumerate(segments)
                  if (head_dim and s % head_dim == 0 and s // head_dim < tp) or s in shared)
    rest = [s for i, s in enumerate(segments) if i not in whole]
    if not whole or not rest or not all(can_split(s) for s in rest):
        return None
    return segments, whole


def _fused_parts(node: fx.Node, deep: bool) -> Optional[tuple]:
    """Sizes of the parts a matmul's output features are split into later, or None (cached on the node).
    Shallow: followed through ``KEEPS_FEATURES`` and transposes to the first splits; ``deep``: see
    ``output_segments``."""
    key = "fxparallel_segments_deep" if deep else "fxparallel_segments"
    if key in node.meta:
        return node.meta[key]
    size = _feature_size(node)
    # (value, its dimension holding features, where they begin in the projection's features)
    cuts, frontier, seen = set(), [(node, -1, 0)], set()
    while size and frontier:
        current, dim, offset = frontier.pop()
        width = _feature_size(current, dim)
        for user in current.users:
            if user in seen:
                continue
            seen.add(user)
            found = _cuts(user, width, dim)
            if found is None and dim == -1 and width == size:
                found = _head_cuts(user, size)
            moved = _transposed(user, current, dim)
            if found is not None:
                cuts |= {offset + c for c in found}
                if deep and op_name(user) == "split":
                    frontier.extend(_split_parts(user, dim, offset))
            elif moved is not None and _feature_size(user, moved) == width:
                frontier.append((user, moved, offset))
            elif (op_name(user) in KEEPS_FEATURES or (deep and _keeps_channels(user, current, dim))) \
                    and _feature_size(user, dim) == width:
                frontier.append((user, dim, offset))
    segments = None
    if cuts:
        bounds = [0] + sorted(cuts) + [size]
        segments = tuple(b - a for a, b in zip(bounds, bounds[1:]))
    node.meta[key] = segments
    return segments
