"""torch.vmap traced inline (Mamba's associative scan): ``_add_batch_dim(x, in_dim, level)`` hides
dimension ``in_dim`` of ``x`` from the ops that follow, whose shapes are then the unbatched ones,
until ``_remove_batch_dim(y, level, size, out_dim)`` puts it back at ``out_dim``. A shard on another
dimension moves with the shapes; the vmapped dimension itself stays whole (its size is an argument
of the nesting calls)."""
from __future__ import annotations

from ..placement import R
from .base import Strategy, arg, norm_dim, register


def _add_batch_dim(node, placements, ctx):
    x = node.args[0]
    p = placements[x]
    hidden = norm_dim(arg(node, 1, "batch_dim"), ctx.ndim(x))
    strategies = []
    if p.is_plain_shard and p.dim != hidden:
        strategies.append(Strategy({x: p}, p.with_dim(p.dim - (p.dim > hidden))))
    strategies.append(Strategy({x: R}, R))
    return strategies


def _remove_batch_dim(node, placements, ctx):
    y = node.args[0]
    p = placements[y]
    back = norm_dim(arg(node, 3, "out_dim"), ctx.ndim(node))
    strategies = []
    if p.is_plain_shard:
        strategies.append(Strategy({y: p}, p.with_dim(p.dim + (p.dim >= back))))
    strategies.append(Strategy({y: R}, R))
    return strategies


register("_add_batch_dim")(_add_batch_dim)
register("_remove_batch_dim")(_remove_batch_dim)
