"""Writes into a value (``x[index] = v``, in-place ops): the written value keeps its placement where a rule
allows (plan/rules/indexing.py: RecurrentGemma's scan fills ``states[:, t]`` shard by shard), and where a
write runs on a gathered copy, rewrite/redistribute.py puts this rank's part back, so later readers see it."""
import operator

import torch.nn.functional as F
from rule_graphs import capture, captured_graph, inputs_of, node, strategies

from fxparallel.group import fake_group
from fxparallel.plan.layout import ShardLayout
from fxparallel.plan.placement import R, S
from fxparallel.plan.solver import solve
from fxparallel.ops import collectives
from fxparallel.rewrite.editor import GraphEditor
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
