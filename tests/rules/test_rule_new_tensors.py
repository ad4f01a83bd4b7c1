"""``x.new_empty(*sizes)`` (and new_zeros / new_ones): sharded like ``x`` where the sizes keep ``x``'s size at its
split (plan/rules/new_tensors.py), and a ``copy_`` into such a computed value writes it as it is placed
(plan/rules/cache_writes.py): MLA's keys (DeepSeek-V2/V3, Kimi-Linear, ...) filled through slices stay split
by heads, with no collective, where they were gathered before."""
import torch.nn.functional as F
from rule_graphs import capture, captured_graph, node, strategies

from fxparallel.group import fake_group
from fxparallel.ops import collectives
from fxparallel.plan.layout import ShardLayout
from fxparallel.plan.placement import R, S
from fxparallel.plan.solver import solve
from fxparallel.rewrite.editor import GraphEditor
from fxparallel.rewrite.redistribute import insert_redistributions

HEADS, NOPE, ROPE, VALUE = 4, 6, 2, 5


def test_a_new_tensor_of_the_same_size_at_the_split_is_split_alike():
    def fn(kv):
        return kv.new_empty(*kv.shape[:-1], 8), kv.new_zeros(2, 3, 8, 8)

    gm = capture(fn, (2, HEADS, 3, 11))
    kv = next(n for n in gm.graph.nodes if n.op == "placeholder")
    same, other = [n for n in gm.graph.nodes if n.target in ("new_empty", "new_zeros")]
    found = strategies(same, {kv: S(1)})
    assert [s.output for s in found] == [S(1), R]
    assert found[0].inputs == {kv: None} and found[0].local.kind == "local_view_size"  # its size 4 -> 2 per rank
    assert [s.output for s in strategies(other, {kv: S(1)})] == [R]  # 8 at dim 1, not the input's 4: whole


def _mla_keys(x, kv_b, k_rot):
    kv = F.linear(x, kv_b).view(2, 3, HEADS, NOPE + VALUE).transpose(1, 2)  # heads split (column-parallel)
    k_nope, value = kv.split([NOPE, VALUE], dim=-1)
    keys = kv.new_empty(*kv.shape[:-1], NOPE + ROPE)
    keys[..., :NOPE].copy_(k_nope)
    keys[..., NOPE:].copy_(k_rot.expand(-1, kv.shape[1], -1, -1))
    return keys * 2, value


def test_mla_keys_filled_through_slices_stay_split_by_heads():
    gm = capture(_mla_keys, (2, 3, 16), (HEADS * (NOPE + VALUE), 16), (2, 1, 3, ROPE), params=(1,))
    plan = solve(captured_graph(gm, params={1: "kv_b.weight"}, inputs={0: "x", 2: "k_rot"}), 2,
                 layout=ShardLayout(2))
    assert plan.params == {"kv_b.weight": S(0)} and not plan.fallbacks, plan.fallbacks
    keys = node(gm, "new_empty")
    assert plan.placements[keys] == S(1)
    graph = gm.graph
    insert_redistributions(graph, plan, GraphEditor(graph, fake_group(2), ShardLayout(2)))
    assert not [n for n in graph.nodes if n.target in (collectives.all_gather, collectives.all_reduce)]
    assert keys.args[2] == HEADS // 2  # its size at the heads dim: this rank's heads
    writes = [n for n in graph.nodes if n.target == "copy_"]
    assert len(writes) == 2 and all(w.args[0].args[0] is keys for w in writes)  # into slices of it, not a copy
