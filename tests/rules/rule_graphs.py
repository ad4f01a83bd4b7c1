"""Single-process helpers for rule tests: a small function captured by Dynamo on the meta
device (so every node carries its fake value, as in a model's graph), a rule called on one of
its nodes, and the solver run on the whole graph. No process group is needed."""
from __future__ import annotations

import inspect

import torch
import torch.fx as fx

from fxparallel.capture.graph import CapturedGraph
from fxparallel.plan.layout import ShardLayout
from fxparallel.plan.placement import R
from fxparallel.plan.rules import RuleContext, rule_for


def capture(fn, *shapes, params=()) -> fx.GraphModule:
    """The graph of ``fn(*tensors)`` for meta tensors of ``shapes`` (ints: int64 ids of that shape,
    given as ("ids", shape)); ``params``: indices of the arguments that are parameters."""
    examples = []
    for i, shape in enumerate(shapes):
        if isinstance(shape, tuple) and shape and shape[0] == "ids":
            examples.append(torch.zeros(shape[1], dtype=torch.long, device="meta"))
        else:
            examples.append(torch.empty(shape, device="meta", requires_grad=i in params))
    seen = []

    def backend(gm, example_inputs):
        seen.append(gm)
        return gm.forward

    torch._dynamo.reset()
    torch.compile(fn, backend=backend, fullgraph=True, dynamic=False)(*examples)
    seen[0].meta["argument_names"] = list(inspect.signature(fn).parameters)
    return seen[0]


def node(gm, target) -> fx.Node:
    """The first node calling ``target`` (a function or a method name)."""
    return next(n for n in gm.graph.nodes if n.target == target)


def inputs_of(gm) -> list:
    """The placeholders in the order of ``fn``'s arguments (Dynamo orders them by first use)."""
    holders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    names = gm.meta.get("argument_names")
    if names is None:
        return holders
    position = {f"l_{name}_": i for i, name in enumerate(names)}
    return sorted(holders, key=lambda n: position.get(n.name, len(names)))


def strategies(n: fx.Node, placements: dict, tp: int = 2, layout=None) -> list:
    """The rule's strategies for ``n`` with its inputs placed as given (replicated otherwise)."""
    rule = rule_for(n)
    assert rule is not None, f"no rule for {n.target}"
    placed = {i: placements.get(i, R) for i in n.all_input_nodes}
    return rule(n, placed, RuleContext(tp=tp, tokens=1, layout=layout or ShardLayout(tp)))


def by_name(found: list) -> dict:
    return {s.name: s for s in found if s.name}


def captured_graph(gm, params: dict, inputs: dict) -> CapturedGraph:
    """A CapturedGraph for the solver: ``params`` / ``inputs``: placeholder index -> name."""
    holders = inputs_of(gm)
    return CapturedGraph(gm=gm, params={holders[i].name: name for i, name in params.items()}, buffers={},
                         inputs={holders[i].name: name for i, name in inputs.items()}, symbols={},
                         outputs=("logits",))
