"""``x.repeat_interleave(k, dim)``: each entry of ``dim`` repeated ``k`` times in place.

Mamba-2 (and its hybrids) widen B and C from their groups to the heads this way: head h reads group
h // (heads / groups). A shard of ``dim`` stays a shard: a rank's groups, repeated, are its heads, when
every rank's part of the output is its part of the input times ``k`` (``output_size``, if given, becomes
this rank's). A shard of another dim is untouched."""
from __future__ import annotations

import torch.fx as fx

from ..placement import R
from .base import LocalOp, Strategy, arg, norm_dim, register


def _repeat_interleave(node, placements, ctx):
    x, repeats, dim = node.args[0], arg(node, 1, "repeats"), arg(node, 2, "dim")
    if not isinstance(x, fx.Node) or ctx.fake(x) is None:
        return []
    strategies = []
    p = placements[x]
    if p.is_plain_shard and isinstance(repeats, int) and isinstance(dim, int):
        d = norm_dim(dim, ctx.ndim(x))
        if p.dim != d:
            strategies.append(Strategy({x: p}, p, note="repeated along another dim"))
        else:
            full = int(ctx.size(node, d))
            if ctx.splits_in_proportion(full, int(ctx.size(x, d))):
                strategies.append(Strategy({x: p}, p, note="each rank repeats its own entries",
                                           local=LocalOp.of("local_output_size", full=full)))
    strategies.append(Strategy({x: R}, R))
    return strategies


register("repeat_interleave")(_repeat_interleave)
