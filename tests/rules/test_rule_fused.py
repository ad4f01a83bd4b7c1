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


def test_parts_every_head_reads_are_kept_whole():
    """Mamba-2 with one group: B and C (one group's state each) are read by every head: whole on every rank
    where the layout names their width (``ShardLayout.shared_widths``, from the config's groups and state size)."""
    def fn(x, w):
        z, h, b, c, dt = F.linear(x, w).split([16, 16, 8, 8, 4], dim=-1)
        return z.sum() + h.sum() + b.sum() + c.sum() + dt.sum()

    gm = capture(fn, (3, 5, 16), (52, 16), params=(1,))
    assert whole_segments(node(gm, linear), 2, None, lambda s: s % 2 == 0, shared=(8,)) == ((16, 16, 8, 8, 4), (2, 3))
    assert whole_segments(node(gm, linear), 2, None, lambda s: s % 2 == 0) is None


def test_state_group_widths_from_mamba2_configs():
    from transformers import BambaConfig, Mamba2Config

    from fxparallel.plan.layout import state_group_widths
    assert state_group_widths(Mamba2Config(n_groups=1, state_size=16), 2) == (16,)
    assert state_group_widths(Mamba2Config(n_groups=8, state_size=16), 2) == ()  # 8 groups split over 2 ranks
    assert state_group_widths(BambaConfig(mamba_n_groups=1, mamba_d_state=32), 4) == (32,)
