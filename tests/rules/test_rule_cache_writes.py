"""plan/rules/cache_writes.py: ``cache.index_copy_(dim, positions, new)`` writes a KV cache by the shard of the
new keys / values (each rank caches its kv heads); a shard of the written dim, a segmented or blocked
one, or replicated new values give a replicated cache. ``state.copy_(new)`` writes a linear-attention /
state-space layer's state (a graph input) by the shard of the new state, segmented ones included (Mamba-2's
convolution window over its fused x | B | C channels); a copy into a computed value has no rule here."""
from rule_graphs import capture, inputs_of, node, strategies

from fxparallel.plan.placement import R, S


def test_a_cache_is_written_by_the_shard_of_its_new_values():
    gm = capture(lambda c, pos, new: c.index_copy_(2, pos, new), (2, 4, 8, 16), ("ids", (3,)), (2, 4, 3, 16))
    c, pos, new = inputs_of(gm)
    found = strategies(node(gm, "index_copy_"), {new: S(1)})
    assert [(s.name, s.inputs, s.output) for s in found] == [
        ("shard", {c: S(1), pos: R, new: S(1)}, S(1)), ("replicate", {c: R, pos: R, new: R}, R)]
    for refused in (S(2), S(3, segments=(8, 8)), S(0, block=2), R):  # the written dim, segments, blocks, whole
        assert [s.name for s in strategies(node(gm, "index_copy_"), {new: refused})] == ["replicate"]


def test_a_negative_dim_is_the_same_dim():
    gm = capture(lambda c, pos, new: c.index_copy_(-2, pos, new), (2, 4, 8, 16), ("ids", (3,)), (2, 4, 3, 16))
    c, pos, new = inputs_of(gm)
    assert [s.output for s in strategies(node(gm, "index_copy_"), {new: S(1)})] == [S(1), R]
    assert [s.output for s in strategies(node(gm, "index_copy_"), {new: S(2)})] == [R]


def test_a_recurrent_state_is_written_whole_by_the_shard_of_the_new_state():
    gm = capture(lambda state, new: state.copy_(new), (2, 8, 4), (2, 8, 4))
    state, new = inputs_of(gm)
    for p in (S(1), S(1, segments=(4, 2, 2))):
        assert [(s.name, s.inputs, s.output) for s in strategies(node(gm, "copy_"), {new: p})] == [
            ("shard", {state: p, new: p}, p), ("replicate", {state: R, new: R}, R)]
    assert [s.name for s in strategies(node(gm, "copy_"), {new: S(0, block=2)})] == ["replicate"]
    assert [s.name for s in strategies(node(gm, "copy_"), {new: R})] == ["replicate"]


def test_a_copy_into_a_computed_value_writes_it_as_it_is_placed():
    """Never a strategy that would redistribute the value written (the write would land in a copy): its own
    placement, the source brought to it (rules/new_tensors.py's MLA keys)."""
    gm = capture(lambda x, new: (x * 2).copy_(new), (2, 8, 4), (2, 8, 4))
    _, new = inputs_of(gm)
    computed = node(gm, "copy_").args[0]
    for kept in (S(1), R):
        found = strategies(node(gm, "copy_"), {new: S(2), computed: kept})
        assert [(s.inputs, s.output) for s in found] == [({computed: kept, new: kept}, kept)]
    assert strategies(node(gm, "copy_"), {new: S(1), computed: S(1, (4, 4))}) == []  # segmented: none, gathered


def test_a_copy_into_a_computed_value_takes_a_broadcasting_source_whole():
    """A source that broadcasts along the written value's split (a missing dim, or size 1 there) is read whole;
    one that has the dim, by the same shard, aligned from the right."""
    gm = capture(lambda x, row, col: ((x * 2).copy_(row), (x * 3).copy_(col)), (2, 8, 4), (4,), (2, 1, 4))
    _, row, col = inputs_of(gm)
    into_row, into_col = [n for n in gm.graph.nodes if n.target == "copy_"]
    for write, source in ((into_row, row), (into_col, col)):
        computed = write.args[0]
        assert strategies(write, {computed: S(1)})[0].inputs == {computed: S(1), source: R}  # broadcast on dim 1
        assert strategies(write, {computed: S(2)})[0].inputs == {computed: S(2), source: S(source.meta["example_value"].dim() - 1)}
