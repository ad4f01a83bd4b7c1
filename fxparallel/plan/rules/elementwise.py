"""Pointwise ops: the output is sharded wherever a sharded input lines up with it.

Partial sums are reduced before any pointwise op (one all-reduce per partial
value, shared by all its consumers), never carried through.

Inputs are aligned from the right (broadcasting). A replicated input that has the
full size along the sharded dimension is sliced locally (free); one that
broadcasts there (size 1 or missing) is used whole. Dropout has its own rule (``dropout.py``):
its mask is part of a logical one.
"""
from __future__ import annotations

import operator

import torch
import torch.nn.functional as F

from ..placement import R
from .base import Strategy, handles_blocks, register, tensor_inputs

_FUNCTIONS = [  # pointwise functions (unary, binary, ternary)
    torch.rsqrt, torch.sqrt, torch.exp, torch.log, torch.tanh, torch.sigmoid, torch.cos, torch.sin,
    torch.abs, torch.erf, torch.square, torch.reciprocal, torch.log1p, torch.expm1, torch.sign, torch.clamp,
    torch.clip, torch.pow, torch.where, torch.maximum, torch.minimum, torch.add, torch.sub, torch.mul,
    torch.div, torch.true_divide, torch.neg, torch.masked_fill, torch.lerp, torch.addcmul, torch.nan_to_num,
    torch.zeros_like, torch.ones_like, torch.empty_like, torch.full_like, torch.rand_like, torch.randn_like,
    F.silu, F.gelu, F.relu, F.tanh, F.sigmoid, F.softplus, F.leaky_relu, F.elu, F.mish, F.hardtanh, F.relu6,
    operator.add, operator.sub, operator.mul, operator.truediv, operator.floordiv, operator.pow, operator.neg,
    operator.and_, operator.or_, operator.xor, operator.invert, operator.eq, operator.ne, operator.lt,
    operator.le, operator.gt, operator.ge, operator.mod, operator.iadd, operator.imul, operator.isub,
    operator.itruediv,
    getattr(torch._C._nn, "gelu", None), getattr(torch._C._nn, "silu", None), getattr(torch._C._nn, "softplus", None),
]
_METHODS = [
    "add", "sub", "mul", "div", "truediv", "neg", "pow", "rsqrt", "sqrt", "exp", "log", "tanh", "sigmoid",
    "cos", "sin", "abs", "float", "half", "bfloat16", "double", "to", "type", "type_as", "clamp", "clamp_min",
    "clamp_max", "clip", "masked_fill", "masked_fill_", "where", "square", "reciprocal", "add_", "mul_", "sub_",
    "div_", "neg_", "sign", "erf", "relu", "silu", "gelu", "softplus", "long", "int", "bool", "lerp",
    "__and__", "__or__", "__invert__", "eq", "ne", "lt", "le", "gt", "ge", "logical_and", "logical_or",
    "logical_not", "fill_", "zero_", "nan_to_num", "detach", "clone", "contiguous", "requires_grad_",
]
def pointwise_strategies(node, placements, ctx, inputs=None):
    inputs = tensor_inputs(node) if inputs is None else inputs
    out = ctx.fake(node)
    if out is None:
        return []
    out_nd = out.dim()
    dims = {}
    for x in inputs:
        p = placements[x]
        if p.is_shard:
            d = p.dim + out_nd - ctx.ndim(x)
            if d >= 0 and d not in dims:
                dims[d] = p
    strategies = []
    for d, p in dims.items():
        parts = p.parts(out.shape[d])
        if not all(ctx.can_split(s) for s in parts):
            continue
        req = {}
        for x in inputs:
            xd = d - (out_nd - ctx.ndim(x))
            if xd < 0 or ctx.size(x, xd) == 1:
                req[x] = R
            else:
                req[x] = p.with_dim(xd)
        strategies.append(Strategy(req, p.with_dim(d)))
    strategies.append(Strategy({x: R for x in inputs}, R))
    return strategies


register(*_FUNCTIONS, *_METHODS)(handles_blocks(pointwise_strategies))


def _min_max(node, placements, ctx):
    """torch.min/max: pointwise with a second tensor; a reduction along ``dim`` otherwise."""
    second = node.args[1] if len(node.args) > 1 else node.kwargs.get("other", node.kwargs.get("dim"))
    if isinstance(second, int) or "dim" in node.kwargs:
        from .multi_output import _along

        return _along(node, placements, ctx, 1, "dim", -1, 2, keeps_dim=bool(node.kwargs.get("keepdim", False)))
    return pointwise_strategies(node, placements, ctx)


register(torch.min, torch.max, "min", "max")(_min_max)
