"""plan/rules/experts.py: stacked expert weights [experts, out, in] split like a dense MLP on a dim past
the experts (gate_up by segments where its output is later chunked into gate and up); gathers by ids
keep a shard of the other dims and carry a partial sum; grouped_mm offers column, row and replicate."""
import operator

import torch
from rule_graphs import capture, inputs_of, node, strategies

from fxparallel.plan.layout import ShardLayout
from fxparallel.plan.placement import P, R, S
from fxparallel.plan.rules.base import RuleContext
from fxparallel.plan.rules.experts import is_expert_weight, weight_choices


def _moe(x, ids, gate_up, down):  # transformers' batched_mm kernel: the chosen experts' weights, then bmm
    h = torch.bmm(gate_up[ids], x.unsqueeze(-1)).squeeze(-1)
    gate, up = h.chunk(2, dim=-1)
    return torch.bmm(down[ids], (gate * up).unsqueeze(-1)).squeeze(-1)


def test_expert_weights_split_past_their_experts_dim():
    gm = capture(_moe, (6, 16), ("ids", (6,)), (4, 32, 16), (4, 16, 16), params=(2, 3))
    x, ids, gate_up, down = inputs_of(gm)
    assert is_expert_weight(gate_up) and not is_expert_weight(x)
    ctx = RuleContext(tp=2, layout=ShardLayout(2))
    assert weight_choices(gate_up, ctx) == [S(1, (16, 16)), S(2), R]  # gate and up each split
    assert weight_choices(down, ctx) == [S(1), S(2), R]
    assert weight_choices(down, RuleContext(tp=3, layout=ShardLayout(3))) == [R]


def test_a_gather_by_ids_keeps_each_choice_of_an_expert_weight():
    gm = capture(_moe, (6, 16), ("ids", (6,)), (4, 32, 16), (4, 16, 16), params=(2, 3))
    x, ids, gate_up, down = inputs_of(gm)
    gather = next(n for n in gm.graph.nodes if n.target is operator.getitem and n.args[0] is gate_up)
    found = strategies(gather, {})
    assert [(s.name, s.inputs, s.output) for s in found] == [
        ("gather", {gate_up: S(1, (16, 16)), ids: R}, S(1, (16, 16))), ("gather", {gate_up: S(2), ids: R}, S(2)),
        ("replicate", {gate_up: R, ids: R}, R)]
    assert found[0].note == "expert weights (each rank its slice of every expert)"


def test_a_gather_of_rows_keeps_other_shards_and_carries_a_partial_sum():
    gm = capture(lambda y, ids: y[ids], (4, 16), ("ids", (6,)))
    y, ids = inputs_of(gm)
    gather = node(gm, operator.getitem)
    assert [(s.inputs, s.output) for s in strategies(gather, {y: P})] == [({y: P, ids: R}, P), ({y: R, ids: R}, R)]
    assert [s.output for s in strategies(gather, {y: S(1)})] == [S(1), R]
    assert [s.output for s in strategies(gather, {y: S(0)})] == [R]  # the gathered dim itself
    gm = capture(lambda y, ids: y[ids], (4, 16), ("ids", (2, 3)))
    y, ids = inputs_of(gm)
    assert strategies(node(gm, operator.getitem), {y: S(1)})[0].output == S(2)  # after the ids' dims
    gm = capture(lambda y, ids: y[ids] + y, (4, 16), ("ids", (4,)))
    y, ids = inputs_of(gm)
    assert [s.output for s in strategies(node(gm, operator.getitem), {y: P})] == [R]  # a partial used twice
    gm = capture(lambda y, ids: torch.index_select(y, 1, ids), (4, 6, 16), ("ids", (3,)))
    y, ids = inputs_of(gm)
    assert [s.output for s in strategies(node(gm, torch.index_select), {y: S(2)})] == [S(2), R]
    assert [s.output for s in strategies(node(gm, torch.index_select), {y: S(1)})] == [R]


def _grouped(x, w, offs):
    return torch._grouped_mm(x.bfloat16(), w.bfloat16(), offs=offs.int())


def _grouped_then_chunked(x, w, offs):
    gate, up = _grouped(x, w, offs).chunk(2, dim=-1)
    return gate * up


def test_grouped_mm_column_row_and_replicate():
    gm = capture(_grouped, (8, 16), (4, 16, 32), ("ids", (4,)), params=(1,))
    mm = node(gm, torch._grouped_mm)
    x, w, offs = mm.args[0], mm.args[1], mm.kwargs["offs"]
    found = strategies(mm, {})
    assert [(s.name, s.inputs, s.output) for s in found] == [
        ("column", {x: R, w: S(2), offs: R}, S(1)), ("row", {x: S(1), w: S(1), offs: R}, P),
        ("replicate", {x: R, w: R, offs: R}, R)]
    assert found[1].own_bytes == 8 * 32 * 2  # its all-reduce: the [8, 32] bf16 output (one token in the example)
    assert [s.name for s in strategies(mm, {}, tp=3, layout=ShardLayout(3))] == ["replicate"]
    gm = capture(_grouped_then_chunked, (8, 16), (4, 16, 32), ("ids", (4,)), params=(1,))
    column = strategies(node(gm, torch._grouped_mm), {})[0]
    assert column.output == S(1, (16, 16))
