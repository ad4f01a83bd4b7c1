"""The ``split_by_layer`` pass: a local graph cut into one piece per decoder layer, so each layer is a
module that is called (``ops/layer_units.py``).

Why: FSDP2 all-gathers a unit's parameters in that module's forward pre-hook and frees
them in its post-hook. The unsplit graph reads every parameter as an attribute of the
root, so only a root unit is possible and the whole model is unsharded at once. Here the
root graph calls ``model.layers.{i}`` (through ``nn.Module.__call__``: hooks run) and that
module runs its layer's piece, reading its parameters from itself.

How: the layer container is found from the parameter names (the dotted prefix followed by
a numeric index that covers the most parameters: ``model.layers`` for Llama,
``transformer.h`` for GPT-2). A node that reads parameters of layer i belongs to layer i;
nodes without parameters between two layers are cut where the fewest values cross (after the
residual add that ends a decoder layer, one tensor: activation checkpointing keeps every tensor
that enters a piece); nodes before the first
layer (embedding, rotary, masks) and after the last (final norm, head, loss) stay in the
root. Pieces are contiguous runs of the original node order, so execution order, and
therefore every result, is that of the unsplit graph; the one exception is computations
on a layer's parameters alone (parameter reads, a ``copy_to_tp`` of a norm weight), which
the rewrite hoists to the top and which run at the start of their layer's piece instead.
Values crossing a boundary become piece arguments and outputs.

A graph that does not split this way (a node reads two layers' parameters, or layers
interleave) stays whole with a warning; the model then has no per-layer units.
"""
from __future__ import annotations

import logging
import operator
import warnings
from typing import Iterable

import torch
import torch.fx as fx

from ..capture.graph import layer_container
from ..ops.layer_units import LayerPieces, layer_of, new_piece_key

log = logging.getLogger("fxparallel")


class SplitError(Exception):
    """The graph cannot be cut into per-layer pieces."""


# ---- partition -------------------------------------------------------------------------
def _global_states(graph: fx.Graph) -> dict:
    """Grad mode and autocast state each node runs under. Dynamo records a grad-mode switch only
    where the mode changes, so before the first switch the mode is the opposite of it."""
    enter = getattr(torch.amp.autocast_mode, "_enter_autocast", None)
    leave = getattr(torch.amp.autocast_mode, "_exit_autocast", None)
    switches = [n for n in graph.nodes if n.op == "call_function" and n.target is torch._C._set_grad_enabled]
    grad = (not bool(switches[0].args[0])) if switches else None
    autocast, states = (), {}
    for node in graph.nodes:
        states[node] = (grad, autocast)
        if node.op != "call_function":
            continue
        if node.target is torch._C._set_grad_enabled:
            grad = bool(node.args[0])
        elif enter is not None and node.target is enter:
            autocast = autocast + (node,)
        elif leave is not None and node.target is leave:
            autocast = autocast[:-1]
    return states


def _parameter_nodes(graph: fx.Graph, container: str) -> dict:
    """Layer of each node computed from one layer's parameters alone: the parameter reads and,
    e.g., the ``copy_to_tp`` the rewrite puts right after the inputs for a q/k norm weight. They run
    at the start of their layer's piece (the parameters exist only there)."""
    derived = {}
    for node in graph.nodes:
        if node.op == "get_attr":
            layer = layer_of(str(node.target), container)
            if layer:
                derived[node] = layer
        elif node.op.startswith("call") and node.all_input_nodes:
            layers = {derived.get(a) for a in node.all_input_nodes}
            if len(layers) == 1 and None not in layers:
                derived[node] = layers.pop()
    return derived


def _assign(graph: fx.Graph, container: str) -> tuple:
    """Piece (layer path or None = root) of every node, the layer paths in execution order, and the
    first node each layer's piece runs in the original order."""
    derived = _parameter_nodes(graph, container)
    body = [n for n in graph.nodes if n.op not in ("placeholder", "get_attr", "output") and n not in derived]
    first, last = {}, {}
    for i, node in enumerate(body):
        layers = {derived[a] for a in node.all_input_nodes if a in derived}
        if len(layers) > 1:
            raise SplitError(f"node {node.name} reads parameters of {sorted(layers)}")
        if layers:
            layer = layers.pop()
            first.setdefault(layer, i)
            last[layer] = i
    order = sorted(first, key=first.get)
    for a, b in zip(order, order[1:]):
        if first[b] <= last[a]:
            raise SplitError(f"{a} and {b} interleave in the graph")
    piece = dict(derived)
    begins = {}
    position = {node: i for i, node in enumerate(body)}
    starts = [first[order[0]]] if order else []
    for a, b in zip(order, order[1:]):
        starts.append(_cut(body, position, starts[-1], last[a] + 1, first[b]))
    ends = starts[1:] + ([last[order[-1]] + 1] if order else [])
    for layer, start, end in zip(order, starts, ends):
        begins[layer] = body[start]
        for node in body[start:end]:
            piece[node] = layer
    for node in body:
        piece.setdefault(node, None)
    for node, owner in derived.items():  # a layer's parameters are read only inside its piece
        if any(piece.get(u) != owner for u in node.users):
            raise SplitError(f"{node.name} (from the parameters of {owner}) is used outside {owner}")
    _check_moves(graph, derived, begins)
    return piece, order, begins


