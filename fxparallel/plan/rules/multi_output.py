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
    strategies.append(Strategy({i: R for i in tensor_inputs(node)}, tuple(R for _ in range(n))))
    return strategies


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
