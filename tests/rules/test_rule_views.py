"""plan/rules/views.py and dim_maps.py: a shard follows its dimension through reshapes and
transposes; spelled-out sizes of the sharded dim are rewritten to local sizes."""
import torch
import torch.nn.functional as F
from rule_graphs import capture, inputs_of, node, strategies

from fxparallel.plan.layout import ShardLayout
from fxparallel.plan.placement import R, S
from fxparallel.plan.rules.base import LocalOp
from fxparallel.plan.rules.dim_maps import index_shard_dim, reshape_shard_dim


def test_head_split_survives_a_view_into_heads():
    gm = capture(lambda x: x.view(3, 5, 4, 8), (3, 5, 32))
    (x,) = inputs_of(gm)
    found = strategies(node(gm, "view"), {x: S(2)})
    assert found[0].output == S(2) and found[0].local == LocalOp.of("local_view_size", dim=2, full=4,
                                                                      segmented=None)
    assert found[-1].output == R


def test_transpose_moves_the_sharded_dim():
    gm = capture(lambda x: x.transpose(1, 2), (3, 5, 4, 8))
    (x,) = inputs_of(gm)
    assert strategies(node(gm, "transpose"), {x: S(2)})[0].output == S(1)


def test_dim_maps():
    assert reshape_shard_dim((3, 5, 32), (3, 5, 4, 8), 2, 2) == 2  # outermost of its group
    assert reshape_shard_dim((3, 5, 4, 8), (3, 5, 32), 3, 2) is None  # inner dim: chunks not contiguous
    # 6 heads of 8 at tp=4 split by whole heads (2/2/1/1): only a split the layout knows is kept
    layout = ShardLayout(4, {6: (2, 2, 1, 1), 48: (16, 16, 8, 8)})
    assert reshape_shard_dim((3, 48), (3, 6, 8), 1, 4, layout.sizes) == 1
    assert index_shard_dim((slice(None), 0), 3, 2) == 1
    assert index_shard_dim((Ellipsis, slice(0, 4)), 3, 2) is None


def test_expand_as_is_sharded_where_its_shape_source_is():
    """XLM: ``mask.view(...).expand_as(scores)`` (a replicated mask broadcast over sharded heads) and
    ``positions.expand_as(embeddings)`` (both sharded alike)."""
    gm = capture(lambda m, s: m.expand_as(s), (2, 1, 5, 5), (2, 8, 5, 5))
    m, s = inputs_of(gm)
    found = strategies(node(gm, "expand_as"), {s: S(1)})
    assert (found[0].inputs, found[0].output) == ({m: R, s: S(1)}, S(1))  # size 1 there: broadcast whole
    assert found[-1].output == R
    gm = capture(lambda p, e: p.expand_as(e), (1, 5, 16), (2, 5, 16))
    p, e = inputs_of(gm)
    found = strategies(node(gm, "expand_as"), {p: S(2)})
    assert (found[0].inputs, found[0].output) == ({p: S(2), e: S(2)}, S(2))


def test_cat_onto_an_empty_cache_ignores_the_empty_tensor():
    """transformers' caches start as ``torch.tensor([])`` and cat the first keys onto it; torch.cat skips a
    1-D empty tensor, so it does not take (or block) the keys' head shard."""
    gm = capture(lambda e, k: torch.cat([e, k], dim=-2), (0,), (2, 8, 5, 4))
    e, k = inputs_of(gm)
    found = strategies(node(gm, torch.cat), {k: S(1)})
    assert (found[0].inputs, found[0].output) == ({e: R, k: S(1)}, S(1))


def test_equal_segments_viewed_as_a_dim_of_their_own():
    """A LoRA B over stacked experts, [out, r x experts] with r segments of one column per expert, viewed as
    [out, r, experts]: each rank's part of every segment is its part of the experts dim (a plain shard, the
    spelled-out size rewritten); uneven where the layout splits the experts so. Unequal segments do not."""
    gm = capture(lambda b: b.reshape(16, -1, 4), (16, 12))
    (b,) = inputs_of(gm)
    found = strategies(node(gm, "reshape"), {b: S(1, (4, 4, 4))})
    assert (found[0].output, found[0].local) == (S(2), LocalOp.of("local_view_size", dim=2, full=4, segmented=None))
    gm = capture(lambda b: b.reshape(16, -1, 6), (16, 18))
    (b,) = inputs_of(gm)
    uneven = ShardLayout(4, {6: (2, 2, 1, 1)})
    assert strategies(node(gm, "reshape"), {b: S(1, (6, 6, 6))}, tp=4, layout=uneven)[0].output == S(2)
    assert [s.output for s in strategies(node(gm, "reshape"), {b: S(1, (6, 6, 6))}, tp=4)] == [R]  # no split
    gm = capture(lambda b: b.reshape(16, 2, 6), (16, 12))
    (b,) = inputs_of(gm)
    assert [s.output for s in strategies(node(gm, "reshape"), {b: S(1, (4, 8))})] == [R]


def test_a_reshape_with_floor_divided_sizes_keeps_trailing_dims():
    """Mamba-2's ``x.reshape(b, -1, chunk, heads, head_dim)`` of a length padded to the chunk: the sizes of the
    leading dims are floor divisions sympy cannot match, the trailing heads and head_dim pair one to one."""
    def fn(x):
        pad = (4 - x.shape[1] % 4) % 4
        x = F.pad(x, (0, 0, 0, 0, 0, pad))
        return x.reshape(x.shape[0], -1, 4, 6, 8)

    reshape = _padded_reshape(fn, (2, 7, 6, 8))
    x = reshape.args[0]
    assert strategies(reshape, {x: S(2)})[0].output == S(3)


