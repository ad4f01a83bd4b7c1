"""plan/rules/partial.py: a partial sum is carried through ops linear in it (reshapes, scaling by a
replicated value or a number, the numerator of a division, the sum of two partial sums), offered before
the op's own strategies; not from a value used twice, nor into an output with more elements per token."""
import operator

import torch
from rule_graphs import capture, inputs_of, node, strategies

from fxparallel.plan.placement import P, R


def _first(fn, target, *shapes, partial=(0,)):
    gm = capture(fn, *shapes)
    holders = inputs_of(gm)
    return holders, strategies(node(gm, target), {holders[i]: P for i in partial})


def test_a_reshape_carries_its_partial_input():
    (y,), found = _first(lambda y: y.view(15, 32), "view", (3, 5, 32))
    assert (found[0].name, found[0].inputs, found[0].output) == ("partial", {y: P}, P)
    assert all(s.name != "partial" for s in found[1:])


def test_not_from_a_value_used_twice():
    _, found = _first(lambda y: y.view(15, 32) + y.sum(), "view", (3, 5, 32))
    assert all(s.name != "partial" for s in found)


def test_scaled_by_a_replicated_value_or_divided_by_one():
    (y, r), found = _first(lambda y, r: y * r, operator.mul, (3, 5, 32), (3, 5, 1))
    assert (found[0].name, found[0].inputs, found[0].output) == ("partial", {y: P, r: R}, P)
    (y, r), found = _first(lambda y, r: y / r, operator.truediv, (3, 5, 32), (3, 5, 1))
    assert found[0].name == "partial"
    (y,), found = _first(lambda y: y * 0.5, operator.mul, (3, 5, 32))
    assert (found[0].name, found[0].inputs) == ("partial", {y: P})
    _, found = _first(lambda y, r: r / y, operator.truediv, (3, 5, 32), (3, 5, 1))  # 1 / (a + b) is not linear
    assert all(s.name != "partial" for s in found)
    _, found = _first(lambda y, r: y * r, operator.mul, (3, 5, 1), (3, 5, 32))  # broadcast up: more to reduce
    assert all(s.name != "partial" for s in found)


def test_two_partial_sums_added_once():
    (a, b), found = _first(lambda a, b: a + b, operator.add, (3, 5, 32), (1, 5, 32), partial=(0, 1))
    assert (found[0].name, found[0].inputs, found[0].output) == ("partial", {a: P, b: P}, P)
    _, found = _first(lambda a, b: torch.add(a, b, alpha=2), torch.add, (3, 5, 32), (3, 5, 32), partial=(0, 1))
    assert found[0].name == "partial"
    _, found = _first(lambda a, b: a + b, operator.add, (3, 1, 32), (1, 5, 32), partial=(0, 1))  # the sum grows
    assert all(s.name != "partial" for s in found)
    _, found = _first(lambda a, b: a + b, operator.add, (3, 5, 32), (3, 5, 32))  # one partial, one replicated
    assert all(s.name != "partial" for s in found)


def test_a_nonlinear_op_reduces_first():
    _, found = _first(lambda y: y.exp(), "exp", (3, 5, 32))
    assert [(s.name, s.output) for s in found] == [("", R)]
