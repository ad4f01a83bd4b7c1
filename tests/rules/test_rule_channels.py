"""Mamba's mixer split by channels: plan/rules/conv.py (depthwise convolution), vmap.py (torch.vmap
traced inline), the pad and aten.slice rules that keep a channel shard, and fused.py finding the
x / gate halves of in_proj through the transpose before the chunk."""
import torch
import torch.nn.functional as F
from rule_graphs import capture, inputs_of, node, strategies

from fxparallel.plan.placement import R, S
from fxparallel.plan.rules.base import LocalOp
from fxparallel.plan.rules.fused import output_segments


def test_depthwise_conv_splits_by_channels():
    gm = capture(lambda x, w, b: F.conv1d(x, w, b, padding=3, groups=8), (2, 8, 5), (8, 1, 4), (8,), params=(1, 2))
    x, w, b = inputs_of(gm)
    found = strategies(node(gm, F.conv1d), {x: S(1)})
    assert found[0].inputs == {x: S(1), w: S(0), b: S(0)} and found[0].output == S(1)
    assert found[0].local == LocalOp.of("local_groups", channels=8)
    assert found[-1].output == R


def test_a_convolution_that_mixes_channels_runs_replicated():
    gm = capture(lambda x, w: F.conv1d(x, w, padding=1), (2, 8, 5), (8, 8, 3), params=(1,))
    x, w = inputs_of(gm)
    assert [s.output for s in strategies(node(gm, F.conv1d), {x: S(1)})] == [R]


def test_vmapped_dims_move_a_shard():
    def fn(x):  # vmap over dim 0 of [4, 3, 8]: the body sees [3, 8]; the result comes back at dim 0
        return torch.vmap(lambda t: t * 2)(x)

    gm = capture(fn, (4, 3, 8))
    (x,) = inputs_of(gm)
    add = node(gm, torch._functorch.predispatch._add_batch_dim)
    assert strategies(add, {x: S(2)})[0].output == S(1)
    assert [s.output for s in strategies(add, {x: S(0)})] == [R]  # the vmapped dim itself stays whole
    remove = node(gm, torch._functorch.predispatch._remove_batch_dim)
    assert strategies(remove, {remove.args[0]: S(1)})[0].output == S(2)


def test_pad_keeps_a_shard_it_does_not_pad():
    gm = capture(lambda x: F.pad(x, (0, 0, 0, 0, 0, 1)), (4, 6, 8))  # pads dim 0 only
    (x,) = inputs_of(gm)
    pad = next(n for n in gm.graph.nodes if n.op == "call_function" and "pad" in str(n.target))
    assert strategies(pad, {x: S(1)})[0].output == S(1)
    assert [s.output for s in strategies(pad, {x: S(0)})] == [R]


def test_fused_halves_found_through_a_transpose():
    def fn(x, w):
        projected = F.linear(x, w).transpose(1, 2)
        hidden, gate = projected.chunk(2, dim=1)
        return hidden * gate

    gm = capture(fn, (2, 5, 16), (64, 16), params=(1,))
    assert output_segments(node(gm, F.linear), 2) == (32, 32)


def _mamba2_mixer_front(x, w, conv_w):
    """Mamba-2: in_proj gives z | xBC | dt; xBC goes through the depthwise convolution over the sequence (cut
    back to the length, activated) and is split into x, B and C."""
    z, xbc, dt = F.linear(x, w).split([16, 32, 4], dim=-1)
    xbc = F.silu(F.conv1d(xbc.transpose(1, 2), conv_w, padding=3, groups=32)[:, :, :5]).transpose(1, 2)
    h, b, c = xbc.split([16, 8, 8], dim=-1)
    return z.sum() + h.sum() + b.sum() + c.sum() + dt.sum()


def test_fused_parts_found_through_a_depthwise_convolution():
    gm = capture(_mamba2_mixer_front, (2, 5, 16), (52, 16), (32, 1, 4), params=(1, 2))
    assert output_segments(node(gm, F.linear), 2, deep=True) == (16, 16, 8, 8, 4)
    assert output_segments(node(gm, F.linear), 2) == (16, 32, 4)  # shallow: the first split only


