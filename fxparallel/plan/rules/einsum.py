"""``torch.einsum(equation, *operands)``: products named by subscripts (Mamba-2's chunked scan).

A subscript sharded in the operands that carry it runs locally: kept in the output, the output is
sharded there (a batch-like index: heads); summed out, every operand that carries it must be
sharded on it and the output is a partial sum (a contraction, as a row-parallel product). An
operand without the subscript is read whole. Equations with ``...`` or a repeated subscript in one
operand run replicated."""
from __future__ import annotations

from typing import Optional

import torch.fx as fx

from ..placement import P, R, S
from .base import Strategy, register


def _subscripts(node) -> Optional[tuple]:
    """(operands, their subscripts, the output's) of a plain einsum, or None."""
    equation, rest = node.args[0], node.args[1:]
    operands = list(rest[0]) if len(rest) == 1 and isinstance(rest[0], (list, tuple)) else list(rest)
    if not isinstance(equation, str) or "->" not in equation or "." in equation:
        return None
    inputs, output = equation.replace(" ", "").split("->")
    terms = inputs.split(",")
    if len(terms) != len(operands) or not all(isinstance(o, fx.Node) for o in operands) \
            or any(len(set(t)) != len(t) for t in terms + [output]):
        return None
    return operands, terms, output


def _einsum(node, placements, ctx):
    found = _subscripts(node)
    if found is None:
        return []
    operands, terms, output = found
    if any(ctx.fake(o) is None or ctx.ndim(o) != len(t) for o, t in zip(operands, terms)):
        return []
    letters = []
    for o, t in zip(operands, terms):
        p = placements[o]
        if p.is_plain_shard and t[p.dim] not in letters:
            letters.append(t[p.dim])
    strategies = []
    for letter in letters:
        holders = [(o, t) for o, t in zip(operands, terms) if letter in t]
        size = ctx.size(holders[0][0], holders[0][1].index(letter))
        if not ctx.can_split(size):
            continue
        inputs = {o: S(t.index(letter)) if letter in t else R for o, t in zip(operands, terms)}
        if letter in output:
            strategies.append(Strategy(inputs, S(output.index(letter)), note=f"einsum on local {letter!r} entries"))
        else:
            strategies.append(Strategy(inputs, P, own_bytes=ctx.bytes_per_token(node),
                                       note=f"einsum summing over sharded {letter!r}: partial"))
    strategies.append(Strategy({o: R for o in operands}, R))
    return strategies


register("einsum")(_einsum)
