"""plan/rules/custom_autograd.py: a ``torch.autograd.Function`` whose forward and backward bodies are
pointwise and whose tensor inputs have the output's shape runs on shards like a pointwise op (Bloom's
GeLU); one with a product in a body, or an input of another shape, gets no strategy (the replicated fallback)."""
import torch
from rule_graphs import capture, inputs_of, node, strategies

from fxparallel.plan.placement import R, S
from fxparallel.plan.rules.custom_autograd import is_pointwise_body

apply = torch.ops.higher_order.autograd_function_apply


class TanhGelu(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x * 0.5 * (1.0 + torch.tanh(0.79788456 * x * (1 + 0.044715 * x * x)))

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        return g * 0.5 * (1 + torch.tanh(0.79788456 * x * (1 + 0.044715 * x * x)))


class Scale(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, s):
        return x * s

    @staticmethod
    def backward(ctx, g):
        return g, None


class MatMul(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w):
        ctx.save_for_backward(x, w)
        return x @ w

    @staticmethod
    def backward(ctx, g):
        x, w = ctx.saved_tensors
        return g @ w.t(), x.t() @ g


def test_a_pointwise_function_runs_on_shards():
    gm = capture(lambda x: TanhGelu.apply(x), (3, 6, 16), params=(0,))
    (x,) = inputs_of(gm)
    found = strategies(node(gm, apply), {x: S(2)})
    assert [(s.inputs, s.output) for s in found] == [({x: S(2)}, (S(2),)), ({x: R}, (R,))]
    assert found[0].note == "pointwise custom autograd function"
    assert all(is_pointwise_body(getattr(gm, a.target)) for a in node(gm, apply).args[:2])


def test_every_input_takes_each_shard_offered():
    gm = capture(lambda x, s: Scale.apply(x, s), (4, 6, 16), (4, 6, 16), params=(0, 1))
    x, s = inputs_of(gm)
    found = strategies(node(gm, apply), {x: S(2), s: S(0)})
    assert [(f.inputs, f.output) for f in found] == [
        ({x: S(0), s: S(0)}, (S(0),)), ({x: S(2), s: S(2)}, (S(2),)), ({x: R, s: R}, (R,))]


def test_a_product_or_a_broadcast_input_is_refused():
    gm = capture(lambda x, w: MatMul.apply(x, w), (16, 16), (16, 16), params=(0, 1))  # shapes alike: the body refuses
    x, w = inputs_of(gm)
    assert strategies(node(gm, apply), {x: S(0)}) == []
    assert not is_pointwise_body(getattr(gm, node(gm, apply).args[0].target))
    gm = capture(lambda x, s: Scale.apply(x, s), (3, 6, 16), (16,), params=(0, 1))  # s broadcasts
    x, s = inputs_of(gm)
    assert strategies(node(gm, apply), {x: S(2)}) == []
