"""Custom autograd functions (``torch.autograd.Function`` in model code, e.g. Bloom's GeLU).

Dynamo captures them as ``autograd_function_apply(fwd_body, bwd_body, *args)`` with
the forward and backward as subgraphs. If both bodies are pointwise (only ops the
pointwise rule knows, scalars and the function's own inputs, no constants of
their own) and every tensor input has the output's shape, the function is
pointwise as a whole: it runs on shards like any other pointwise op. Anything else
keeps the replicated fallback.
"""
from __future__ import annotations

import torch
import torch.fx as fx

from ..op_traits import POINTWISE, op_name
from ..placement import R
from .base import Strategy, register, tensor_inputs


def is_pointwise_body(body) -> bool:
    for n in body.graph.nodes:
        if n.op in ("placeholder", "output"):
            continue
        if op_name(n) in POINTWISE or (n.op == "call_function" and n.target is torch._C._set_grad_enabled):
            continue
        return False
    return True


def _bodies(node: fx.Node) -> list:
    owner = node.graph.owning_module
    found = []
    for a in node.args[:2]:
        if not (isinstance(a, fx.Node) and a.op == "get_attr" and owner is not None and hasattr(owner, a.target)):
            return []
        found.append(getattr(owner, a.target))
    return found


def _autograd_function(node, placements, ctx):
    value = node.meta.get("example_value")
    outs = value if isinstance(value, (tuple, list)) else (value,)
    if len(outs) != 1 or not isinstance(outs[0], torch.Tensor):
        return []
    out = outs[0]
    bodies = _bodies(node)
    inputs = [x for x in tensor_inputs(node) if x.op != "get_attr"]
    if len(bodies) != 2 or not all(is_pointwise_body(b) for b in bodies) or not inputs:
        return []
    if any(tuple(ctx.fake(x).shape) != tuple(out.shape) for x in inputs):
        return []
    wrap = (lambda p: (p,)) if isinstance(value, (tuple, list)) else (lambda p: p)
    strategies = []
    shards = {placements[x] for x in inputs if placements[x].is_shard}
    for p in sorted(shards):
        strategies.append(Strategy({x: p for x in inputs}, wrap(p), note="pointwise custom autograd function"))
    strategies.append(Strategy({x: R for x in inputs}, wrap(R)))
    return strategies


register("autograd_function_apply")(_autograd_function)
