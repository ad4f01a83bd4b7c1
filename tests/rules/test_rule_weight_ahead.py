"""A weight cast (and viewed) before it meets its activation: plan/rules/weight_ahead.py, offered by the pointwise
rule (elementwise.py) at the cast."""
import torch
import torch.nn.functional as F
from rule_graphs import capture, captured_graph

from fxparallel.plan.layout import ShardLayout
from fxparallel.plan.placement import R, S
from fxparallel.plan.solver import solve


def _forget_gate(x, f_b, dt_bias, o):
    """Kimi-Linear's forget gate as transformers writes it: the bias cast and viewed after the projection it is
    added to, then used per head."""
    gate = F.linear(x, f_b)
    g = (gate.float() + dt_bias.float().view(1, 1, -1)).view(2, 5, 4, 8)
    return F.linear(F.softplus(g).flatten(2), o)


def _on_the_input(x, dt_bias, o):
    """The same bias added to a replicated activation (the model's input)."""
    return F.linear(x.float() + dt_bias.float().view(1, 1, -1), o)


def _plan(fn, *shapes, names):
    gm = capture(fn, *shapes, params=tuple(range(1, len(shapes))))
    return solve(captured_graph(gm, params=dict(enumerate(names, 1)), inputs={0: "x"}), 2, layout=ShardLayout(2))


def test_a_cast_bias_is_split_like_the_projection_it_is_added_to():
    """The cast reads the bias before the add meets the column-parallel projection's output: the split is found
    there, so the bias is sharded like it (it was replicated, its gradient all-reduced every step)."""
    plan = _plan(_forget_gate, (2, 5, 16), (32, 16), (32,), (16, 32), names=("f_b.weight", "dt_bias", "o.weight"))
    assert plan.params["f_b.weight"] == S(0) and plan.params["o.weight"] == S(1), plan.params
    assert plan.params["dt_bias"] == S(0) and plan.reasons["dt_bias"] == "sharded like the activation it meets"
    assert not plan.fallbacks


def test_a_cast_bias_on_a_replicated_activation_stays_whole():
    plan = _plan(_on_the_input, (2, 5, 32), (32,), (16, 32), names=("dt_bias", "o.weight"))
    assert plan.params["dt_bias"] == R, plan.params
