"""Every op the traits table (plan/op_traits.py) knows has a sharding rule, found the way the solver finds it
(``rules.rule_for`` on a node, through each of the op's spellings), or sits on the explicit fallback list
below: ops the solver runs on replicated inputs (or, for shape queries, reads only the shape of). As DTensor's
OpInfo sweep keeps its xfail list, the list is checked both ways: an op on it that gains a rule must leave it.
Also: every module of plan/rules (a rule family) has a rule-level test in this folder."""
import os
import pkgutil
import re

import pytest
import torch.fx as fx

from fxparallel.plan import op_traits
from fxparallel.plan import rules as rules_package
from fxparallel.plan.rules import elementwise, norms, partial, reductions, rule_for

# canonical name -> why it has no rule (the solver gathers its inputs, plan.fallbacks names it where one was sharded)
FALLBACK = {
    "size": "returns no tensor: the solver's shape-query path reads only the shape (solver._non_tensor)",
    "dim": "returns no tensor: a shape query (solver._non_tensor)",
    "ndimension": "returns no tensor: a shape query (solver._non_tensor)",
    "get_device": "returns no tensor: a shape query (solver._non_tensor)",
    "mm": "no rule yet: models reach it through F.linear / matmul, which have one; runs on gathered inputs",
    "roll": "sequence mixing (op_traits.SEQUENCE_MIXING), no rule: runs on gathered inputs",
    "flip": "sequence mixing, no rule: runs on gathered inputs",
    "diff": "sequence mixing, no rule: runs on gathered inputs",
    "cummax": "sequence mixing, no rule: runs on gathered inputs",
    "cummin": "sequence mixing, no rule: runs on gathered inputs",
    "logcumsumexp": "sequence mixing, no rule: runs on gathered inputs",
}

# rule family (module of plan/rules) -> its rule-level test(s) in tests/rules
FAMILY_TESTS = {
    "attention": ["test_rule_attention.py", "test_rule_dropout.py"],
    "base": ["test_op_traits.py", "test_rule_sweep.py"],
    "cache_writes": ["test_rule_cache_writes.py"],
    "conv": ["test_rule_channels.py"],
    "custom_autograd": ["test_rule_custom_autograd.py"],
    "dim_maps": ["test_rule_views.py"],
    "dropout": ["test_rule_dropout.py"],
    "einsum": ["test_rule_einsum.py"],
    "elementwise": ["test_rule_elementwise.py"],
    "embedding": ["test_rule_embedding_and_loss.py"],
    "experts": ["test_rule_experts.py"],
    "expert_rows": ["test_rule_expert_rows.py"],
    "fused": ["test_rule_fused.py", "test_rule_channels.py"],
    "indexing": ["test_rule_indexing.py", "test_rule_writes.py"],
    "linear": ["test_rule_linear.py"],
    "loss": ["test_rule_embedding_and_loss.py"],
    "multi_output": ["test_rule_multi_output.py"],
    "new_tensors": ["test_rule_new_tensors.py"],
    "norms": ["test_rule_norms.py"],
    "partial": ["test_rule_partial.py", "test_op_traits.py"],
    "reductions": ["test_rule_reductions.py"],
    "repeats": ["test_rule_repeats.py"],
    "triangular_solve": ["test_rule_triangular_solve.py"],
    "views": ["test_rule_views.py"],
    "vmap": ["test_rule_channels.py"],
    "weight_ahead": ["test_rule_weight_ahead.py"],
}


def _spelled(spelling) -> fx.Node:
    """A node calling ``spelling`` (a call_method name or a call_function target) on one placeholder."""
    graph = fx.Graph()
    x = graph.placeholder("x")
    if isinstance(spelling, str):
        return graph.call_method(spelling, (x,))
    return graph.call_function(spelling, (x,))


def _spellings(name) -> list:
    return [s for s in op_traits.SPELLINGS[name] if s is not None]  # None: not in this torch


@pytest.mark.parametrize("name", sorted(op_traits.SPELLINGS))
def test_every_op_of_the_table_has_a_rule_or_a_listed_fallback(name):
    spellings = _spellings(name)
    assert spellings, f"{name}: no spelling in this torch"
    for spelling in spellings:
        assert op_traits.op_name(_spelled(spelling)) == name
    found = [rule_for(_spelled(s)) for s in spellings]
    if name in FALLBACK:
        assert found == [None] * len(found), f"{name} has a rule now: take it off FALLBACK"
    else:
        assert found[0] is not None, f"{name} has no rule: register one, or put it on FALLBACK with a reason"
        assert all(rule == found[0] for rule in found), f"{name}: its spellings reach different rules"


def test_the_fallback_list_names_only_ops_of_the_table_with_a_reason():
    assert set(FALLBACK) <= set(op_traits.SPELLINGS)
    assert all(reason.strip() for reason in FALLBACK.values())
    assert op_traits.SHAPE_QUERIES <= set(FALLBACK)


def test_traits_reach_the_rules_that_rely_on_them():
    for name in op_traits.POINTWISE:
        assert rule_for(_spelled(_spellings(name)[0])).strategies is elementwise.pointwise_strategies, name
    for name in op_traits.REDUCTIONS:
        assert rule_for(_spelled(_spellings(name)[0])).strategies is reductions._reduce, name
    for name in op_traits.NORMALIZED_SHAPE_ARG:
        assert rule_for(_spelled(_spellings(name)[0])).strategies is norms._norm, name
    for names, first in ((op_traits.LINEAR_UNARY, partial._unary), (op_traits.LINEAR_SCALE, partial._scale),
                         (op_traits.LINEAR_ADD, partial._add)):
        for name in names:
            assert rule_for(_spelled(_spellings(name)[0])).first is first, name


def test_every_rule_family_has_a_rule_level_test():
    families = {m.name for m in pkgutil.iter_modules(rules_package.__path__)}
    assert families == set(FAMILY_TESTS)
    here = os.path.dirname(__file__)
    for family, files in FAMILY_TESTS.items():
        for file in files:
            with open(os.path.join(here, file)) as f:
                assert re.search(rf"\b{family}\b", f.read()), f"{file} does not name {family}"
