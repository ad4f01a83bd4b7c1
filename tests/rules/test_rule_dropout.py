"""plan/rules/dropout.py, rewrite/dropout_masks.py and ops/dropout_kernels.py: a training-mode dropout runs
where its input is and takes its part of one logical mask; the parts of every rank make up the one-device
mask exactly."""
import pytest
import torch
import torch.nn.functional as F
from rule_graphs import capture, inputs_of, node, strategies

from fxparallel.group import fake_group
from fxparallel.plan.layout import ShardLayout
from fxparallel.plan.placement import R, S, Placement
from fxparallel.plan.rules.base import LocalOp
from fxparallel.ops.dropout_kernels import attention_dropout, chunked_attention_dropout, keep_mask, logical_dropout
from fxparallel.rewrite.dropout_masks import tp_cuts
from fxparallel.rewrite.editor import GraphEditor
from fxparallel.rewrite.local_ops import apply_local_op


# ---- the rule ---------------------------------------------------------------------------------
def test_training_dropout_names_its_mask_slice_blocks_included():
    gm = capture(lambda x: F.dropout(x, 0.1, True), (3, 5, 32))
    (x,) = inputs_of(gm)
    found = strategies(node(gm, F.dropout), {x: S(2)})
    assert [s.output for s in found] == [S(2), R]
    assert [s.local for s in found] == [LocalOp.of("dropout_on_shards", placement=S(2)),
                                        LocalOp.of("dropout_on_shards", placement=R)]
    # batch x heads flattened (XGLM's attention weights): this rank's heads of every row, not gathered
    blocked = strategies(node(gm, F.dropout), {x: S(2, block=8)})
    assert blocked[0].output == S(2, block=8)
    assert blocked[0].local == LocalOp.of("dropout_on_shards", placement=S(2, block=8))


def test_eval_or_zero_rate_dropout_stays_plain_pointwise():
    for training, p in ((False, 0.1), (True, 0.0)):
        gm = capture(lambda x: F.dropout(x, p, training), (3, 5, 32))
        (x,) = inputs_of(gm)
        found = strategies(node(gm, F.dropout), {x: S(2, block=8)})
        assert found[0].output == S(2, block=8) and all(s.local is None for s in found)


def test_attention_with_dropout_names_its_heads_of_the_mask():
    for p, local in ((0.1, LocalOp.of("attention_with_dropout", placement=S(1))), (0.0, None)):
        gm = capture(lambda q, k, v: F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True),
                     (2, 4, 5, 8), (2, 4, 5, 8), (2, 4, 5, 8))
        q, k, v = inputs_of(gm)
        found = strategies(node(gm, F.scaled_dot_product_attention), {q: S(1), k: S(1), v: S(1)})
        assert found[0].output == S(1) and found[0].local == local


# ---- the local op -----------------------------------------------------------------------------
def test_dropout_on_shards_cuts_this_ranks_rows_segments_and_uneven_sizes():
    gm = capture(lambda x: F.dropout(x, 0.1, True), (3, 5, 100))
    n = node(gm, F.dropout)
    editor = GraphEditor(gm.graph, fake_group(3, rank=2), ShardLayout(3, {100: (34, 34, 32)}))
    apply_local_op(n, LocalOp.of("dropout_on_shards", placement=S(2)), editor)
    assert n.target is logical_dropout and n.args[1] == 0.1
    assert n.kwargs == {"cuts": (("pieces", 2, 100, ((68, 100),)),), "training": None}
    gm = capture(lambda x: F.dropout(x, 0.1, True), (3, 5, 128))
    segmented = GraphEditor(gm.graph, fake_group(2, rank=1))
    assert tp_cuts(node(gm, F.dropout), segmented, S(2, segments=(64, 32, 32))) == (
        ("pieces", 2, 128, ((32, 64), (80, 96), (112, 128))),)
    with pytest.raises(Exception, match="no slice of the logical mask"):
        tp_cuts(node(gm, F.dropout), segmented, Placement("S", 2, (64, 32, 32), whole=(1, 2)))
    uneven = GraphEditor(gm.graph, fake_group(3, rank=1), ShardLayout(3, {8: (3, 3, 2)}))
    assert tp_cuts(node(gm, F.dropout), uneven, S(0, block=8)) == (("blocks", 0, 8, ((3, 6),)),)


