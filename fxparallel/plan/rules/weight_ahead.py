"""A small weight cast or reshaped before it meets an activation: the split of that activation, found ahead.

transformers often writes ``x + self.dt_bias.float().view(1, 1, -1)`` (Kimi-Linear's forget gate): the first op to
read the weight is the cast, whose only input is the weight, so the rules there see nothing to line it up with, and
the weight stays replicated, its gradient all-reduced every step, although the add reads it on the activation's
shards. Where the activation is placed already (it is computed first), the cast offers that split of the weight.
"""
from __future__ import annotations

import torch.fx as fx

from ..op_traits import POINTWISE, SAME_VALUES, op_name
from ..placement import Placement, S
from .base import tensor_inputs
from .experts import is_weight

_UNSQUEEZING = frozenset({"view", "reshape", "unsqueeze"})
_STEPS = 3  # casts and views followed from the weight


def _shape(node, ctx):
    value = ctx.fake(node)
    return None if value is None else tuple(value.shape)


def _one_dim(shape) -> int | None:
    """The one dimension of ``shape`` larger than 1, or None."""
    big = [d for d, n in enumerate(shape) if n != 1]
    return big[0] if len(big) == 1 else None


def split_met_ahead(reader: fx.Node, weight: fx.Node, ctx) -> Placement | None:
    """The split of ``weight`` (a 1-d weight, or one with a single dim above 1) that ``reader``, a cast of it, should
    offer: the shard of the placed activation it meets a few casts and size-1 views further on, where that shard
    lies along the weight's dim; else None."""
    shape, value, value_shape = _shape(weight, ctx), reader, _shape(reader, ctx)
    if shape is None or value_shape is None or not is_weight(weight, len(shape)) or _one_dim(shape) is None:
        return None
    dim = _one_dim(shape)
    for _ in range(_STEPS + 1):
        if len(value.users) != 1:
            return None
        (user,) = value.users
        out = _shape(user, ctx)
        if out is None:
            return None
        if op_name(user) in SAME_VALUES or (op_name(user) in _UNSQUEEZING and _one_dim(out) is not None):
            value, value_shape = user, out
            continue
        mine = _one_dim(value_shape)
        if op_name(user) not in POINTWISE or mine is None or not ctx.can_split(shape[dim]):
            return None
        for other in tensor_inputs(user):
            p, other_shape = ctx.placement_of(other), _shape(other, ctx)
            # broadcast from the right: the other's sharded dim, counted in this value's dims
            if other is not value and p is not None and p.is_plain_shard and other_shape is not None \
                    and p.dim - len(other_shape) + len(value_shape) == mine:
                return S(dim)
        return None
    return None
