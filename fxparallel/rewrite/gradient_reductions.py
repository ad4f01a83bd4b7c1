"""Pass: gradient reductions. A replicated value that requires grad and is consumed on shards
gets a ``copy_to_tp`` (identity forward, all-reduce backward), one per value, shared by all
its sharded consumers (q, k and v share one). A value used only on shards and made from one
other value (a MoE block's ``x.repeat_interleave(k).unsqueeze(-1)`` in front of the experts)
passes the reduction up to that value, so the block's consumers share one all-reduce."""
from __future__ import annotations

import torch.fx as fx

from ..capture.graph import writes_data
from ..plan.grad_reduction import reduction_point, whole_segment_region
from ..plan.placement import Placement
from ..plan.rules.base import requires_grad
from ..plan.solver import GraphPlan
from ..ops import collectives


def _hoist_reductions(sharded_consumers: dict, passed_up: set) -> dict:
    """Move a gradient all-reduce from a value to the one value it is made from, when every use of it is on
    shards: its whole gradient is then partial, and an op's backward is linear in the gradient, so reducing
    before or after the op gives the same sum. Never across a collective."""
    consumers = {v: list(dict.fromkeys(c)) for v, c in sharded_consumers.items()}
    moved = True
    while moved:
        moved = False
        for value, users in list(consumers.items()):
            if value.op not in ("call_function", "call_method") or set(value.users) != set(users):
                continue
            if value.target in collectives.COLLECTIVE_OPS or value.target in (collectives.local_chunk,
                                                                               collectives.partial_grad):
                continue
            sources = [n for n in value.all_input_nodes if requires_grad(n)]  # ids, masks: no gradient
            if len(sources) != 1:
                continue
            del consumers[value]
            consumers.setdefault(sources[0], []).append(value)
            passed_up.add(value)
            moved = True
    return consumers


def _without_whole_segment_regions(graph: fx.Graph, sharded_consumers: dict, gplan: GraphPlan) -> dict:
    """Drop the reductions of values made only from whole segments whose every use is on shards or inside such a
    region (``plan.grad_reduction.whole_segment_region``; a whole segment used only on shards is one): their
    gradients stay partial, and so do the segments' (their ``partial_grad`` goes: the weight's ``sum_grad_rows``
    sums them)."""
    def replicated(n):
        return isinstance(gplan.placements.get(n), Placement) and gplan.placements[n].is_replicate

    def is_origin(n):
        return n.op == "call_function" and n.target is collectives.partial_grad

    dropped, origins = set(), set()
    for value in sharded_consumers:
        if value in dropped or not requires_grad(value):
            continue
        found = whole_segment_region(value, replicated, is_origin)
        if found is None:
            continue
        region, starts = found
        inside = region | set(dropped)
        if all(set(n.users) <= inside | set(sharded_consumers.get(n, ())) for n in region | starts):
            dropped |= region
            origins |= starts
    for origin in origins:
        origin.replace_all_uses_with(origin.args[0])
        graph.erase_node(origin)
    return {v: c for v, c in sharded_consumers.items() if v not in dropped and v not in origins}


def insert_gradient_reductions(graph: fx.Graph, sharded_consumers: dict, handle: int, gplan: GraphPlan,
                               passed_up: set) -> list:
    """Returns the replicated values whose gradient is all-reduced. ``passed_up`` receives the
    values whose reduction moved to the value they are made from (the report names their consumers)."""
    sharded_consumers = _without_whole_segment_regions(graph, sharded_consumers, gplan)
    sharded_consumers = _hoist_reductions(sharded_consumers, passed_up)
    reduced = []
    for value, consumers in sharded_consumers.items():
        if not requires_grad(value):
            continue
        point = reduction_point(value, lambda n: isinstance(gplan.placements.get(n), Placement)
                                and gplan.placements[n].is_replicate)
        if point is not value and next(iter(value.users)) in consumers:
            # reduce on the smallest tensor of the reshape chain that made the value (plan/grad_reduction.py)
            insert_copy_to_tp(graph, point, list(point.users), handle)
            reduced.append(point)
            continue
        insert_copy_to_tp(graph, value, consumers, handle)
        reduced.append(value)
    return reduced


def insert_copy_to_tp(graph: fx.Graph, value: fx.Node, users, handle: int) -> fx.Node:
    """Put ``copy_to_tp(value)`` (identity forward, all-reduce of the gradient backward) between
    ``value`` and ``users``; after the last placeholder if ``value`` is one. Returns the first one made.

    copy_to_tp's output is a view of ``value``, which autograd forbids using once ``value`` has been written
    in place (Gemma 3n's ``x[..., :n] = y`` on a replicated value): users after such a write get their own
    copy_to_tp, made after it (each reduces its part of the gradient, which sums to the same)."""
    writes = [w for w in value.users if writes_data(w) and w.args[0] is value]
    groups = {None: list(set(users))}  # the last write before a user (or None) -> its users
    if writes:  # (numbering the graph only then: this runs for every value reduced)
        order = {n: i for i, n in enumerate(graph.nodes)}
        groups = {}
        for user in sorted(set(users), key=order.__getitem__):
            before = [w for w in writes if order[w] < order[user]]
            groups.setdefault(max(before, key=order.__getitem__) if before else None, []).append(user)
    made = []
    for write, group in groups.items():
        anchor = write or value
        if anchor.op == "placeholder":
            anchor = [n for n in graph.nodes if n.op == "placeholder"][-1]
        with graph.inserting_after(anchor):
            f = graph.call_function(collectives.copy_to_tp, (value, handle))
        f.meta["example_value"] = value.meta.get("example_value")
        for user in group:
            user.replace_input_with(value, f)
        _clone_if_mutated(graph, value, f)
        made.append(f)
    return made[0]


def _clone_if_mutated(graph: fx.Graph, value: fx.Node, f: fx.Node) -> None:
    """A custom autograd Function's output may not be modified in place (XLM's ``tensor *= mask``): such a
    user gets a copy. Only where nothing reads ``value`` after the first such write, as it would see the
    write (then torch's own error stands)."""
    mutating = [u for u in f.users if writes_data(u) and u.args[0] is f]
    if not mutating:
        return
    order = {n: i for i, n in enumerate(graph.nodes)}
    first = min(order[u] for u in mutating)
    if any(order[u] > first and u not in mutating for u in list(value.users) + list(f.users)):
        return
    with graph.inserting_after(f):
        copy = graph.call_method("clone", (f,))
    copy.meta["example_value"] = f.meta.get("example_value")
    for u in mutating:
        u.replace_input_with(f, copy)
