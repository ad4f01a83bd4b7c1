"""Capture once for identical decoder layers.

Dynamo traces every decoder layer of a model again (about a second per layer), and the solver
walks every one. A deep model whose layers 1..L-1 are alike is therefore captured with its first
``CAPTURED`` layers only (the others taken out of the layer list for the capture), and the graph
of the last captured layer is repeated for the rest: new nodes reading that layer's own
parameters, each layer fed by the one before, the rest of the graph (final norm, head, loss)
fed by the last. The solver then plans the short graph and walks the long one once with the
placements it found (``api.plan_graph``): identical layers get identical decisions either way.

What must hold, else the model is captured whole as before: the layers (after the first) have
the same module classes, parameter shapes and settings (every plain attribute of every
submodule but its index: sliding windows, layer types, ...); in the short graph the nodes of
each layer follow each other, the last two layers are the same code up to their parameters and
their input from the layer before, and nothing after the layers reads a layer but the last.
Not seen by these checks: code that branches on a layer's index every third layer or later
without an attribute of the layer saying so. ``FXPARALLEL_CAPTURE_LAYERS_ONCE=off`` captures
every model whole.
"""
from __future__ import annotations

import copy
import logging
import os
import re
from typing import Optional

import torch
import torch.fx as fx
from torch import nn

from .static_cache import argument_name
from .graph import CapturedGraph, layer_container, module_path

log = logging.getLogger("fxparallel")

CAPTURED = 3  # layers captured: the first (which may differ), and two to compare
REPEAT_FROM = 5  # models with fewer layers are captured whole (nothing worth saving)
_INDEX_NAMES = frozenset({"layer_idx", "layer_id", "layer_index", "layer_number", "block_idx", "idx"})
_PLAIN = (bool, int, float, str, type(None))


def decoder_layers(model: nn.Module) -> tuple:
    """(dotted path, ModuleList) of the model's decoder layers, or (None, None)."""
    path = layer_container(name for name, _ in model.named_parameters())
    layers = model.get_submodule(path) if path is not None else None
    return (path, layers) if isinstance(layers, nn.ModuleList) else (None, None)


def _settings(value):
    if isinstance(value, _PLAIN):
        return value
    if isinstance(value, (tuple, list)) and all(isinstance(v, _PLAIN) for v in value):
        return tuple(value)
    return type(value).__name__  # an object: at least of the same kind


def signature(layer: nn.Module) -> tuple:
    """What makes two decoder layers the same code: classes, tensor shapes and plain settings."""
    parts = []
    for name, module in layer.named_modules():
        attrs = tuple(sorted((k, _settings(v)) for k, v in vars(module).items()
                             if not k.startswith("_") and k not in _INDEX_NAMES and k != "training"))
        parts.append((name, type(module).__qualname__, attrs))
    tensors = [(n, tuple(t.shape), t.dtype) for n, t in list(layer.named_parameters()) + list(layer.named_buffers())]
    return tuple(parts), tuple(tensors)


def capture_layers_once(model: nn.Module, spec, capture_fn) -> Optional[CapturedGraph]:
    """The graph of ``model`` captured with ``CAPTURED`` decoder layers and repeated to all of them
    (its ``few_layers`` is the short graph), or None where the layers are not alike or the short
    graph does not repeat (then capture the model whole)."""
    path, layers = decoder_layers(model)
    if path is None or len(layers) < REPEAT_FROM or os.environ.get("FXPARALLEL_CAPTURE_LAYERS_ONCE") == "off":
        return None
    first = signature(layers[1])
    if any(signature(layer) != first for layer in layers[2:]):
        return None
    *parents, leaf = path.split(".")
    parent = model.get_submodule(".".join(parents)) if parents else model
    parent._modules[leaf] = nn.ModuleList(list(layers)[:CAPTURED])
    try:
        short = capture_fn(model, spec)
    except Exception:  # noqa: BLE001 - e.g. code that counts layers by the config: capture the model whole
        return None
    finally:
        parent._modules[leaf] = layers
    repeated = repeat_layers(short, path, len(layers))
    if repeated is not None:
        log.info("%s: captured %d of its %d decoder layers, the rest repeat the last", type(model).__name__,
                 CAPTURED, len(layers))
    return repeated


