"""Ops with several outputs (chunk, split, unbind, topk, max/min along a dim, sort).

Splitting or selecting along a dimension that is not sharded leaves every output
sharded like the input. Splitting along the sharded dimension is handled only
when the input was sharded segment by segment (fused projections); otherwise
the input is gathered.
"""
from __future__ import annotations

from ..op_traits import op_name
from ..placement import R, S
from .base import LocalOp, Strategy, arg, norm_dim, register, tensor_inputs


def _along(node, placements, ctx, dim_index, dim_name, default_dim, n_out, keeps_dim=True):
    x = node.args[0]
    p = placements[x]
    value = node.meta.get("example_value")
    if not isinstance(value, (tuple, list)):
        return []
    n = len(value)
    dim = norm_dim(arg(node, dim_index, dim_name, default_dim), ctx.ndim(x))
    strategies = []
    if p.is_shard and p.dim != dim:
        out_dim = p.dim if keeps_dim or p.dim < dim else p.dim - 1
        strategies.append(Strategy({x: p}, tuple(p.with_dim(out_dim) for _ in range(n))))
    elif p.is_shard and p.segments and op_name(node) in ("split", "chunk"):
        sizes = tuple(int(v.shape[dim]) for v in value)
        is_split = op_name(node) == "split"
        if sizes == tuple(p.segments) and (is_split or not p.whole):
            # a whole segment comes out replicated (plan/placement.py)
            strategies.append(Strategy({x: p}, tuple(R if i in p.whole else S(dim) for i in range(n)),
                                       local=LocalOp.of("local_split_sizes", placement=p), note="split of a fused projection into its "
                                       "segments"))
        elif is_split:
            groups = segment_groups(sizes, p)
            if groups is not None:
                strategies.append(Strategy({x: p}, tuple(_run(p, dim, g) for g in groups),
                                           local=LocalOp.of("local_split_sizes", placement=p, groups=groups),
                                           note="split of a fused projection into runs of its segments"))
    strategies.append(Strategy({i: R for i in tensor_inputs(node)}, tuple(R for _ in range(n))))
    return strategies


def segment_groups(sizes: tuple, p) -> tuple:
    """The runs of consecutive segments of ``p`` that make each part of a split of ``sizes`` (Mamba-2's z | xBC |
    dt of its five segments z, x, B, C, dt), or None where a part would cut a segment."""
    groups, start = [], 0
    for size in sizes:
        stop, total = start, 0
        while total < size and stop < len(p.segments):
            total += p.segments[stop]
            stop += 1
        if total != size:
            return None
        groups.append(tuple(range(start, stop)))
        start = stop
    return tuple(groups) if start == len(p.segments) else None


def _run(p, dim: int, group: tuple):
    """The placement of the part of a split made of the segments ``group`` of ``p``: replicated for one whole
    segment, a plain shard for one split segment, else the run's segments (and which of them are whole)."""
    if len(group) == 1:
        return R if group[0] in p.whole else S(dim)
    return S(dim, [p.segments[i] for i in group], whole=tuple(k for k, i in enumerate(group) if i in p.whole))


def _chunk(node, placements, ctx):
    return _along(node, placements, ctx, 2, "dim", 0, None)


def _unbind(node, placements, ctx):
    return _along(node, placements, ctx, 1, "dim", 0, None, keeps_dim=False)


def _topk(node, placements, ctx):
    return _along(node, placements, ctx, 2, "dim", -1, 2)


def _sort(node, placements, ctx):
    return _along(node, placements, ctx, 1, "dim", -1, 2)


register("chunk", "split", "tensor_split", whole=True)(_chunk)
register("unbind")(_unbind)
register("topk")(_topk)
register("sort")(_sort)
