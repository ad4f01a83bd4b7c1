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
    assert [s.output for s in strategies(other, {kv: S(1)})] == [R]  # 3 at dim 1, not the input's 4: whole


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


def _read_then_filled(x, up, down):
    h = F.linear(x, up)  # column-parallel (down is row-parallel): split on its last dim
    out = F.linear(h, down)
    buf = h.new_zeros(h.shape)  # split alike
    before = buf.cumsum(-1)  # reads buf whole: a gathered copy
    buf[:, :1].copy_(h[:, :1])  # written through a view of the shard
    return out, before, buf.cumsum(-1)  # reads the written buf whole: gathered again, not the copy made before


def test_a_copy_made_before_a_write_through_a_view_is_not_read_after_it():
    gm = capture(_read_then_filled, (2, 3, 16), (64, 16), (16, 64), params=(1, 2))
    plan = solve(captured_graph(gm, params={1: "up.weight", 2: "down.weight"}, inputs={0: "x"}), 2,
                 layout=ShardLayout(2))
    assert plan.params == {"up.weight": S(0), "down.weight": S(1)}, plan.params
    assert plan.placements[node(gm, "new_zeros")] == S(2)
    graph = gm.graph
    insert_redistributions(graph, plan, GraphEditor(graph, fake_group(2), ShardLayout(2)))
    first, second = [n for n in graph.nodes if n.target == "cumsum"]
    write = next(n for n in graph.nodes if n.target == "copy_")
    order = {n: i for i, n in enumerate(graph.nodes)}
    assert first.args[0].target is second.args[0].target is collectives.all_gather
    assert first.args[0] is not second.args[0] and order[second.args[0]] > order[write]
