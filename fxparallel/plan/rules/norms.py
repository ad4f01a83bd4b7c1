"""Normalizations over trailing dimensions (layer_norm, rms_norm, group_norm-free).

They stay sharded when the sharded dimension is not among the normalized ones;
their weight and bias (shaped like the normalized dimensions) stay replicated.
"""
from __future__ import annotations

from ..op_traits import NORMALIZED_SHAPE_ARG, op_name
from ..placement import R
from .base import Strategy, arg, register, tensor_inputs


def _norm(node, placements, ctx):
    x = node.args[0]
    shape = arg(node, NORMALIZED_SHAPE_ARG[op_name(node)], "normalized_shape")
    inputs = tensor_inputs(node)
    n_norm = len(shape) if isinstance(shape, (tuple, list)) else 1
    p = placements[x]
    strategies = []
    if p.is_shard and p.dim < ctx.ndim(x) - n_norm:
        strategies.append(Strategy({i: (p if i is x else R) for i in inputs}, p))
    strategies.append(Strategy({i: R for i in inputs}, R))
    return strategies


register(*NORMALIZED_SHAPE_ARG)(_norm)
