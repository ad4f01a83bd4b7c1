"""plan/rules/elementwise.py: a pointwise op is sharded where a sharded input lines up with its output
(inputs aligned from the right), slicing a replicated operand of full size and using a broadcast one
whole; a blocked or segmented shard passes through as it is; torch.max / min are pointwise with a second
tensor and a reduction along ``dim`` otherwise."""
import operator

import torch
from rule_graphs import capture, inputs_of, node, strategies

from fxparallel.plan.placement import R, S


def test_operands_aligned_from_the_right_sliced_or_broadcast():
    gm = capture(lambda x, b: x + b, (3, 6, 16), (16,))
    x, b = inputs_of(gm)
    found = strategies(node(gm, operator.add), {x: S(2)})
    assert [(s.inputs, s.output) for s in found] == [({x: S(2), b: S(0)}, S(2)), ({x: R, b: R}, R)]
    gm = capture(lambda x, b: x * b, (3, 6, 16), (6, 1))
    x, b = inputs_of(gm)
    assert strategies(node(gm, operator.mul), {x: S(2)})[0].inputs == {x: S(2), b: R}  # size 1 there: whole
    assert strategies(node(gm, operator.mul), {x: S(1)})[0].inputs == {x: S(1), b: S(0)}
    assert strategies(node(gm, operator.mul), {b: S(0)})[0].output == S(1)  # the smaller operand's shard


def test_a_dim_that_does_not_split_is_not_sharded():
    gm = capture(lambda x: torch.exp(x), (3, 5, 15))
    (x,) = inputs_of(gm)
    assert [s.output for s in strategies(node(gm, torch.exp), {x: S(2)})] == [R]
    gm = capture(lambda x, y: torch.maximum(x, y), (3, 6, 16), (3, 6, 16))
    x, y = inputs_of(gm)
    # y's shard of the batch (3) cannot split at tp=2: only x's shard is offered, y sliced to match
    found = strategies(node(gm, torch.maximum), {x: S(2), y: S(0)})
    assert [(s.inputs, s.output) for s in found] == [({x: S(2), y: S(2)}, S(2)), ({x: R, y: R}, R)]


def test_blocked_and_segmented_shards_pass_through_whole():
    gm = capture(lambda x, b: x * b, (8, 5, 16), (5, 1))
    x, b = inputs_of(gm)
    assert strategies(node(gm, operator.mul), {x: S(0, block=4)})[0].output == S(0, block=4)
    assert strategies(node(gm, operator.mul), {x: S(0, block=3)})[0].output == R  # a block of 3 does not split
    gm = capture(lambda x, b: x * b, (3, 5, 16), (16,))
    x, b = inputs_of(gm)
    found = strategies(node(gm, operator.mul), {x: S(2, segments=(8, 8))})
    assert (found[0].inputs, found[0].output) == ({x: S(2, (8, 8)), b: S(0, (8, 8))}, S(2, (8, 8)))
    assert strategies(node(gm, operator.mul), {x: S(2, segments=(9, 7))})[0].output == R  # 9, 7: odd


def test_max_and_min_pointwise_or_along_a_dim():
    gm = capture(lambda x, y: torch.max(x, y), (3, 6, 16), (3, 6, 16))
    x, y = inputs_of(gm)
    assert [s.output for s in strategies(node(gm, torch.max), {x: S(2)})] == [S(2), R]
    gm = capture(lambda x: torch.max(x, dim=1), (3, 6, 16))
    (x,) = inputs_of(gm)
    assert [s.output for s in strategies(node(gm, torch.max), {x: S(2)})] == [(S(1), S(1)), (R, R)]
    assert [s.output for s in strategies(node(gm, torch.max), {x: S(1)})] == [(R, R)]  # along the shard: whole
    gm = capture(lambda x: torch.min(x, 1, keepdim=True), (3, 6, 16))
    (x,) = inputs_of(gm)
    assert strategies(node(gm, torch.min), {x: S(2)})[0].output == (S(2), S(2))


def test_whole_segments_pass_through_an_op_of_their_own_shards_only():
    gm = capture(lambda x, m: torch.nn.functional.silu(x) * m, (2, 5, 24), (2, 5, 1))
    x, m = inputs_of(gm)
    xbc = S(2, (16, 4, 4), whole=(1, 2))
    silu = next(n for n in gm.graph.nodes if n.op == "call_function" and "silu" in str(n.target))
    assert strategies(silu, {x: xbc})[0].output == xbc
    mul = next(n for n in gm.graph.nodes if n.target is operator.mul)
    found = strategies(mul, {silu: xbc})
    assert (found[0].inputs, found[0].output) == ({silu: xbc, m: R}, xbc)  # the mask broadcasts: used whole
    # a full-size operand that takes a gradient would be sliced: gathered instead; a constant is sliced alike
    gm = capture(lambda x, y: x * y, (2, 5, 24), (2, 5, 24), params=(1,))
    x, y = inputs_of(gm)
    assert [s.output for s in strategies(node(gm, operator.mul), {x: xbc})] == [R]
    gm = capture(lambda x, y: x * y, (2, 5, 24), (2, 5, 24))
    x, y = inputs_of(gm)
    assert strategies(node(gm, operator.mul), {x: xbc})[0].inputs == {x: xbc, y: xbc}


def _mlstm_step(x, c, w, o):
    """xLSTM's decode step in miniature: the state ``c`` [batch, heads, d, d] cast before any activation is
    computed, then scaled per head by a column-parallel gate, written back, and read by a row-parallel output."""
    c_old = c.to(torch.float32)
    gate = torch.nn.functional.linear(x, w).view(2, 4, 8, 1)
    new = gate * c_old
    c.copy_(new)
    return torch.nn.functional.linear(new.sum(-1).flatten(1), o)


def test_a_state_read_first_by_a_cast_is_split_as_its_readers_need():
    """The cast sees nothing to line the state up with: each split but the batch's is offered, and the plan takes
    the heads the gate is split by (left whole, every rank kept the whole state, writing its heads' part)."""
    from rule_graphs import captured_graph

    from fxparallel.plan.layout import ShardLayout
    from fxparallel.plan.solver import solve

    gm = capture(_mlstm_step, (2, 16), (2, 4, 8, 8), (32, 16), (16, 32), params=(2, 3))
    captured = captured_graph(gm, params={2: "w.weight", 3: "o.weight"}, inputs={0: "x"})
    state = inputs_of(gm)[1].name
    captured.inputs[state] = captured.state[state] = "past_0_recurrent_states_0"
    plan = solve(captured, 2, layout=ShardLayout(2), trains=False)
    assert plan.params["past_key_values.0.recurrent_states_0"] == S(1), plan.params
    assert plan.reasons["past_key_values.0.recurrent_states_0"] == "a cache state split as its readers need"
    assert plan.params["w.weight"] == S(0) and plan.params["o.weight"] == S(1) and not plan.fallbacks
    cast = node(gm, "to")
    offered = [s.output for s in strategies(cast, {})]
    assert offered == [R]  # a plain tensor (not a cache state) read by a cast: whole, as before
