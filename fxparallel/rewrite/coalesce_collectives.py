"""Pass: a LoRA adapter's collectives join its base layer's, so adapters add bytes, not calls.

A column-parallel layer's input gets a ``copy_to_tp`` (its gradient all-reduced); the adapter's ``A x`` beside
it (A whole, B split like the base: ``plan/adapter_placements.py``) gets another, r floats per token; q, k
and v adapters add three. A row-parallel layer's partial output is all-reduced, and so is its adapter's
partial ``A x``. Each of these is a call that waits for every rank, which on a busy machine costs far more than
its bytes. Here the collectives of one kind whose values come from the same input (the base's own, and
``linear(input, A)`` or ``linear(dropout(input), A)`` of each adapter) become one ``copy_to_tp_many`` /
``all_reduce_many``: one call on their concatenation, the same sums. A layer trained with LoRA then
communicates as often as without it. With sequence parallelism the same holds for the gathers of a column
layer's input (``gather_seq_to_tp``: the input and each adapter's ``A x``, on this rank's tokens) and the
reduce-scatters of a row layer's partial output and its adapter's partial ``A x`` (``reduce_scatter_seq``).
The once-per-step gradient all-reduces of a layer's replicated parameters (its adapters' A and B where they act
on sharded values, its norm weights under sequence parallelism) join likewise, per layer.

PEFT runs each adapter after its base layer, so an adapter's ``A x`` (and its dropout) is often computed after
the base layer's first consumer: it moves up to before it, as it reads only the input and A. Dropouts draw
their masks in graph order (``ops/dropout_kernels.py``), so a dropout moves only where no other random draw
lies between the two places: the draws keep their order, and the masks stay those of one device."""
from __future__ import annotations

import operator

import torch
import torch.fx as fx

from ..capture.adapters import is_adapter_parameter
from ..capture.graph import layer_container, writes_data
from ..ops.layer_units import layer_of
from ..ops import collectives
from .fx_nodes import same_size

_LINEAR = (torch._C._nn.linear, torch.nn.functional.linear)
_MANY = {collectives.all_reduce: collectives.all_reduce_many, collectives.copy_to_tp: collectives.copy_to_tp_many,
         collectives.reduce_scatter_seq: collectives.reduce_scatter_seq_many,
         collectives.gather_seq_to_tp: collectives.gather_seq_to_tp_many}
_INPUT_COPIES = (collectives.copy_to_tp, collectives.gather_seq_to_tp)  # of a layer's input, not of its output
_ALONG_TOKENS = (collectives.reduce_scatter_seq, collectives.gather_seq_to_tp)  # (x, token dim, handle, batch)


def coalesce_adapter_collectives(graph: fx.Graph, params: dict) -> int:
    """Join the collectives described above in ``graph`` (``params``: placeholder name -> parameter name).
    Returns the number of collectives removed."""
    groups: dict = {}
    for node in graph.nodes:
        if node.op == "call_function" and node.target in _MANY and not node.kwargs:
            root, adapted = _root(node, params)
            if root is not None:
                groups.setdefault((node.target, tuple(node.args[1:]), root, _dtype(node)), []).append((node, adapted))
    removed, order = 0, {n: float(i) for i, n in enumerate(graph.nodes)}
    draws = [n for n in graph.nodes if _draws_random(n)]
    for (target, args, _, _), members in groups.items():
        bases = [n for n, adapted in members if not adapted]
        adapters = [n for n, adapted in members if adapted]
        if adapters and len(bases) <= 1 and len(members) > 1:
            # (two base collectives of one value are copies split by in-place writes: gradient_reductions)
            removed += _join(graph, target, args, bases, adapters, order, draws)
    return removed + _join_parameter_reductions(graph, params, order, draws)


def _join_parameter_reductions(graph: fx.Graph, params: dict, order: dict, draws: list) -> int:
    """The gradient all-reduces of one decoder layer's parameters (``copy_to_tp`` of a parameter: a replicated
    one used on sharded values, such as its norm weights and, under sequence parallelism, its adapters' A and B
    used on this rank's tokens) as one ``copy_to_tp_many``, where an adapter's matrix is among them. Within a
    layer only: the layer's piece keeps reading its own parameters alone (``split_by_layer.py``)."""
    container, groups = layer_container(params.values()), {}
    for node in graph.nodes:
        if node.op == "call_function" and node.target is collectives.copy_to_tp and len(node.args) == 2:
            value = node.args[0]
            name = params.get(value.name, "") if isinstance(value, fx.Node) and value.op == "placeholder" else ""
            layer = layer_of(name, container)
            if layer is not None and not node.kwargs:
                groups.setdefault((layer, node.args[1], _dtype(node)), []).append((node, is_adapter_parameter(name)))
    removed = 0
    for (_, handle, _), members in groups.items():
        adapters = [n for n, adapted in members if adapted]
        if adapters and len(members) > 1:
            removed += _join(graph, collectives.copy_to_tp, (handle,), [n for n, adapted in members if not adapted],
                             adapters, order, draws)
    return removed


def _dtype(node: fx.Node):
    """A collective's dtype: one call carries one (fp32 adapters beside a bf16 base join among themselves)."""
    return getattr(node.meta.get("example_value"), "dtype", None)


