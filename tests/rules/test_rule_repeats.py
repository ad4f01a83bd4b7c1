"""plan/rules/repeats.py: ``repeat_interleave`` keeps a shard: of another dim untouched, of the repeated dim
when each rank's groups, repeated, are its heads (``output_size`` rewritten to this rank's)."""
import torch
from rule_graphs import capture, inputs_of, node, strategies

from fxparallel.plan.layout import ShardLayout
from fxparallel.plan.placement import R, S
from fxparallel.plan.rules.base import LocalOp


def _groups_to_heads(b):  # Mamba-2: B [batch, seq, groups, state] -> [batch, seq, heads, state]
    return b.repeat_interleave(3, dim=2, output_size=12)


def test_groups_sharded_become_heads_sharded():
    gm = capture(_groups_to_heads, (2, 5, 4, 8))
    (b,) = inputs_of(gm)
    found = strategies(node(gm, "repeat_interleave"), {b: S(2)})
    assert (found[0].inputs, found[0].output) == ({b: S(2)}, S(2))
    assert found[0].local == LocalOp.of("local_output_size", full=12)
    assert strategies(node(gm, "repeat_interleave"), {b: S(3)})[0].output == S(3)  # another dim


def test_groups_and_heads_split_unevenly_apart_run_replicated():
    gm = capture(_groups_to_heads, (2, 5, 4, 8))
    (b,) = inputs_of(gm)
    # 4 groups 1/1/1/1 but 12 heads split 4/4/2/2: rank 2's heads are not its group repeated
    layout = ShardLayout(4, {12: (4, 4, 2, 2)})
    assert [s.output for s in strategies(node(gm, "repeat_interleave"), {b: S(2)}, tp=4, layout=layout)] == [R]
