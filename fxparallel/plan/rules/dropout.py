"""Dropout: pointwise in placement, but its mask is part of one logical mask.

A dropout captured in training mode (``F.dropout(x, p, training=True)``, p > 0) runs where
its input is (replicated, or sharded along any dim, segments included) and names the local
op ``dropout_on_shards``: the rewrite draws the full logical mask on every rank and keeps this
rank's slice (``ops/dropout_kernels.py``), so the mask does not depend on the layout. A blocked shard
(batch x heads flattened, as XGLM's attention weights) keeps its heads of every row. Whole-segment
shards, and shards of a dim without a fixed size (the batch), have no known slice of that mask:
they are gathered first.

A dropout that returns its input (eval capture, or p = 0) is plain pointwise, as before.
``scaled_dot_product_attention`` with ``dropout_p > 0`` keeps the attention rule's strategies
and names ``attention_with_dropout``: its heads' part of the logical attention mask.
"""
from __future__ import annotations

from ...capture.dropout_sites import is_identity_dropout
from ..placement import Placement
from .attention import _sdpa
from .base import LocalOp, Strategy, arg, register
from .elementwise import pointwise_strategies


def _sliceable(placement) -> bool:
    return not isinstance(placement, Placement) or not placement.whole


def _fixed(node, placement, ctx) -> bool:
    """Is the sharded dim (or block: heads of batch x heads) of the output a fixed size (heads, columns)?
    The mask's slice is then known."""
    return not placement.is_shard or placement.block is not None or isinstance(ctx.size(node, placement.dim), int)


def _dropout(node, placements, ctx):
    strategies = pointwise_strategies(node, placements, ctx)
    if is_identity_dropout(node):
        return strategies
    return [Strategy(s.inputs, s.output, note="dropout: this rank's part of the logical mask",
                     local=LocalOp.of("dropout_on_shards", placement=s.output))
            for s in strategies if _sliceable(s.output) and all(_sliceable(p) for p in s.inputs.values())
            and _fixed(node, s.output, ctx)]


register("dropout", blocks=True)(_dropout)  # blocked shards: this rank's heads of each row of the mask


def _attention(node, placements, ctx):
    strategies = _sdpa(node, placements, ctx)
    p = arg(node, 4, "dropout_p", 0.0)
    if p in (0, 0.0):
        return strategies
    return [Strategy(s.inputs, s.output, note=s.note, own_bytes=s.own_bytes,
                     local=LocalOp.of("attention_with_dropout", placement=s.output)) for s in strategies
            if _fixed(node, s.output, ctx)]


register("scaled_dot_product_attention")(_attention)
