"""scaled_dot_product_attention: heads are independent, so q, k, v sharded by head
give each rank its heads' output. A mask with a head dimension is sliced with them."""
from __future__ import annotations

import torch
import torch.fx as fx
import torch.nn.functional as F

from ..placement import R, S
from .base import Strategy, arg, register, tensor_inputs


def _sdpa(node, placements, ctx):
    q, k, v = node.args[0], node.args[1], node.args[2]
    mask = arg(node, 3, "attn_mask")
    inputs = tensor_inputs(node)
    if ctx.ndim(q) != 4:
        return [Strategy({i: R for i in inputs}, R)]
    strategies = []
    for dim in (1, 0):  # heads, then batch
        if not all(isinstance(ctx.size(t, dim), int) and ctx.size(t, dim) % ctx.tp == 0 for t in (q, k, v)):
            continue
        req = {q: S(dim), k: S(dim), v: S(dim)}
        if isinstance(mask, fx.Node):
            m = ctx.fake(mask)
            aligned = dim - (4 - m.dim())
            req[mask] = R if aligned < 0 or m.shape[aligned] == 1 else S(aligned)
        strategies.append(Strategy(req, S(dim), note="attention on local heads" if dim == 1 else "attention on local batch"))
    strategies.append(Strategy({i: R for i in inputs}, R))
    return strategies


register(F.scaled_dot_product_attention, torch._C._nn.scaled_dot_product_attention)(_sdpa)