def test_depthwise_conv_on_segmented_channels_splits_its_weight_alike():
    gm = capture(lambda x, w, b: F.conv1d(x, w, b, padding=3, groups=32), (2, 32, 5), (32, 1, 4), (32,),
                 params=(1, 2))
    x, w, b = inputs_of(gm)
    xbc = S(1, (16, 8, 8))
    segmented = [s for s in strategies(node(gm, F.conv1d), {x: xbc}) if s.inputs[x] == xbc]
    assert segmented[0].inputs == {x: xbc, w: S(0, (16, 8, 8)), b: S(0, (16, 8, 8))} and segmented[0].output == xbc
    assert segmented[0].local == LocalOp.of("local_groups", channels=32, segments=(16, 8, 8))


def test_depthwise_conv_keeps_whole_segments_whole():
    """Mamba-2 with one group of B and C: every rank convolves them whole, with their weight rows whole."""
    gm = capture(lambda x, w: F.conv1d(x, w, padding=3, groups=24), (2, 24, 5), (24, 1, 4), params=(1,))
    x, w = inputs_of(gm)
    xbc = S(1, (16, 4, 4), whole=(1, 2))
    found = [s for s in strategies(node(gm, F.conv1d), {x: xbc}) if s.inputs[x] == xbc]
    assert found[0].inputs == {x: xbc, w: S(0, (16, 4, 4), whole=(1, 2))} and found[0].output == xbc
    assert found[0].local == LocalOp.of("local_groups", channels=24, segments=(16, 4, 4), whole=(1, 2))


def _gated_delta_front(x, w, conv_w, o_q, o_k, o_v):
    """A gated delta net's front as transformers writes it: the conv weight is squeezed before the activation is
    cast for the conv (``causal_conv1d_fn``), and q, k, v are split after it."""
    qkv = F.linear(x, w).transpose(1, 2)
    weight = conv_w.squeeze(1)
    y = F.conv1d(qkv.to(weight.dtype), weight.unsqueeze(1), padding=3, groups=32)[:, :, :5]
    q, k, v = F.silu(y).transpose(1, 2).split([8, 8, 16], dim=-1)
    return F.linear(q, o_q) + F.linear(k, o_k) + F.linear(v, o_v)


def test_a_squeezed_conv_weight_takes_the_segments_of_the_channels_it_convolves():
    """The squeeze reads the weight before the conv sees its input: the weight's split is taken from the
    activation the conv will read, already placed (segment by segment), so the weight is sharded like it and
    its gradient needs no all-reduce (it was replicated, its gradient summed every step)."""
    from rule_graphs import captured_graph

    from fxparallel.plan.layout import ShardLayout
    from fxparallel.plan.solver import depthwise_weights, negligible_matrices, solve

    gm = capture(_gated_delta_front, (2, 5, 16), (32, 16), (32, 1, 4), (16, 8), (16, 8), (16, 16),
                 params=(1, 2, 3, 4, 5))
    names = {1: "in_proj.weight", 2: "conv1d.weight", 3: "o_q.weight", 4: "o_k.weight", 5: "o_v.weight"}
    plan = solve(captured_graph(gm, params=names, inputs={0: "x"}), 2, layout=ShardLayout(2))
    assert plan.params["in_proj.weight"] == S(0, (8, 8, 16)) and plan.params["conv1d.weight"] == S(0, (8, 8, 16))
    assert {plan.params[f"o_{p}.weight"] for p in "qkv"} == {S(1)} and not plan.fallbacks
    conv = node(gm, F.conv1d)
    assert plan.strategies[conv].local == LocalOp.of("local_groups", channels=32, segments=(8, 8, 16))
    assert plan.reasons["conv1d.weight"] == "depthwise convolution weight, split by channels"
    # a few numbers per channel: communication alone decides it, as for a matrix under 1% of its layer
    holders = inputs_of(gm)
    params = {holders[i]: name for i, name in names.items()}
    assert depthwise_weights(params) == {holders[2]}
    assert negligible_matrices(params, depthwise_weights(params)) == {holders[2]}
