"""capture/custom_forwards.py: a custom autograd function Dynamo captured is replaced by its forward body."""
from __future__ import annotations

import torch

from fxparallel.capture.custom_forwards import inline_custom_forwards


class _ClampedSqrt(torch.autograd.Function):
    """RecurrentGemma's SqrtBoundDerivative in kind: a forward and a backward autograd would not derive."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x.sqrt() + 1.0

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        return grad / (2 * x.clamp(min=0.25).sqrt())


def _captured(fn, *args):
    seen = []

    def backend(gm, example_inputs):
        seen.append(gm)
        return gm.forward

    torch.compile(fn, backend=backend, fullgraph=True)(*args)
    return seen[0]


def test_a_custom_autograd_function_runs_its_forward_body_in_its_place():
    x = torch.rand(3, 4) + 0.1

    def fn(x):
        return _ClampedSqrt.apply(x * 2.0).sum(-1)

    gm = _captured(fn, x.clone().requires_grad_())
    code = gm.code
    assert "autograd_function_apply" in code
    assert inline_custom_forwards(gm) == 1
    assert "autograd_function_apply" not in gm.code and "sqrt" in gm.code
    assert not [name for name, _ in gm.named_children()]  # both bodies dropped
    got = gm(x)
    got = got[0] if isinstance(got, (tuple, list)) else got
    torch.testing.assert_close(got, fn(x), rtol=0, atol=0)


def test_a_graph_without_one_is_left_as_it_is():
    gm = _captured(lambda x: x.relu() * 3, torch.rand(2, 2))
    code = gm.code
    assert inline_custom_forwards(gm) == 0 and gm.code == code
