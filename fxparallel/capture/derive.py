"""The graph of a call without labels, derived from the training graph's capture.

A call without labels (scoring, evaluation, the first ``model(input_ids)``) runs the training
graph's forward minus the loss. Cutting the loss out of the captured graph (output the logits
only, drop what only the loss read) gives that graph without a second Dynamo capture, which
costs as much as the first (seconds per few decoder layers). The derived graph is then solved
and rewritten like a captured one. Where the cut is not clean (the labels still read, a size
only the labels carry), there is no derived graph and the call captures as before.
"""
from __future__ import annotations

from typing import Optional

import torch.fx as fx

from .graph import CapturedGraph, eliminate_dead_code


def without_labels(captured: CapturedGraph) -> Optional[CapturedGraph]:
    """``captured`` with the loss cut out: outputs ("logits",), no labels argument; None where the
    labels are read by more than the loss."""
    if "labels" not in captured.inputs.values() or captured.state or "logits" not in captured.outputs:
        return None
    graph = fx.Graph()
    copies: dict = {}
    outputs, _ = graph.graph_copy(captured.gm.graph, copies, return_output_node=True)
    graph.output((outputs[captured.outputs.index("logits")],))
    eliminate_dead_code(graph)
    labels = [n for n in graph.nodes if n.op == "placeholder" and captured.inputs.get(n.name) == "labels"]
    if any(n.users for n in labels):
        return None
    from_labels = {name for name, (arg, _) in captured.symbols.items() if arg == "labels"}
    for node in [n for n in graph.nodes if n.op == "placeholder"]:
        if node.name in from_labels and node.users:
            return None  # a size only the labels carry: a capture without them finds its own
        if node in labels or node.name in from_labels:
            graph.erase_node(node)
    sources = {sym: src for sym, src in captured.symbol_sources.items() if src[0] != "labels"}
    for node in graph.nodes:  # a size the labels share with another argument: read it from that one
        if node.op == "placeholder" and node.name in captured.inputs:
            for dim, size in enumerate(node.meta["example_value"].shape):
                expr = getattr(getattr(size, "node", None), "expr", None)
                if expr in captured.symbol_sources:
                    sources.setdefault(expr, (captured.inputs[node.name], dim))
    dropped = set(captured.symbol_sources) - set(sources)
    # guards that name a size of the labels only constrain the labels
    guards = [g for g in captured.guards if not (g.free_symbols & dropped)]
    names = {n.name for n in graph.nodes if n.op == "placeholder"}
    return CapturedGraph(
        gm=fx.GraphModule(captured.gm, graph),
        params={k: v for k, v in captured.params.items() if k in names},
        buffers={k: v for k, v in captured.buffers.items() if k in names},
        inputs={k: v for k, v in captured.inputs.items() if k in names},
        symbols={k: v for k, v in captured.symbols.items() if k in names},
        outputs=("logits",),
        guards=guards,
        symbol_sources=sources,
        static_sizes={k: v for k, v in captured.static_sizes.items() if k[0] != "labels"},
        few_layers=without_labels(captured.few_layers) if captured.few_layers is not None else None,
    )
