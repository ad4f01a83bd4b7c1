"""Pointwise ops: the output is sharded wherever a sharded input lines up with it.

Partial sums are reduced before any pointwise op (one all-reduce per partial
value, shared by all its consumers), never carried through.

Inputs are aligned from the right (broadcasting). A replicated input that has the
full size along the sharded dimension is sliced locally (free); one that
broadcasts there (size 1 or missing) is used whole. A shard with whole segments (``plan/placement.py``)
passes only where every other operand holds the same shard, broadcasts, or needs no gradient (Falcon-H1's
muP multipliers of the fused projection, sliced alike). Dropout has its own rule (``dropout.py``):
its mask is part of a logical one. Which ops are pointwise: ``op_traits.POINTWISE``. A cast that is the first
reader of a weight or of a generation graph's cache state may split it ahead of the activations it meets
(``weight_ahead.py``, ``_state_splits``).
"""
from __future__ import annotations

from ..op_traits import POINTWISE, SAME_VALUES, op_name
from ..placement import R, S
from .base import Strategy, register, requires_grad, tensor_inputs
from .weight_ahead import split_met_ahead


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
        if p.whole and any(r != R and placements[x] != r and requires_grad(x) for x, r in req.items()):
            continue  # whole segments meet only their own shards, broadcast operands and constants sliced alike
        strategies.append(Strategy(req, p.with_dim(d)))
    if len(inputs) == 1 and not placements[inputs[0]].is_shard and op_name(node) in SAME_VALUES:
        ahead = split_met_ahead(node, inputs[0], ctx)  # a weight cast before it meets its activation's shards
        if ahead is not None:
            strategies.append(Strategy({inputs[0]: ahead}, ahead, note="sharded like the activation it meets"))
        strategies += _state_splits(inputs[0], ctx)
    strategies.append(Strategy({x: R for x in inputs}, R))
    return strategies


register(*sorted(POINTWISE), blocks=True, whole=True)(pointwise_strategies)


def _state_splits(state, ctx) -> list:
    """A recurrent state not yet placed, read first by a cast (xLSTM's ``c_state.to(torch.float32)``): each split
    of it but the batch's. The cast has nothing to line it up with, and the activations it meets are computed
    after it; offered, the split the rest of the graph reads (its heads, mostly) costs no communication, while
    leaving it whole keeps TP copies of the state."""
    value = ctx.fake(state)
    if state not in ctx.states or state not in ctx.undecided or value is None:
        return []
    return [Strategy({state: S(d)}, S(d), note="a cache state split as its readers need")
            for d in range(1, value.dim()) if ctx.can_split(value.shape[d])]


def _min_max(node, placements, ctx):
    """torch.min/max: pointwise with a second tensor; a reduction along ``dim`` otherwise."""
    second = node.args[1] if len(node.args) > 1 else node.kwargs.get("other", node.kwargs.get("dim"))
    if isinstance(second, int) or "dim" in node.kwargs:
        from .multi_output import _along

        return _along(node, placements, ctx, 1, "dim", -1, 2, keeps_dim=bool(node.kwargs.get("keepdim", False)))
    return pointwise_strategies(node, placements, ctx)


register("min", "max")(_min_max)
