"""plan/rules/linear.py: the Megatron pair (column / row), the bias added after the reduction,
and replication, for F.linear and addmm (Conv1D)."""
import torch
import torch.nn.functional as F
from rule_graphs import by_name, capture, inputs_of, node, strategies

from fxparallel.plan.placement import P, R, S
from fxparallel.plan.rules.base import LocalOp


def test_linear_offers_column_row_and_replicate():
    gm = capture(lambda x, w: F.linear(x, w), (3, 5, 16), (32, 16), params=(1,))
    x, w = inputs_of(gm)
    found = by_name(strategies(node(gm, torch._C._nn.linear), {}))
    assert found["column"].inputs == {x: R, w: S(0)} and found["column"].output == S(2)
    row = found["row"]
    assert row.inputs == {x: S(2), w: S(1)} and row.output == P and row.local is None
    assert found["replicate"].output == R


def test_row_parallel_bias_is_added_after_the_all_reduce():
    gm = capture(lambda x, w, b: F.linear(x, w, b), (3, 5, 16), (32, 16), (32,), params=(1, 2))
    x, w, b = inputs_of(gm)
    row = by_name(strategies(node(gm, torch._C._nn.linear), {}))["row"]
    assert row.inputs == {x: S(2), w: S(1), b: R} and row.output == R
    assert row.local == LocalOp.of("bias_after_reduce", bias_index=2, dense=False)


def test_addmm_row_parallel_becomes_mm_plus_bias():
    gm = capture(lambda b, x, w: torch.addmm(b, x, w), (32,), (15, 16), (16, 32), params=(0, 2))
    b, x, w = inputs_of(gm)
    found = by_name(strategies(node(gm, torch.addmm), {}))
    assert found["column"].inputs == {b: S(0), x: R, w: S(1)}
    assert found["row"].local == LocalOp.of("bias_after_reduce", bias_index=0, dense=True)


def test_no_split_where_tp_does_not_divide_and_no_layout():
    gm = capture(lambda x, w: F.linear(x, w), (3, 5, 15), (33, 15), params=(1,))
    assert set(by_name(strategies(node(gm, torch._C._nn.linear), {}))) == {"replicate"}