def _root(node: fx.Node, params: dict):
    """(the input the collective's value comes from, whether it is an adapter's ``A x``), or (None, False)."""
    value = node.args[0]
    if not isinstance(value, fx.Node):
        return None, False
    if value.op == "call_function" and value.target in _LINEAR and len(value.args) >= 2:
        source, weight = value.args[0], value.args[1]
        if isinstance(weight, fx.Node) and weight.target is collectives.copy_to_tp:
            weight = weight.args[0]  # its gradient all-reduced: used on sequence shards (rewrite/sequence_parallel.py)
        adapted = isinstance(weight, fx.Node) and is_adapter_parameter(params.get(weight.name, ""))
        if adapted and isinstance(source, fx.Node) and _draws_random(source) and source.args:
            source = source.args[0]  # the adapter's dropout of the input
        return source, adapted
    return (value, False) if node.target in _INPUT_COPIES else (None, False)


def _join(graph: fx.Graph, target, args: tuple, bases: list, adapters: list, order: dict, draws: list) -> int:
    """Replace the collectives ``bases`` + ``adapters`` (of ``target``, each with the arguments ``args`` after
    its value) by one call of its many-tensor form,
    before the first op that reads any of them. Returns how many collectives that removes (0 where it cannot
    be done). ``order`` (node -> position, kept up to date here) and ``draws`` (the random draws) are the
    graph's, computed once for all groups."""
    members = bases + adapters
    values = [m.meta.get("example_value") for m in members]
    if not all(isinstance(v, torch.Tensor) for v in values) or len({(v.dtype, v.device) for v in values}) > 1:
        return 0
    if target in _ALONG_TOKENS and not all(len(v.shape) > args[0] + 1 and all(
            same_size(a, b) for a, b in zip(v.shape[:args[0] + 1], values[0].shape)) for v in values):
        return 0  # joined along the features after the token dim: the sizes up to it must agree
    if any(writes_data(u) for m in members for u in m.users):
        return 0  # an autograd Function's outputs may not be written in place
    first = min((u for m in members for u in m.users), key=order.__getitem__, default=None)
    if first is None:
        return 0
    moves = {m: _moves(m.args[0], first, order) for m in members}
    kept = [m for m in members if moves[m] is not None]
    moved = sorted({n for m in kept for n in moves[m]}, key=order.__getitem__)
    if not _draws_keep_order(draws, moved, first, order):
        kept = [m for m in kept if not any(_draws_random(n) for n in moves[m])]
        moved = sorted({n for m in kept for n in moves[m]}, key=order.__getitem__)
    if len(kept) < 2 or not set(kept) & set(adapters):
        return 0
    placed = list(moved)
    for node in moved:
        first.prepend(node)
    with graph.inserting_before(first):
        joined = graph.call_function(_MANY[target], (tuple(m.args[0] for m in kept), *args))
        joined.meta["example_value"] = tuple(m.meta["example_value"] for m in kept)
        placed.append(joined)
        for i, m in enumerate(kept):
            piece = graph.call_function(operator.getitem, (joined, i))
            piece.meta["example_value"] = m.meta["example_value"]
            placed.append(piece)
            m.replace_all_uses_with(piece)
    for m in kept:
        graph.erase_node(m)
    _renumber(order, placed, first)
    return len(kept) - 1


def _renumber(order: dict, placed: list, first: fx.Node) -> None:
    """Give the nodes ``placed`` just before ``first`` positions between its predecessor's and its own."""
    low, high = order.get(placed[0].prev, order[first] - 1.0), order[first]
    for i, node in enumerate(placed, 1):
        order[node] = low + (high - low) * i / (len(placed) + 1)


def _moves(value: fx.Node, first: fx.Node, order: dict):
    """The nodes to move before ``first`` so that ``value`` is computed there (none where it already is):
    a linear of inputs computed before it, or of an adapter's dropout of one; None where that cannot be."""
    if order[value] < order[first]:
        return []
    if value.op != "call_function" or value.target not in _LINEAR:
        return None
    moves = []
    for source in value.all_input_nodes:
        if order[source] < order[first]:
            continue
        if not (_draws_random(source) and len(source.users) == 1
                and all(order[n] < order[first] for n in source.all_input_nodes)):
            return None
        moves.append(source)
    return moves + [value]


def _draws_random(node: fx.Node) -> bool:
    """Whether ``node`` draws random numbers: a dropout site (``ops/dropout_kernels.py``; the capture refuses
    every other random op, ``capture/dropout_sites.py``, and the pass ``dropout_sites`` has given every dropout
    that form before this pass runs)."""
    return node.op == "call_function" and getattr(node.target, "dropout_site", False)


def _draws_keep_order(draws: list, moved: list, first: fx.Node, order: dict) -> bool:
    """Whether moving ``moved`` before ``first`` leaves every random draw (``draws``) in its order: no draw that
    stays lies between ``first`` and the last draw that moves."""
    moving = [n for n in moved if _draws_random(n)]
    if not moving:
        return True
    last, staying = order[moving[-1]], set(moved)
    return not any(n not in staying and order[first] <= order[n] < last for n in draws)
