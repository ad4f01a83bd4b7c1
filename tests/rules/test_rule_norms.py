"""plan/rules/norms.py: layer_norm and rms_norm stay sharded on a dim they do not normalize over,
with their weight and bias replicated; sharded on a normalized dim they run on the whole value."""
import torch
import torch.nn.functional as F
from rule_graphs import capture, inputs_of, node, strategies

from fxparallel.plan.placement import R, S


def test_layer_norm_keeps_a_shard_outside_the_normalized_dims():
    gm = capture(lambda x, w, b: F.layer_norm(x, (16,), w, b), (4, 6, 16), (16,), (16,), params=(1, 2))
    x, w, b = inputs_of(gm)
    found = strategies(node(gm, F.layer_norm), {x: S(1)})
    assert [(s.inputs, s.output) for s in found] == [({x: S(1), w: R, b: R}, S(1)), ({x: R, w: R, b: R}, R)]
    assert [s.output for s in strategies(node(gm, F.layer_norm), {x: S(2)})] == [R]


def test_several_normalized_dims_count():
    gm = capture(lambda x, w: F.layer_norm(x, (6, 16), w), (4, 6, 16), (6, 16), params=(1,))
    x, w = inputs_of(gm)
    assert [s.output for s in strategies(node(gm, F.layer_norm), {x: S(1)})] == [R]
    assert strategies(node(gm, F.layer_norm), {x: S(0)})[0].inputs == {x: S(0), w: R}


def test_rms_norm():
    gm = capture(lambda x, w: F.rms_norm(x, (16,), w), (4, 6, 16), (16,), params=(1,))
    x, w = inputs_of(gm)
    rms = node(gm, torch.rms_norm)
    assert [(s.inputs, s.output) for s in strategies(rms, {x: S(0)})] == [({x: S(0), w: R}, S(0)), ({x: R, w: R}, R)]
    assert [s.output for s in strategies(rms, {x: S(2)})] == [R]