# ---- the masks ----------------------------------------------------------------------------------
def _parts(shape, cuts_of_rank, ranks, p=0.25):
    parts = []
    for rank in range(ranks):
        torch.manual_seed(3)
        parts.append(keep_mask(shape(rank), p, torch.float32, "cpu", cuts_of_rank(rank)))
    torch.manual_seed(3)
    return parts, keep_mask(shape(None), p, torch.float32, "cpu")


def test_every_layouts_parts_make_up_the_one_device_mask():
    # tensor parallelism, uneven: 100 columns as 34/34/32
    sizes = (34, 34, 32)
    parts, full = _parts(lambda r: (2, 6, 100 if r is None else sizes[r]),
                         lambda r: (("pieces", 2, 100, ((sum(sizes[:r]), sum(sizes[:r + 1])),)),), 3)
    assert torch.equal(torch.cat(parts, 2), full)
    # sequence parallelism: [batch, seq, hidden] and [batch * seq, hidden] rows
    parts, full = _parts(lambda r: (2, 8 if r is None else 2, 4), lambda r: (("even", 1, 4, r, None),), 4)
    assert torch.equal(torch.cat(parts, 1), full)
    parts, full = _parts(lambda r: (16 if r is None else 4, 4), lambda r: (("even", 0, 4, r, 2),), 4)
    assert torch.equal(torch.cat([q.view(2, 2, 4) for q in parts], 1).reshape(16, 4), full)
    # batch x heads flattened, 8 heads as 3/3/2 over 3 ranks: each rank's heads of every row
    heads = ((0, 3), (3, 6), (6, 8))
    parts, full = _parts(lambda r: (2 * (8 if r is None else heads[r][1] - heads[r][0]), 5, 5),
                         lambda r: (("blocks", 0, 8, (heads[r],)),), 3)
    assert torch.equal(torch.cat([q.view(2, -1, 5, 5) for q in parts], 1).reshape(16, 5, 5), full)
    # context parallelism: rank r holds chunks r and 2cp-1-r (cp=2: 0,3 and 1,2 of 4 chunks of 2 tokens)
    parts, full = _parts(lambda r: (2, 8 if r is None else 4, 3), lambda r: (("chunks", 1, 2, r, None),), 2)
    chunks = full.split(2, dim=1)
    assert torch.equal(parts[0], torch.cat([chunks[0], chunks[3]], 1))
    assert torch.equal(parts[1], torch.cat([chunks[1], chunks[2]], 1))


def test_drop_rate_and_scale_are_those_of_torch():
    torch.manual_seed(0)
    mask = keep_mask((400, 250), 0.3, torch.float32, "cpu")
    assert abs((mask == 0).float().mean().item() - 0.3) < 0.01
    assert torch.allclose(mask[mask != 0], torch.tensor(1 / 0.7))
    x = torch.randn(4, 6, 5)
    torch.manual_seed(1)
    expected = F.dropout(x, 0.3, True)
    torch.manual_seed(1)
    assert torch.equal(logical_dropout(x, 0.3), expected)
    assert logical_dropout(x, 0.3, training=False) is x


def test_attention_dropout_is_torchs_and_splits_by_heads_and_chunks():
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 4, 8, 8) for _ in range(3))
    torch.manual_seed(1)
    expected = F.scaled_dot_product_attention(q, k, v, dropout_p=0.2, is_causal=True)  # math kernel on CPU
    torch.manual_seed(1)
    assert torch.equal(attention_dropout(q, k, v, dropout_p=0.2, is_causal=True), expected)
    assert torch.equal(attention_dropout(q, k, v, dropout_p=0.2, is_causal=True, training=False),
                       F.scaled_dot_product_attention(q, k, v, is_causal=True))
    heads = []
    for rank in range(2):  # tensor parallelism: two heads per rank
        torch.manual_seed(1)
        h = slice(2 * rank, 2 * rank + 2)
        heads.append(attention_dropout(q[:, h], k[:, h], v[:, h], dropout_p=0.2, is_causal=True,
                                       cuts=(("pieces", 1, 4, ((2 * rank, 2 * rank + 2),)),)))
    assert torch.equal(torch.cat(heads, 1), expected)
    for rank in range(2):  # context parallelism: cp=2, rank's query chunks over the gathered keys
        torch.manual_seed(1)
        rows = torch.cat([torch.arange(2 * j, 2 * j + 2) for j in (rank, 3 - rank)])
        out = chunked_attention_dropout(q[:, :, rows], k, v, rank, 2, None, 0.2)
        assert (out - expected[:, :, rows]).abs().max().item() < 1e-6
