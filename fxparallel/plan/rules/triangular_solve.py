"""``torch.linalg.solve_triangular(A, B)``: ``A X = B`` for a batch of triangular matrices (a gated delta
net's chunked rule solves its ``(I + L) u = v`` this way).

Each batch entry is solved alone, so a batch dim (heads) sharded in both operands stays sharded in the
solution. With ``left=True`` each column of ``B`` is solved alone too: ``B`` sharded by columns against a
whole ``A`` gives the solution sharded by columns. Anything else runs replicated."""
from __future__ import annotations

from ..placement import R, S
from .base import Strategy, arg, register


def _solve_triangular(node, placements, ctx):
    a, b = node.args[0], node.args[1]
    if not arg(node, 4, "left", True) or ctx.fake(a) is None or ctx.fake(b) is None or ctx.ndim(a) != ctx.ndim(b):
        return []
    ndim = ctx.ndim(b)
    strategies = []
    pa, pb = placements[a], placements[b]
    for p in (pa, pb):
        if p.is_plain_shard and p.dim < ndim - 2 and ctx.size(a, p.dim) == ctx.size(b, p.dim) \
                and ctx.can_split(ctx.size(b, p.dim)):
            strategies.append(Strategy({a: S(p.dim), b: S(p.dim)}, S(p.dim), note="solved per local batch entry"))
            break
    if pb.is_plain_shard and pb.dim == ndim - 1 and ctx.can_split(ctx.size(b, ndim - 1)):
        strategies.append(Strategy({a: R, b: S(ndim - 1)}, S(ndim - 1), note="solved per local column"))
    strategies.append(Strategy({a: R, b: R}, R))
    return strategies


register("solve_triangular")(_solve_triangular)
