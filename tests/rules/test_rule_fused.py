"""plan/rules/fused.py: a matmul whose output features are later split (``split`` / ``chunk``, slices of
the last dim, a view into heads sliced by head) is a fused projection with those segments, found through
ops that keep the features; a part of fewer heads than ranks is held whole (``whole_segments``)."""
import torch
import torch.nn.functional as F
from rule_graphs import by_name, capture, node, strategies

from fxparallel.plan.placement import S
from fxparallel.plan.rules.fused import output_segments, whole_segments

linear = torch._C._nn.linear


def _qkv_split(x, w):
    q, k, v = F.linear(x, w).split([32, 8, 8], dim=-1)
    return q.sum() + k.sum() + v.sum()


def _qkv_sliced(x, w):  # Phi-3: slices of the last dim, after a cast
    h = F.linear(x, w).to(torch.float32)
    return h[..., :32].sum() + h[..., 32:40].sum() + h[..., 40:].sum()


def _qkv_heads(x, w):  # Falcon: a view into heads, sliced by head
    h = F.linear(x, w).view(3, 5, 6, 8)
    return h[..., :4, :].sum() + h[..., 4:5, :].sum() + h[..., 5:, :].sum()


def test_segments_of_a_split_slices_or_heads():
    for fn in (_qkv_split, _qkv_sliced, _qkv_heads):
        gm = capture(fn, (3, 5, 16), (48, 16), params=(1,))
        assert output_segments(node(gm, linear), 2) == (32, 8, 8)
        assert output_segments(node(gm, linear), 16) is None  # 8 does not split over 16 ranks


def test_the_linear_rule_shards_a_fused_weight_by_segments():
    gm = capture(_qkv_split, (3, 5, 16), (48, 16), params=(1,))
    column = by_name(strategies(node(gm, linear), {}))["column"]
    assert column.output == S(2, (32, 8, 8))


def test_a_matmul_not_split_later_has_no_segments():
    gm = capture(lambda x, w: F.linear(x, w).sum(-1), (3, 5, 16), (48, 16), params=(1,))
    assert output_segments(node(gm, linear), 2) is None
    gm = capture(lambda x, w: F.linear(x, w).exp().chunk(2, -1)[0], (3, 5, 16), (48, 16), params=(1,))
    assert output_segments(node(gm, linear), 2) is None  # exp is not known to keep the features


def test_parts_of_fewer_heads_than_ranks_are_held_whole():
    gm = capture(_qkv_split, (3, 5, 16), (48, 16), params=(1,))
    n = node(gm, linear)
    assert whole_segments(n, 2, 8, lambda s: s % 2 == 0) == ((32, 8, 8), (1, 2))  # one kv head each, tp=2
    assert whole_segments(n, 4, 4, lambda s: s % 4 == 0) == ((32, 8, 8), (1, 2))  # two kv heads, tp=4
    assert whole_segments(n, 2, 4, lambda s: s % 2 == 0) is None  # two kv heads split over two ranks
    assert whole_segments(n, 2, None, lambda s: True) is None  # no head size known
