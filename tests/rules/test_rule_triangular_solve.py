"""plan/rules/triangular_solve.py: ``solve_triangular`` keeps a batch dim sharded in both operands (heads)
and ``B``'s columns against a whole ``A``; the right-hand form and other splits run replicated. The solution
on local shards is checked against the whole solve."""
import torch
from rule_graphs import capture, inputs_of, node, strategies

from fxparallel.plan.placement import R, S
from fxparallel.plan.rules.triangular_solve import _solve_triangular


def _one(gm):
    return node(gm, torch.linalg.solve_triangular)


def _solve(a, b):
    return torch.linalg.solve_triangular(a, b, upper=False, unitriangular=True)


def test_heads_sharded_in_both_operands_stay_sharded():
    gm = capture(_solve, (2, 4, 3, 8, 8), (2, 4, 3, 8, 16))  # [batch, heads, chunks, chunk, chunk]
    a, b = inputs_of(gm)
    found = strategies(_one(gm), {a: S(1), b: S(1)})
    assert (found[0].inputs, found[0].output) == ({a: S(1), b: S(1)}, S(1))
    assert found[-1].inputs == {a: R, b: R} and found[-1].output == R
    # numerically: each rank's heads solved alone are the whole solve's
    torch.manual_seed(0)
    lower = torch.randn(2, 4, 3, 8, 8).tril(-1) * 0.3 + torch.eye(8)
    rhs = torch.randn(2, 4, 3, 8, 16)
    whole = _solve(lower, rhs)
    for rank in range(2):
        heads = slice(2 * rank, 2 * rank + 2)
        assert torch.allclose(_solve(lower[:, heads], rhs[:, heads]), whole[:, heads], atol=1e-5)


def test_columns_of_b_against_a_whole_a():
    gm = capture(_solve, (2, 8, 8), (2, 8, 16))
    a, b = inputs_of(gm)
    found = strategies(_one(gm), {b: S(2)})
    assert (found[0].inputs, found[0].output) == ({a: R, b: S(2)}, S(2))
    # the solved rows (dim -2) and A's matrix dims never split
    assert [s.output for s in strategies(_one(gm), {b: S(1)})] == [R]
    assert [s.output for s in strategies(_one(gm), {a: S(2)})] == [R]


def test_the_right_hand_form_has_no_rule():
    gm = capture(lambda a, b: torch.linalg.solve_triangular(a, b, upper=False, left=False), (2, 8, 8), (2, 16, 8))
    a, b = inputs_of(gm)
    assert _solve_triangular(_one(gm), {a: S(0), b: S(0)}, None) == []  # the solver gathers
