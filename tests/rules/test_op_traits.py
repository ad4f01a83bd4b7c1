"""plan/op_traits.py, without processes: one canonical name per op whatever its spelling, and the
stages (rules, sequence parallelism, gradient reduction, context-parallel checks) read its traits."""
import operator

import pytest
import torch
import torch.fx as fx
import torch.nn.functional as F

from rule_graphs import capture, node, strategies

from fxparallel.plan import grad_reduction, op_traits
from fxparallel.plan.op_traits import op_name
from fxparallel.plan.placement import P
from fxparallel.plan.rules import base, elementwise, partial, views
from fxparallel.rewrite import context_parallel_checks, sequence_parallel


def _call(target) -> fx.Node:
    g = fx.Graph()
    x = g.placeholder("x")
    if isinstance(target, str):
        return g.call_method(target, (x, x))
    return g.call_function(target, (x, x))


@pytest.mark.parametrize("spelling", [operator.add, operator.iadd, torch.add, "add"])
def test_every_spelling_of_add_is_one_op(spelling):
    assert op_name(_call(spelling)) == "add"


def test_in_place_methods_custom_ops_and_unknown_spellings():
    assert op_name(_call("add_")) == "add_" and "add_" not in op_traits.LINEAR_ADD
    assert op_name(_call(torch.ops.aten.add.Tensor)) == "aten::add"
    assert op_name(_call(torch.logaddexp)) is None
    assert [op_name(_call(s)) for s in (F.softmax, torch.softmax, "softmax")] == ["softmax"] * 3


def test_traits_name_only_ops_of_the_table():
    traits = [v for k, v in vars(op_traits).items() if k.isupper() and isinstance(v, frozenset)]
    assert len(traits) >= 10
    for trait in traits:
        assert trait <= op_traits.SPELLINGS.keys()
    assert op_traits.LINEAR_REDUCTIONS == {"sum", "mean"}
    assert "cumsum" in op_traits.SEQUENCE_MIXING and "cumsum" in op_traits.SHAPE_KEEPING  # one op, two traits


def test_sequence_parallel_and_context_parallel_read_the_table():
    for old in ("ELEMENTWISE", "REDUCTIONS", "NORMS", "VIEWS", "SIZES"):
        assert not hasattr(sequence_parallel, old)
    assert sequence_parallel.op_traits is op_traits
    assert context_parallel_checks.SEQUENCE_MIXING is op_traits.SEQUENCE_MIXING
    assert context_parallel_checks.ACTIVATION_PRODUCTS is op_traits.ACTIVATION_PRODUCTS
    assert context_parallel_checks._op_name(_call(torch.cumsum)) == "cumsum"
    assert context_parallel_checks._op_name(_call(operator.matmul)) == "matmul"
    assert context_parallel_checks._op_name(_call(torch.ops.aten.cumsum.default)) == "cumsum.default"


def test_gradient_reduction_reads_pure_reshapes():
    assert grad_reduction._is_pure_reshape(_call(torch.reshape)) and grad_reduction._is_pure_reshape(_call("view"))
    assert not grad_reduction._is_pure_reshape(_call(torch.add))


def _lookup() -> dict:
    out = {}
    for target in (operator.mul, "mul", operator.add, "add", "view", torch.reshape):
        rule = base.rule_for(_call(target))
        out[target] = (rule.first, rule.strategies, rule.handles_blocks, rule.handles_whole)
    return out


def test_partial_strategies_come_first_whatever_the_registration_order(monkeypatch):
    expected = {
        operator.mul: (partial._scale, elementwise.pointwise_strategies, True, True),
        "mul": (partial._scale, elementwise.pointwise_strategies, True, True),
        operator.add: (partial._add, elementwise.pointwise_strategies, True, True),
        "add": (partial._add, elementwise.pointwise_strategies, True, True),
        "view": (partial._unary, views._reshape, True, True),
        torch.reshape: (partial._unary, views._reshape, True, True),
    }
    assert _lookup() == expected
    rules, first = dict(base._RULES), dict(base._FIRST)

    def replay(partial_first: bool):
        monkeypatch.setattr(base, "_RULES", {})
        monkeypatch.setattr(base, "_FIRST", {})
        steps = [lambda: [base.register_first(n)(fn) for n, fn in first.items()],
                 lambda: [base.register(n, blocks=r.handles_blocks, whole=r.handles_whole)(r.strategies)
                          for n, r in rules.items()]]
        for step in (steps if partial_first else steps[::-1]):
            step()
        return _lookup()

    assert replay(partial_first=True) == replay(partial_first=False) == expected


def test_a_partial_sum_scaled_is_carried_before_the_pointwise_strategies():
    gm = capture(lambda x, w: F.linear(x, w) * 2.0, (3, 5, 16), (16, 16), params=(1,))
    product = node(gm, operator.mul)
    found = strategies(product, {product.args[0]: P})
    assert found[0].name == "partial" and found[0].output == P
    assert all(s.name != "partial" for s in found[1:])


def test_one_rule_per_op_and_only_canonical_names():
    with pytest.raises(ValueError, match="has a rule already"):
        base.register("add")(elementwise.pointwise_strategies)
    with pytest.raises(KeyError, match="canonical name"):
        base.register(torch.add)(elementwise.pointwise_strategies)
    with pytest.raises(KeyError, match="canonical name"):
        base.register("no_such_op")(elementwise.pointwise_strategies)