def _layer_index(node, container: str) -> Optional[int]:
    path = module_path(node)
    if path.startswith(container + "."):
        index = path[len(container) + 1:].split(".", 1)[0]
        return int(index) if index.isdigit() else None
    return None


def _renamed(name: str, container: str, src: int, dst: int) -> str:
    return re.sub(rf"(^|\.){re.escape(container)}\.{src}(?=\.|$)", rf"\g<1>{container}.{dst}", name)


def _tensor_renamed(kind: str, name: str, container: str, src: int, dst: int) -> str:
    """A layer's tensor as layer ``dst``'s: a parameter or buffer by its dotted name, a KV cache
    argument (past_<layer>_<field>) by its layer number; other names unchanged."""
    if kind == "inputs":
        found = re.fullmatch(r"past_(\d+)_(\w+)", name)
        return argument_name(dst, found.group(2)) if found and int(found.group(1)) == src else name
    return _renamed(name, container, src, dst)


def _meta_for_layer(meta: dict, container: str, src: int, dst: int) -> dict:
    meta = copy.copy(meta)
    stack = meta.get("nn_module_stack")
    if stack:
        meta["nn_module_stack"] = {f"{key}_{dst}": (_renamed(path, container, src, dst), cls)
                                   for key, (path, cls) in stack.items()}
    return meta


def _blocks(nodes: list, container: str) -> Optional[list]:
    """Per captured layer, its nodes in graph order (glue between two layers goes with the first);
    None where the nodes of a layer do not follow each other."""
    index = [_layer_index(n, container) for n in nodes]
    firsts, lasts = {}, {}
    for i, k in enumerate(index):
        if k is not None:
            firsts.setdefault(k, i)
            lasts[k] = i
    if sorted(firsts) != list(range(CAPTURED)):
        return None
    ends = [firsts[k + 1] for k in range(CAPTURED - 1)] + [lasts[CAPTURED - 1] + 1]
    for k in range(CAPTURED):
        if any(i not in (k, None) for i in index[firsts[k]:ends[k]]):  # another layer's node inside
            return None
    return [nodes[firsts[k]:ends[k]] for k in range(CAPTURED)]


def _size_expression(node):
    value = node.meta.get("example_value") if isinstance(node, fx.Node) else None
    return value.node.expr if isinstance(value, torch.SymInt) else None


def _same(a, b) -> bool:
    """Arguments equal, where a size computed by two nodes counts as one (Dynamo computes a size
    expression once and lets every later layer read that node)."""
    if isinstance(a, fx.Node) or isinstance(b, fx.Node):
        return a is b or (_size_expression(a) is not None and _size_expression(a) == _size_expression(b))
    if isinstance(a, (tuple, list)) and isinstance(b, (tuple, list)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, slice) and isinstance(b, slice):
        return _same((a.start, a.stop, a.step), (b.start, b.stop, b.step))
    return type(a) is type(b) and a == b


