"""GraphSet.fixes_prompt_length: a prompt graph whose guards hold for its own length only (Mamba's scan, Jamba's,
MiniMax's last block) makes later prompts go token by token; one whose guards hold for a range of lengths does not
(a new graph serves the new range)."""
from __future__ import annotations

from types import SimpleNamespace

import sympy

from fxparallel.capture.graph import ShapeGuards
from fxparallel.capture.spec import GraphSpec
from fxparallel.graph_set import GraphSet

ARGUMENTS = ("input_ids", "attention_mask", "position_ids")


def _graph(guards, length: int = 7):
    s, b = sympy.Symbol("s", integer=True), sympy.Symbol("b", integer=True)
    spec = GraphSpec(ARGUMENTS, (2, length), cache_length=128, fresh_cache=True)
    sources = {s: ("input_ids", 1), b: ("input_ids", 0)}
    return SimpleNamespace(spec=spec, guards=ShapeGuards(tuple(g(s) for g in guards), sources, {}))


def _fixes(graph, length: int) -> bool:
    graphs = GraphSet(factory=None)
    graphs.add(graph)
    spec = GraphSpec(ARGUMENTS, (2, length), cache_length=128, fresh_cache=True)
    shapes = {"input_ids": (2, length), "position_ids": (2, length), "attention_mask": (2, 128)}
    return graphs.fixes_prompt_length(spec, shapes)


def test_a_length_guarded_exactly_is_fixed():
    assert _fixes(_graph([lambda s: sympy.Eq(s, 7)]), 10)
    # MiniMax's guards: blocks of 3, the last one of 1 token
    assert _fixes(_graph([lambda s: sympy.Eq((s + 2) // 3, 3), lambda s: sympy.Eq(sympy.Min(9, s) - 6, 1)]), 10)


def test_a_range_of_lengths_is_not_fixed():
    assert not _fixes(_graph([lambda s: s >= 6, lambda s: s <= 9]), 10)  # blocks of 3, whatever the last's size
    assert not _fixes(_graph([lambda s: s >= 2, lambda s: s <= 127]), 10)


def test_a_graph_of_another_batch_or_kind_is_not_asked():
    exact = _graph([lambda s: sympy.Eq(s, 7)])
    exact.spec = GraphSpec(ARGUMENTS, (3, 7), cache_length=128, fresh_cache=True)  # another batch
    assert not _fixes(exact, 10)
    exact.spec = GraphSpec(ARGUMENTS, (2, 7), cache_length=256, fresh_cache=True)  # another cache length
    assert not _fixes(exact, 10)
