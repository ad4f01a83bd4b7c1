"""Writes into a value (``x[index] = v``, in-place ops): the written value keeps its placement where a rule
allows (plan/rules/indexing.py: RecurrentGemma's scan fills ``states[:, t]`` shard by shard), and where a
write runs on a gathered copy, rewrite/redistribute.py puts this rank's part back, so later readers see it."""
import operator

import torch
import torch.nn.functional as F
from rule_graphs import capture, captured_graph, inputs_of, node, strategies

from fxparallel.group import fake_group
from fxparallel.plan.layout import ShardLayout
from fxparallel.plan.placement import R, S
from fxparallel.plan.solver import solve
from fxparallel.ops import collectives
from fxparallel.rewrite.editor import GraphEditor
from fxparallel.rewrite.gradient_reductions import insert_gradient_reductions
from fxparallel.rewrite.redistribute import insert_redistributions


def test_a_slice_write_keeps_the_shard_of_its_destination():
    def fn(states, v):
        states[:, 1] = v
        return states

    gm = capture(fn, (2, 5, 16), (2, 16))
    states, v = inputs_of(gm)
    found = strategies(node(gm, operator.setitem), {states: S(2)})
    assert (found[0].inputs, found[0].output) == ({states: S(2), v: S(1)}, S(2))
    assert found[-1].output == R


def _write_by_index(x, up, idx):
    y = F.linear(x, up)  # column-parallel: y is sharded on its last dim
    y[idx] = 0  # a tensor index: no rule keeps y's shard, the write runs on a gathered copy
    return y * 2


def test_a_write_into_a_gathered_copy_is_written_back_to_the_shard():
    gm = capture(_write_by_index, (3, 5, 16), (64, 16), ("ids", (2,)), params=(1,))
    plan = solve(captured_graph(gm, params={1: "up.weight"}, inputs={0: "x", 2: "idx"}), 2, layout=ShardLayout(2))
    assert plan.params == {"up.weight": S(0)}
    graph = gm.graph
    insert_redistributions(graph, plan, GraphEditor(graph, fake_group(2), ShardLayout(2)))
    write = node(gm, operator.setitem)
    gathered = write.args[0]
    assert gathered.target is collectives.all_gather
    back = write.next.next
    assert write.next.target is collectives.local_chunk and write.next.args[0] is gathered
    assert back.target == "copy_" and back.args == (gathered.args[0], write.next)
    assert node(gm, operator.mul).args[0] is gathered.args[0]  # the reader after the write reads the shard


def _flip_then_row_parallel(x, up, down):
    h = F.linear(x, up)  # column-parallel: h split on its last dim
    h = torch.flip(h, dims=[-1])  # no rule: run on the gathered h, replicated after it
    return F.linear(h, down)  # row-parallel: this rank's slice of the flipped h (local_chunk)


def test_a_gathered_value_sliced_for_a_row_parallel_layer_sums_its_gradient():
    """The slice's gradient on each rank covers its columns only: the flipped value's gradient is summed over the
    ranks (copy_to_tp) before the flip's backward and the gather's, which keeps this rank's part. Without it the
    loss and logits stay exact and the gradients are off (by 0.03 in tests/test_fallback_ops.py, when its solver
    chose row-parallel there; it now chooses column-parallel, so this graph fixes the placement)."""
    gm = capture(_flip_then_row_parallel, (3, 5, 16), (64, 16), (16, 64), params=(1, 2))
    captured = captured_graph(gm, params={1: "up.weight", 2: "down.weight"}, inputs={0: "x"})
    plan = solve(captured, 2, fixed={"down.weight": S(1)}, layout=ShardLayout(2))
    assert plan.params == {"up.weight": S(0), "down.weight": S(1)}
    graph = gm.graph
    group = fake_group(2)
    consumers = insert_redistributions(graph, plan, GraphEditor(graph, group, ShardLayout(2)))
    insert_gradient_reductions(graph, consumers, group.handle, plan, set())
    path, value = [], node(gm, collectives.local_chunk).args[0]
    while value.target is not collectives.all_gather:  # from the slice back to the gather
        path.append(value.target)
        value = value.args[0]
    # (the reduction may sit on the flip's input: the flip is linear, the summed gradient the same)
    assert path.count(collectives.copy_to_tp) == 1 and torch.flip in path, path