def repeat_layers(short: CapturedGraph, container: str, layers: int) -> Optional[CapturedGraph]:
    """``short`` (a graph of the first CAPTURED layers) with its last layer repeated up to ``layers``
    layers, or None where the last two layers are not the same code (see the module docstring)."""
    graph = short.gm.graph
    nodes = [n for n in graph.nodes if n.op not in ("placeholder", "output")]
    blocks = _blocks(nodes, container)
    if blocks is None or len(blocks[-2]) != len(blocks[-1]):
        return None
    two_back, before, last = blocks[-3], blocks[-2], blocks[-1]
    src = CAPTURED - 1
    # the last layer's own tensors (parameters, buffers, its KV cache) and their twins in the layer before
    kinds = {"params": short.params, "buffers": short.buffers, "inputs": short.inputs}
    placeholder = {(kind, names[n.name]): n for n in graph.nodes if n.op == "placeholder"
                   for kind, names in kinds.items() if n.name in names}
    own = {node: (kind, name) for (kind, name), node in placeholder.items()
           if _tensor_renamed(kind, name, container, src, -1) != name}
    twin = {placeholder.get((kind, _tensor_renamed(kind, name, container, src, src - 1))): node
            for node, (kind, name) in own.items()}
    if None in twin:
        return None
    at = {n: i for i, n in enumerate(before)}
    at_two_back = {n: i for i, n in enumerate(two_back)}

    def expected(x):
        """What the last layer reads where the layer before reads ``x``."""
        if x in at:
            return last[at[x]]
        if x in at_two_back and _size_expression(x) is None:  # two layers back: one back (aligned from the end)
            back = len(two_back) - at_two_back[x]
            return before[len(before) - back] if back <= len(before) else None
        return twin.get(x, x)

    def shape(node):
        return str(getattr(node.meta.get("example_value"), "shape", None))

    for a, b in zip(before, last):
        if not (a.op == b.op and a.target == b.target and shape(a) == shape(b)
                and _same(fx.node.map_arg(a.args, expected), b.args)
                and _same(fx.node.map_arg(a.kwargs, expected), b.kwargs)):
            return None
    head = nodes[:nodes.index(last[-1]) + 1]
    earlier = {n for block in blocks[:-1] for n in block}  # the layers before the last
    tail = nodes[len(head):] + [n for n in graph.nodes if n.op == "output"]
    if any(x in earlier and _size_expression(x) is None for n in tail for x in n.all_input_nodes):
        return None  # something after the layers reads a layer but the last (a size is read anywhere)

    new, env = fx.Graph(), {}
    kinds = {kind: dict(names) for kind, names in kinds.items()}
    state, static_sizes = dict(short.state), dict(short.static_sizes)
    for node in graph.nodes:
        if node.op == "placeholder":
            env[node] = new.node_copy(node, env.__getitem__)
    own_of_layer = {}
    for k in range(CAPTURED, layers):
        for node, (kind, name) in own.items():
            copy_ = new.placeholder(f"{node.name}_layer{k}")
            copy_.meta = _meta_for_layer(node.meta, container, src, k)
            renamed = _tensor_renamed(kind, name, container, src, k)
            kinds[kind][copy_.name] = renamed
            if node.name in short.state:  # a cache tensor: an argument of its own, of the same sizes
                state[copy_.name] = renamed
                static_sizes.update({(renamed, dim): size for (arg, dim), size in short.static_sizes.items()
                                     if arg == name})
            own_of_layer[(node, k)] = copy_
    for node in head:
        env[node] = new.node_copy(node, env.__getitem__)
    at_last = {n: i for i, n in enumerate(last)}
    previous = [env[n] for n in last]
    for k in range(CAPTURED, layers):
        current: list = []

        def read(x, k=k, current=current, previous=previous):
            if x in at_last:
                return current[at_last[x]]
            if x in at:  # the layer before
                return previous[at[x]]
            return own_of_layer.get((x, k)) or env[x]

        for node in last:
            copy_ = new.node_copy(node, read)
            copy_.meta = _meta_for_layer(node.meta, container, src, k)
            current.append(copy_)
        previous = current
    for node in tail:
        env[node] = new.node_copy(node, lambda x: previous[at_last[x]] if x in at_last else env[x])
    return CapturedGraph(gm=fx.GraphModule(short.gm, new), params=kinds["params"], buffers=kinds["buffers"],
                         inputs=kinds["inputs"], symbols=dict(short.symbols), outputs=short.outputs,
                         guards=list(short.guards), symbol_sources=dict(short.symbol_sources),
                         static_sizes=static_sizes, state=state, few_layers=short)