def _cut(body: list, position: dict, begin: int, low: int, high: int) -> int:
    """Where the next layer's piece starts, in ``[low, high]``: where the fewest values of the piece
    that begins at ``begin`` are used later, i.e. the fewest tensors cross the boundary (the latest
    such place). After a decoder layer's residual add one tensor crosses; in the middle of the next
    layer's norm (parameter-free nodes before its weight is read) two do, and activation
    checkpointing keeps every tensor that enters a piece."""
    def crossing(cut: int) -> int:
        return sum(1 for node in body[begin:cut]
                   if any(position.get(user, len(body)) >= cut for user in node.users))
    return min(range(low, high + 1), key=lambda cut: (crossing(cut), -cut))


def _check_moves(graph: fx.Graph, derived: dict, begins: dict) -> None:
    """Parameter computations move from their place to the start of their piece: refuse if they
    would run under another grad mode or autocast state there."""
    states = _global_states(graph)
    for node, layer in derived.items():
        if node.op != "get_attr" and layer in begins and states[node] != states[begins[layer]]:
            raise SplitError(f"{node.name} would move into another grad-mode/autocast state")


def split_by_layer(graph: fx.Graph, container: str) -> tuple:
    """Returns (root graph, {layer path: piece graph}, key); raises SplitError."""
    piece, order, begins = _assign(graph, container)
    if not order:
        raise SplitError("no node reads a layer's parameters")
    key = new_piece_key()
    members = {layer: [n for n in graph.nodes if piece.get(n) == layer] for layer in order}
    starts = {node: layer for layer, node in begins.items()}
    root = fx.Graph()
    env = {}
    pieces = {}
    # inputs and root attributes first (the graph's own attributes, e.g. autograd bodies, can sit
    # inside a layer's range and feed it)
    for node in graph.nodes:
        if node.op in ("placeholder", "get_attr") and piece.get(node) is None:
            env[node] = root.node_copy(node, lambda n: env[n])
    for node in graph.nodes:
        if node in env or node.op in ("placeholder", "get_attr"):
            continue
        if node in starts:
            owner = starts[node]
            inside = set(members[owner])
            inputs = []
            for n in members[owner]:
                for a in n.all_input_nodes:
                    if a not in inside and a not in inputs:
                        inputs.append(a)
            outputs = [n for n in members[owner] if any(u not in inside for u in n.users)]
            pieces[owner] = _piece_graph(members[owner], inputs, outputs, owner)
            call = root.call_module(owner, (key, *(env[a] for a in inputs)))
            for i, out in enumerate(outputs):
                env[out] = root.call_function(operator.getitem, (call, i))
                env[out].meta = dict(out.meta)
        if piece.get(node) is None:
            env[node] = root.node_copy(node, lambda n: env[n])
    root.lint()
    return root, pieces, key


def _piece_graph(nodes: list, inputs: list, outputs: list, owner: str) -> fx.Graph:
    g = fx.Graph()
    env = {}
    for a in inputs:
        env[a] = g.placeholder(a.name)
        env[a].meta = dict(a.meta)
    for n in nodes:
        copy = g.node_copy(n, lambda x: env[x])
        if n.op == "get_attr":
            copy.target = str(n.target)[len(owner) + 1:]  # read from the layer module itself
        env[n] = copy
    g.output(tuple(env[o] for o in outputs))
    g.lint()
    return g


def generate_layered_forward(graph: fx.Graph, param_names: Iterable[str]):
    """(root forward, code, LayerPieces or None). Falls back to the whole graph (pieces None),
    with a warning, when the graph does not split by layer."""
    from .bind import generate_forward

    container = layer_container(param_names)
    if container is None:
        forward, code = generate_forward(graph)
        return forward, code, None
    try:
        root, pieces, key = split_by_layer(graph, container)
    except SplitError as err:
        log.warning("graph kept whole (no per-layer FSDP units): %s", err)
        forward, code = generate_forward(graph)
        return forward, code, None
    forward, code = generate_forward(root)
    fns, codes = {}, {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for path, piece in pieces.items():
            fns[path], codes[path] = generate_forward(piece)
    pieces = LayerPieces(key, fns, codes, root=code)
    return forward, pieces.full_code(), pieces
