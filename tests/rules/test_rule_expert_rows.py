"""plan/rules/expert_rows.py: with expert parallelism an expert parameter's gather by ids takes whole experts
(S(0)) and gives expert rows E(n); row-wise ops keep them, the top-k combine sums them into a partial sum after
masking other ranks' rows, and anything else is left to the solver's fallback (rows made whole). The run-time
side (ops/expert_parallel.py): two ranks' masked rows sum to the single-device result."""
import operator

import torch
import torch.nn.functional as F
from rule_graphs import capture, inputs_of, node

from fxparallel.ops.expert_parallel import (gather_local_experts, mask_foreign_rows, roll_to_local_rows,
                                            rows_of_experts, unroll_local_rows)
from fxparallel.plan.layout import ShardLayout
from fxparallel.plan.placement import E, P, R, S
from fxparallel.plan.rules import expert_rows, rule_for
from fxparallel.plan.rules.base import RuleContext


def _moe(x, ids, w, gate_up, down):  # transformers' batched_mm kernel, top-k = 2, with the combine
    h = torch.bmm(gate_up[ids], x.unsqueeze(-1)).squeeze(-1)
    gate, up = h.chunk(2, dim=-1)
    o = torch.bmm(down[ids], (F.silu(gate) * up).unsqueeze(-1)).squeeze(-1)
    return (o * w.unsqueeze(-1)).view(3, 2, 16).sum(dim=1)


def _graph():
    return capture(_moe, (6, 16), ("ids", (6,)), (6,), (4, 32, 16), (4, 16, 16), params=(3, 4))


def _ctx(experts=frozenset()):
    """``experts``: the placeholders of the parameters stacked by expert (with expert parallelism)."""
    return RuleContext(tp=2, tokens=1, layout=ShardLayout(2), experts=experts)


def test_a_value_split_by_experts_is_gathered_as_the_experts_are():
    """A LoRA-adapted expert weight (``W + delta``, a computed value): placed S(0) like the experts, its gather by
    ids takes this rank's experts too; without expert parallelism a gather never splits dim 0."""
    gm = capture(lambda w, d, ids: (w + d)[ids], (4, 32, 16), (4, 32, 16), ("ids", (6,)), params=(0, 1))
    w, d, ids = inputs_of(gm)
    adapted = node(gm, operator.add)
    gather = next(n for n in gm.graph.nodes if n.target is operator.getitem)
    found = rule_for(gather)(gather, {adapted: S(0), ids: R}, _ctx(frozenset({w})))
    assert [(s.name, s.output) for s in found] == [("expert gather", E(1))]
    assert all(s.inputs[adapted] != S(0) for s in rule_for(gather)(gather, {adapted: S(0), ids: R}, _ctx()))


def test_an_expert_gather_takes_whole_experts_and_gives_expert_rows():
    gm = _graph()
    x, ids, w, gate_up, down = inputs_of(gm)
    gather = next(n for n in gm.graph.nodes if n.target is operator.getitem and n.args[0] is gate_up)
    found = rule_for(gather)(gather, {gate_up: R, ids: R}, _ctx(frozenset({gate_up, down})))
    assert [(s.name, s.inputs, s.output) for s in found] == [("expert gather", {gate_up: S(0), ids: R}, E(1))]
    assert found[0].local.kind == "expert_gather" and found[0].local.kwargs() == {"experts": 4}
    # without expert parallelism the experts are split inside
    assert all(s.name != "expert gather" for s in rule_for(gather)(gather, {gate_up: R, ids: R}, _ctx()))