def _padded_reshape(fn, shape):
    """The reshape node of ``fn`` captured with dynamic sizes (its padded length a floor division)."""
    torch._dynamo.reset()
    seen = []
    torch.compile(fn, backend=lambda gm, ex: seen.append(gm) or gm.forward, fullgraph=True, dynamic=True)(
        torch.empty(shape, device="meta"))
    return next(n for n in seen[0].graph.nodes if n.target == "reshape")


def test_a_reshape_with_floor_divided_sizes_keeps_equal_leading_dims():
    """A gated delta net's ``x.reshape(b, heads, -1, chunk, head_dim)`` of a length padded to the chunk: the
    batch and heads pair one to one in front, the padded length and its chunks are one group between."""
    def fn(x):
        pad = (4 - x.shape[2] % 4) % 4
        x = F.pad(x, (0, 0, 0, pad))
        return x.reshape(x.shape[0], x.shape[1], -1, 4, x.shape[-1])

    reshape = _padded_reshape(fn, (2, 6, 7, 8))
    x = reshape.args[0]
    assert strategies(reshape, {x: S(1)})[0].output == S(1)
    assert strategies(reshape, {x: S(3)})[0].output == S(4)
    assert [s.output for s in strategies(reshape, {x: S(2)})] == [R]  # the padded length: no


def test_blocked_heads_merged_back_with_their_features():
    """A gated delta net's gated norm runs on ``[b * s * heads, d]`` (heads the sharded inner factor, a blocked
    shard) and its output is viewed as ``[b, s, heads * d]``: the heads are the outer factor of the last dim, a
    plain shard there, its spelled-out size made local. Into the blocked form and back it is the same split;
    a block other than the merged dim's outer factor is not."""
    gm = capture(lambda x: x.reshape(x.shape[0] * x.shape[1] * 4, 8).reshape(x.shape[0], x.shape[1], 32), (2, 3, 4, 8))
    (x,) = inputs_of(gm)
    flat, merged = [n for n in gm.graph.nodes if n.target == "reshape"]
    assert strategies(flat, {x: S(2)})[0].output == S(0, block=4)
    found = strategies(merged, {flat: S(0, block=4)})
    assert (found[0].output, found[0].local) == (S(2), LocalOp.of("local_view_size", dim=2, full=32, segmented=None))
    assert [s.output for s in strategies(merged, {flat: S(0, block=2)})] == [R]
    # and the other way: heads x features split so that the heads join the batch (OLMo-Hybrid's gate)
    gm = capture(lambda g: g.reshape(-1, 8), (2, 3, 32))
    (g,) = inputs_of(gm)
    assert strategies(node(gm, "reshape"), {g: S(2)})[0].output == S(0, block=4)
    gm = capture(lambda g: g.reshape(-1, 6), (2, 3, 36))
    (g,) = inputs_of(gm)
    assert [s.output for s in strategies(node(gm, "reshape"), {g: S(2)}, tp=4)] == [R]  # 6 heads over 4: no
    # numerically: rank r's heads, merged with the batch and back, are its columns of the whole result
    full = torch.randn(2, 3, 4, 8)
    whole = full.reshape(24, 8).reshape(2, 3, 32)
    for rank in range(2):
        local = full[:, :, 2 * rank:2 * rank + 2].reshape(12, 8).reshape(2, 3, 16)
        assert torch.equal(local, whole[..., 16 * rank:16 * rank + 16])


def test_shards_joined_along_their_dim_are_segments():
    """Qwen3-Next's ``cat([q, k, v], -1)`` of head-sharded parts (before its convolution): each rank's parts,
    joined, are its part of every piece, a segmented shard; segments (whole ones too) carry on. Pieces sharded
    on other dims, or one piece sharded and one whole, join only replicated or as before."""
    gm = capture(lambda q, k, v: torch.cat([q, k, v], dim=-1), (2, 5, 8), (2, 5, 8), (2, 5, 16))
    q, k, v = inputs_of(gm)
    found = strategies(node(gm, torch.cat), {q: S(2), k: S(2), v: S(2)})
    assert (found[0].inputs, found[0].output) == ({q: S(2), k: S(2), v: S(2)}, S(2, (8, 8, 16)))
    found = strategies(node(gm, torch.cat), {q: S(2), k: S(2), v: S(2, (8, 8), whole=(1,))})
    assert found[0].output == S(2, (8, 8, 8, 8), whole=(3,))
    assert [s.output for s in strategies(node(gm, torch.cat), {q: S(2), v: S(2)})] == [R]  # k whole
    # numerically: rank r's parts joined are its part of each piece of the whole join
    parts = [torch.randn(2, 5, n) for n in (8, 8, 16)]
    whole = torch.cat(parts, dim=-1)
    for rank in range(2):
        local = torch.cat([p.chunk(2, dim=-1)[rank] for p in parts], dim=-1)
        expected = torch.cat([piece.chunk(2, dim=-1)[rank] for piece in whole.split([8, 8, 16], dim=-1)], dim=-1)
        assert torch.equal(local, expected)
