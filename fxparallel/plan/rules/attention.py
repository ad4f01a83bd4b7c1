"""scaled_dot_product_attention: heads are independent, so q, k, v sharded by head
give each rank its heads' output. A mask with a head dimension is sliced with them.
A single key/value head (multi-query attention) serves every rank's query heads whole.
``dropout.py`` registers the rule, adding what attention dropout needs."""
from __future__ import annotations

import torch.fx as fx

from ..placement import R, S
from .base import Strategy, arg, tensor_inputs


def _sdpa(node, placements, ctx):
    q, k, v = node.args[0], node.args[1], node.args[2]
    mask = arg(node, 3, "attn_mask")
    inputs = tensor_inputs(node)
    if ctx.ndim(q) != 4:
        return [Strategy({i: R for i in inputs}, R)]
    strategies = []
    for dim in (1, 0):  # heads, then batch
        if not all(ctx.can_split(ctx.size(t, dim)) for t in (q, k, v)):
            continue
        if not _same_groups([ctx.size(t, dim) for t in (q, k, v)], ctx):
            continue
        req = {q: S(dim), k: S(dim), v: S(dim)}
        if isinstance(mask, fx.Node):
            m = ctx.fake(mask)
            aligned = dim - (4 - m.dim())
            req[mask] = R if aligned < 0 or m.shape[aligned] == 1 else S(aligned)
        strategies.append(Strategy(req, S(dim), note="attention on local heads" if dim == 1 else "attention on local batch"))
    if ctx.can_split(ctx.size(q, 1)) and ctx.size(k, 1) == 1 and ctx.size(v, 1) == 1:
        # one key/value head for all query heads (multi-query): every rank uses it whole
        req = {q: S(1), k: R, v: R}
        if isinstance(mask, fx.Node):
            m = ctx.fake(mask)
            req[mask] = R if m.dim() < 3 or m.shape[m.dim() - 3] == 1 else S(m.dim() - 3)
        strategies.append(Strategy(req, S(1), note="attention on local query heads, the one kv head whole"))
    strategies.append(Strategy({i: R for i in inputs}, R))
    return strategies


def _same_groups(sizes, ctx) -> bool:
    """Does every rank hold the same fraction of q's and k/v's heads (GQA: its kv heads' query heads)?"""
    parts = [ctx.split_sizes(s) for s in sizes]
    return all(part[r] * sizes[0] == parts[0][r] * s for s, part in zip(sizes, parts) for r in range(ctx.tp))