def test_row_wise_ops_keep_expert_rows_and_the_combine_makes_a_partial_sum():
    gm = _graph()
    x, ids, w, gate_up, down = inputs_of(gm)
    placements = {x: R, ids: R, w: R, gate_up: S(0), down: S(0)}
    seen = {}
    for n in gm.graph.nodes:
        if n.op != "call_function" and n.op != "call_method":
            continue
        inputs = {i: placements.get(i, R) for i in n.all_input_nodes}
        if n.target is operator.getitem and n.args[0] in (gate_up, down):
            out = E(1)
        elif any(p is not None and not isinstance(p, tuple) and p.is_expert_rows for p in inputs.values()):
            found = expert_rows.strategies(n, inputs, _ctx())
            assert len(found) == 1, n
            out = found[0].output
            seen[n.name] = (found[0].name, out, found[0].local)
        elif n.target is operator.getitem and isinstance(placements.get(n.args[0]), tuple):
            out = placements[n.args[0]][n.args[1]]
        else:
            out = R
        placements[n] = out
    combine = node(gm, "sum")
    assert placements[combine] == P and seen[combine.name][0] == "expert combine"
    assert seen[combine.name][2].kind == "mask_foreign_rows" and seen[combine.name][2].kwargs() == {"lead": 2}
    assert placements[node(gm, "view")] == E(2)  # [6, 16] -> [3, 2, 16]: the rows over two dims
    assert placements[node(gm, F.silu)] == E(1) and placements[node(gm, "chunk")] == (E(1), E(1))


def test_ops_that_mix_rows_are_not_row_wise():
    gm = capture(lambda h: (h.softmax(dim=0), h.transpose(0, 1), h.sum(dim=-1), h.view(-1)), (6, 16))
    (h,) = inputs_of(gm)
    softmax, transpose, over_features, flat = (node(gm, "softmax"), node(gm, "transpose"), node(gm, "sum"),
                                               node(gm, "view"))
    for n in (softmax, transpose, flat):
        assert expert_rows.strategies(n, {h: E(1)}, _ctx()) == [], n
    assert expert_rows.strategies(over_features, {h: E(1)}, _ctx())[0].output == E(1)
    # norm(x, p, dim): its dim is the third argument (a norm over the rows is not row-wise)
    gm = capture(lambda h: (h.norm(2, 0), h.norm(2, -1)), (6, 16))
    (h,) = inputs_of(gm)
    over_rows, over_features = [n for n in gm.graph.nodes if n.target == "norm"]
    assert expert_rows.strategies(over_rows, {h: E(1)}, _ctx()) == []
    assert expert_rows.strategies(over_features, {h: E(1)}, _ctx())[0].output == E(1)


def test_masked_rows_of_two_ranks_sum_to_the_full_result():
    torch.manual_seed(0)
    weight, ids, x = torch.randn(5, 4, 3), torch.tensor([0, 4, 2, 2, 1, 3]), torch.randn(6, 3)
    full = torch.bmm(weight[ids], x.unsqueeze(-1)).squeeze(-1).view(3, 2, 4).sum(1)
    total = 0
    for start, count in ((0, 3), (3, 2)):  # 5 experts over 2 ranks: 3 / 2
        rows = torch.bmm(gather_local_experts(weight[start:start + count], ids, start, count),
                         x.unsqueeze(-1)).squeeze(-1).view(3, 2, 4)
        total = total + mask_foreign_rows(rows, rows_of_experts(ids, start, count), 2).sum(1)
    torch.testing.assert_close(total, full)


def test_each_rank_computes_its_experts_rows_of_a_grouped_product():
    """Rows sorted by expert (5 experts, 2 / 0 / 3 / 1 / 2 rows): a rank's run of rows rolled to the front,
    multiplied with its experts only (F.grouped_mm with its offsets), rolled back; others' rows are zero."""
    torch.manual_seed(0)
    weight, x = torch.randn(5, 4, 4), torch.randn(8, 4)  # (the CPU kernel takes 16-byte strides)
    offsets = torch.tensor([2, 2, 5, 6, 8], dtype=torch.int32)
    full = F.grouped_mm(x, weight, offs=offsets)
    total = 0
    for start, count in ((0, 3), (3, 2)):
        rows, local_offsets, back, mine = roll_to_local_rows(x, offsets, start, count)
        y = unroll_local_rows(F.grouped_mm(rows, weight[start:start + count], offs=local_offsets), mine, back)
        first, last = (int(offsets[start - 1]) if start else 0), int(offsets[start + count - 1])
        assert y[:first].abs().sum() == 0 and y[last:].abs().sum() == 0  # other ranks' rows
        torch.testing.assert_close(y[first:last], full[first:last])
        total = total + y
    torch.testing.assert_close(total, full)
