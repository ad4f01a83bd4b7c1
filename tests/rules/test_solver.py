"""plan/solver.py on a small graph, without processes: a two-matrix MLP gets Megatron's plan
(first matrix by columns, second by rows: one all-reduce of the output, nothing else)."""
import torch.nn.functional as F
from rule_graphs import capture, captured_graph

from fxparallel.plan.layout import ShardLayout
from fxparallel.plan.placement import S
from fxparallel.plan.solver import solve


def _mlp(x, up, down):
    return F.linear(F.silu(F.linear(x, up)), down)


def test_mlp_is_column_then_row():
    gm = capture(_mlp, (3, 5, 16), (64, 16), (16, 64), params=(1, 2))
    plan = solve(captured_graph(gm, params={1: "up.weight", 2: "down.weight"}, inputs={0: "x"}), 2,
                 layout=ShardLayout(2))
    assert plan.params == {"up.weight": S(0), "down.weight": S(1)}
    assert plan.replicated_bytes == 0
    assert not plan.fallbacks


def test_fixed_placements_are_kept():
    gm = capture(_mlp, (3, 5, 16), (64, 16), (16, 64), params=(1, 2))
    fixed = {"up.weight": S(1), "down.weight": S(0)}
    plan = solve(captured_graph(gm, params={1: "up.weight", 2: "down.weight"}, inputs={0: "x"}), 2,
                 fixed=fixed, layout=ShardLayout(2))
    assert plan.params == fixed
