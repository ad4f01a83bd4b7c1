"""Carry a partial sum through ops that are linear in it, so that it is reduced once, where it is smallest.

A row-parallel product leaves a partial sum P (every rank a full-shape addend). An op
``f`` with ``f(a + b) = f(a) + f(b)`` may run on the addends: reshapes, casts,
reductions over any dims (sum, mean), scaling by a replicated value (the routing
weights of a mixture of experts), adding two partial sums (routed and shared
experts). A MoE block's row-parallel down projections are then reduced once, on the
combined [tokens, hidden] output, instead of on every (token, expert) pair.

The strategies are offered before each op's own rule (``base.rule_for`` puts them in
front); which ops are linear: ``op_traits.LINEAR_*``. A replicated operand that
requires grad (the routing weights) gets its gradient all-reduced: on each rank it is
the product with that rank's addend only.
"""
from __future__ import annotations

import torch.fx as fx

from ..op_traits import DIVIDES, LINEAR_ADD, LINEAR_SCALE, LINEAR_UNARY, op_name
from ..placement import P, R
from .base import Strategy, register_first, tensor_inputs


def _partial_inputs(node, placements):
    inputs = tensor_inputs(node)
    return inputs, [i for i in inputs if placements[i].is_partial]


def _worth_carrying(node, x, ctx) -> bool:
    """Carry a partial only from its sole use (a value used twice is better reduced once, where it is made) and
    into an output with no more elements (broadcasting it up would cost more later)."""
    if len(x.users) != 1:
        return False
    if ctx.fake(node) is None or ctx.fake(x) is None:
        return False
    return _elements_per_token(node, ctx) <= _elements_per_token(x, ctx)


def _elements_per_token(node, ctx) -> float:
    return ctx.bytes_per_token(node) / ctx.fake(node).element_size()


def _unary(node, placements, ctx):
    inputs, partial = _partial_inputs(node, placements)
    if len(inputs) == 1 and partial and node.args and node.args[0] is inputs[0] and _worth_carrying(node, inputs[0], ctx):
        return [Strategy({inputs[0]: P}, P, note="linear in a partial sum", name="partial")]
    return []


def _scale(node, placements, ctx):
    inputs, partial = _partial_inputs(node, placements)
    operands = list(node.args[:2])
    if len(partial) != 1 or len(operands) != 2 or node.kwargs or not _worth_carrying(node, partial[0], ctx):
        return []
    x = partial[0]
    if op_name(node) in DIVIDES and operands[0] is not x:
        return []
    other = operands[1] if operands[0] is x else operands[0]
    if isinstance(other, fx.Node) and other in inputs and other is not x:
        return [Strategy({x: P, other: R}, P, note="partial sum scaled by a replicated value", name="partial")]
    if isinstance(other, (int, float)) and not isinstance(other, bool):
        return [Strategy({x: P}, P, note="partial sum scaled by a number", name="partial")]
    return []


def _add(node, placements, ctx):
    """Two partial sums added: reduce the sum once rather than each addend. Worth it when the sum is no larger
    than the addends together (GPT-2's token embeddings [batch, seq, hidden] plus its position embeddings
    [1, seq, hidden], both vocab-parallel: one all-reduce, not two)."""
    inputs, partial = _partial_inputs(node, placements)
    operands = list(node.args[:2])
    if len(inputs) != 2 or len(partial) != 2 or not all(isinstance(a, fx.Node) for a in operands) or \
            any(len(x.users) != 1 or ctx.fake(x) is None for x in inputs) or ctx.fake(node) is None:
        return []
    if _elements_per_token(node, ctx) > sum(_elements_per_token(x, ctx) for x in inputs):
        return []
    if any(k not in ("alpha",) for k in node.kwargs) or len(node.args) > 2:
        return []
    return [Strategy({x: P for x in inputs}, P, note="sum of partial sums", name="partial")]


register_first(*LINEAR_UNARY)(_unary)
register_first(*LINEAR_SCALE)(_scale)
register_first(*LINEAR_ADD)(_add)
