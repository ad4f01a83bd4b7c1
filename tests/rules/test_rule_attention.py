"""plan/rules/attention.py (registered through dropout.py): q, k, v split by heads (or by batch), a mask
with a head dimension split with them and a broadcast one used whole, one key/value head (multi-query)
used whole by every rank, grouped-query heads split only where each rank keeps its kv heads' query heads."""
import torch.nn.functional as F
from rule_graphs import capture, inputs_of, node, strategies

from fxparallel.plan.layout import ShardLayout
from fxparallel.plan.placement import R, S

sdpa = F.scaled_dot_product_attention


def test_heads_then_batch_and_a_mask_sliced_with_its_heads():
    gm = capture(lambda q, k, v, m: sdpa(q, k, v, attn_mask=m), (2, 4, 5, 8), (2, 4, 5, 8), (2, 4, 5, 8), (2, 4, 5, 5))
    q, k, v, m = inputs_of(gm)
    found = strategies(node(gm, sdpa), {q: S(1)})
    assert [(s.inputs, s.output) for s in found] == [
        ({q: S(1), k: S(1), v: S(1), m: S(1)}, S(1)),
        ({q: S(0), k: S(0), v: S(0), m: S(0)}, S(0)),
        ({q: R, k: R, v: R, m: R}, R)]
    assert found[0].note == "attention on local heads" and found[1].note == "attention on local batch"


def test_a_mask_broadcast_over_heads_is_used_whole():
    gm = capture(lambda q, k, v, m: sdpa(q, k, v, attn_mask=m), (2, 4, 5, 8), (2, 4, 5, 8), (2, 4, 5, 8), (2, 1, 5, 5))
    q, k, v, m = inputs_of(gm)
    heads, batch, _ = strategies(node(gm, sdpa), {})
    assert heads.inputs == {q: S(1), k: S(1), v: S(1), m: R} and heads.output == S(1)
    assert batch.inputs[m] == S(0)  # the mask's batch dim is not broadcast: split with the batch


def test_one_key_value_head_serves_every_ranks_query_heads():
    gm = capture(lambda q, k, v, m: sdpa(q, k, v, attn_mask=m), (2, 4, 5, 8), (2, 1, 5, 8), (2, 1, 5, 8), (2, 4, 5, 5))
    q, k, v, m = inputs_of(gm)
    found = strategies(node(gm, sdpa), {})
    assert [(s.inputs, s.output) for s in found] == [
        ({q: S(0), k: S(0), v: S(0), m: S(0)}, S(0)),  # one kv head cannot be split by heads: batch first
        ({q: S(1), k: R, v: R, m: S(1)}, S(1)),
        ({q: R, k: R, v: R, m: R}, R)]


def test_grouped_query_heads_split_only_with_their_kv_heads():
    # 9 query heads over 3 kv heads at tp=2: kv 2/1 with query 6/3 keeps each group; query 5/4 does not
    gm = capture(lambda q, k, v: sdpa(q, k, v, enable_gqa=True), (1, 9, 5, 8), (1, 3, 5, 8), (1, 3, 5, 8))
    q, k, v = inputs_of(gm)
    grouped = strategies(node(gm, sdpa), {}, layout=ShardLayout(2, {9: (6, 3), 3: (2, 1)}))
    assert [s.output for s in grouped] == [S(1), R]  # (a batch of 1 does not split)
    assert grouped[0].inputs == {q: S(1), k: S(1), v: S(1)}
    broken = strategies(node(gm, sdpa), {}, layout=ShardLayout(2, {9: (5, 4), 3: (2, 1)}))
    assert [s.output for s in broken] == [R]


def test_attention_that_is_not_four_dimensional_or_does_not_split_runs_replicated():
    gm = capture(lambda q, k, v: sdpa(q, k, v), (4, 5, 8), (4, 5, 8), (4, 5, 8))
    assert [s.output for s in strategies(node(gm, sdpa), {})] == [R]
    gm = capture(lambda q, k, v: sdpa(q, k, v), (3, 3, 5, 8), (3, 3, 5, 8), (3, 3, 5, 8))
    q, k, v = inputs_of(gm)
    assert [(s.inputs, s.output) for s in strategies(node(gm, sdpa), {q: S(1)})] == [({q: R, k: R, v: R}, R)]
