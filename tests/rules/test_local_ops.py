"""rewrite/local_ops.py: what each LocalOp does to a node, per rank (fake group, no processes)."""
import operator

import torch.nn.functional as F
from rule_graphs import capture, node

from fxparallel.group import fake_group
from fxparallel.plan.layout import ShardLayout
from fxparallel.plan.placement import S
from fxparallel.plan.rules.base import LocalOp
from fxparallel.rewrite.editor import GraphEditor
from fxparallel.ops.vocab_parallel import vocab_parallel_embedding
from fxparallel.rewrite.local_ops import apply_local_op


def test_vocab_parallel_embedding_reads_this_ranks_rows():
    # 100 rows at tp=3: torch.chunk's 34/34/32; rank 2 starts at 68
    gm = capture(lambda ids, w: F.embedding(ids, w), ("ids", (3, 5)), (100, 16), params=(1,))
    n = node(gm, F.embedding)
    editor = GraphEditor(gm.graph, fake_group(3, rank=2), ShardLayout(3, {100: (34, 34, 32)}))
    apply_local_op(n, LocalOp.of("vocab_parallel_embedding"), editor)
    assert n.target is vocab_parallel_embedding and n.args[2:4] == (68, 32)


def test_view_size_becomes_local():
    gm = capture(lambda x: x.view(3, 5, 4, 8), (3, 5, 32))
    n = node(gm, "view")
    apply_local_op(n, LocalOp.of("local_view_size", dim=2, full=4, segmented=None),
                   GraphEditor(gm.graph, fake_group(2, rank=1)))
    assert tuple(n.args[1:]) == (3, 5, 2, 8)


def test_mean_of_full_rescales_the_local_mean():
    gm = capture(lambda x: x.mean(-1), (3, 5, 10))
    n = node(gm, "mean")
    apply_local_op(n, LocalOp.of("mean_of_full", parts=(10,)),
                   GraphEditor(gm.graph, fake_group(3, rank=2), ShardLayout(3, {10: (4, 4, 2)})))
    scaled = next(iter(n.users))
    assert scaled.args == (n, 2 / 10)


def test_owned_item_reads_its_slice_on_the_owner_and_nothing_elsewhere():
    # row 40 of 100 at tp=3 (34/34/32): rank 1 holds rows 34..67, so its local row 6; rank 2 holds none
    for rank, kept in ((1, slice(6, 7)), (2, slice(0, 0))):
        gm = capture(lambda w: w[40], (100, 16))
        n = node(gm, operator.getitem)
        apply_local_op(n, LocalOp.of("owned_item", dim=0, position=0, item=40),
                       GraphEditor(gm.graph, fake_group(3, rank=rank), ShardLayout(3, {100: (34, 34, 32)})))
        assert n.args[1] == kept
        (summed,) = n.users
        assert summed.target == "sum" and summed.args == (n, 0) and gm.graph.output_node().args[0] in (summed, (summed,))


def test_split_into_runs_of_segments_takes_this_ranks_part_of_each_run():
    gm = capture(lambda x: x.split([8, 16, 2], -1), (4, 6, 26))
    n = node(gm, "split")
    apply_local_op(n, LocalOp.of("local_split_sizes", placement=S(2, (8, 8, 4, 4, 2)), groups=((0,), (1, 2, 3), (4,))),
                   GraphEditor(gm.graph, fake_group(2, rank=1)))
    assert list(n.args[1]) == [4, 8, 1]


def test_depthwise_conv_groups_over_segments_and_repeat_output_size_become_local():
    gm = capture(lambda x, w: F.conv1d(x, w, groups=16), (2, 16, 5), (16, 1, 3), params=(1,))
    n = node(gm, F.conv1d)
    apply_local_op(n, LocalOp.of("local_groups", channels=16, segments=(8, 4, 4)),
                   GraphEditor(gm.graph, fake_group(2, rank=0)))
    assert (n.args[6] if len(n.args) > 6 else n.kwargs["groups"]) == 8
    gm = capture(lambda b: b.repeat_interleave(3, dim=2, output_size=12), (2, 5, 4, 8))
    n = node(gm, "repeat_interleave")
    apply_local_op(n, LocalOp.of("local_output_size", full=12), GraphEditor(gm.graph, fake_group(4, rank=3)))
    assert (n.args[3] if len(n.args) > 3 else n.kwargs["output_size"]) == 3
