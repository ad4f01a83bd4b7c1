"""Pass: redistribute. Where a consumer needs another placement than its input has, insert the
collective (all-gather, all-reduce) or local slice; make each node local as its strategy's
``LocalOp`` says (head counts in views, vocabulary ranges, bias after the reduction); reduce
partial graph outputs. Parameters with whole segments are read through ``sum_grad_rows``."""
from __future__ import annotations

from collections import defaultdict
from typing import Optional

import torch
import torch.fx as fx

from ..capture.graph import writes_data
from ..errors import ShardingError
from ..plan.layout import uneven_split
from ..plan.op_traits import SHARES_STORAGE, op_name
from ..plan.placement import P, R, Placement, is_sharded
from ..plan.rules.base import requires_grad
from ..plan.solver import GraphPlan, describe
from ..ops import collectives
from .editor import GraphEditor
from .expert_masks import masked_rows
from .local_ops import apply_local_op


def uneven_sizes(node: fx.Node, p: Placement, layout) -> Optional[tuple]:
    """Per-rank sizes of ``node``'s shard ``p``, one tuple per segment (or of its block), if uneven;
    None if even."""
    value = node.meta.get("example_value")
    if not p.is_shard or not isinstance(value, torch.Tensor):
        return None
    return uneven_split(p, int(value.shape[p.dim]), layout)


def _redistribute(graph, node: fx.Node, src: Placement, dst: Placement, handle: int, before: fx.Node,
                  layout=None, rank: int = 0, placements=None) -> list:
    """Insert the ops that turn ``node`` from ``src`` into ``dst``; returns the new nodes, last one last.
    Expert rows are first masked to a partial sum (``placements``: the plan's, to find their gather)."""
    steps = []
    value = node
    if src.is_expert_rows:
        value = masked_rows(graph, node, src.dim, before, placements)
        steps.append(value)
        src = P
    with graph.inserting_before(before):
        if src.is_partial:
            value = graph.call_function(collectives.all_reduce, (value, handle))
            steps.append(value)
        elif src.is_shard and dst != src:
            steps += _blockwise(graph, value, src, layout.local(src.block, rank) if src.block else None,
                                lambda v, d: graph.call_function(collectives.all_gather, (
                                    v, d, handle, src.segments, uneven_sizes(node, src, layout), src.whole)))
            value = steps[-1]
        if dst.is_shard:
            steps += _blockwise(graph, value, dst, dst.block,
                                lambda v, d: graph.call_function(collectives.local_chunk, (
                                    v, d, handle, dst.segments, uneven_sizes(node, dst, layout), dst.whole)))
    for s in steps:
        s.meta["example_value"] = node.meta.get("example_value")
    return steps


def _write_back(graph, node: fx.Node, dest: fx.Node, cur: Placement, req: Placement, copy: fx.Node, handle: int,
                layout, rank: int, gplan: GraphPlan) -> None:
    """``node`` writes in place into ``copy``, the redistributed ``dest``: readers of ``dest`` after it must
    see the write, so this rank's part of ``copy`` goes back into ``dest``. (A slice of a replicated ``dest``
    is a view of it, written through already; readers of the op's result read the written copy.) Readers of the
    tensor ``dest`` is a view of, or of another view of it, are readers of ``dest``'s storage too."""
    order = {n: i for i, n in enumerate(graph.nodes)}
    later = [u for u in dest.users if order[u] > order[node]]
    if not later and not _storage_read_after(dest, node, order):
        return  # nothing reads ``dest`` after the write (its readers take the op's result, the written copy)
    if cur.is_partial and req.is_replicate and all(
            getattr(gplan.strategies.get(u), "inputs", {}).get(dest, R) == R for u in later):
        return  # a partial sum is read whole after the write: its reduced copy, which took the write, serves them
    if cur.is_partial or (cur.is_replicate and req.is_shard and (req.segments or req.block is not None)):
        raise ShardingError(f"{describe(node)} writes in place into a value planned {cur} that it needs {req}: "
                            "the write would land in a copy")
    if not cur.is_shard:
        return
    steps = _redistribute(graph, copy, R, cur, handle, node.next, layout, rank)  # right after ``node``
    with graph.inserting_after(steps[-1]):
        back = graph.call_method("copy_", (dest, steps[-1]))
    back.meta["example_value"] = dest.meta.get("example_value")


def _refuse_write_into_a_copy(node: fx.Node, made_from: dict, graph: fx.Graph) -> None:
    """``node`` writes in place through a view (``op_traits.SHARES_STORAGE``, one or more deep) of a redistributed
    copy (``h[..., 1:3].zero_()`` with ``h`` split on its last dim: the slice is taken from ``all_gather(h)``): the
    write lands in the copy, lost to the readers of the value copied after it. Refused, naming the op, rather than
    run wrong. (A write into the copy itself is put back: ``_write_back``.)"""
    value = node.args[0] if node.args else None
    while isinstance(value, fx.Node) and op_name(value) in SHARES_STORAGE and value.args:
        value = value.args[0]
        if value in made_from:
            copied = made_from[value]
            order = {n: i for i, n in enumerate(graph.nodes)}
            if _storage_read_after(copied, node, order):
                raise ShardingError(
                    f"{describe(node)} writes in place into a slice of {copied.name} taken across its split over the "
                    "tp ranks: the slice is read from a gathered copy, so the write would not reach "
                    f"{copied.name}. Not supported: write out of place (e.g. torch.where, or a new tensor)")
            return


def _storage_family(value: fx.Node) -> set:
    """The tensor ``value`` is a view of (through ``op_traits.SHARES_STORAGE``), and every view of that tensor."""
    root = value
    while op_name(root) in SHARES_STORAGE and root.args and isinstance(root.args[0], fx.Node):
        root = root.args[0]
    family, members = [root], {root}
    while family:
        member = family.pop()
        for user in member.users:
            if user not in members and op_name(user) in SHARES_STORAGE and user.args and user.args[0] is member:
                members.add(user)
                family.append(user)
    return members


def _storage_read_after(value: fx.Node, write: fx.Node, order: dict) -> bool:
    """Is the tensor ``value`` is a view of, or any view of that tensor, read after ``write``? (Kimi-Linear's MLA
    fills its keys through slices: ``keys[..., :d].copy_(k)``.)"""
    return any(order[user] > order[write] for member in _storage_family(value) for user in member.users)


def _blockwise(graph, value: fx.Node, p: Placement, block: Optional[int], collective) -> list:
    """``collective(value, dim)`` on ``p``'s dim, or for a blocked shard (``block`` elements per block
    in ``value``) on the block factor: unflatten it, gather or chunk it, flatten back."""
    if p.block is None:
        return [collective(value, p.dim)]
    blocks = graph.call_method("unflatten", (value, p.dim, (-1, block)))
    done = collective(blocks, p.dim + 1)
    return [blocks, done, graph.call_method("flatten", (done, p.dim, p.dim + 1))]


def insert_redistributions(graph: fx.Graph, gplan: GraphPlan, editor: GraphEditor) -> dict:
    """Returns, per replicated value, the consumers that use it on shards."""
    group = editor.group
    _sum_whole_rows(graph, gplan, editor)
    cache = {}
    made_from = {}  # a redistributed copy -> the value it copies
    sharded_consumers = defaultdict(list)
    for node in list(graph.nodes):
        if writes_data(node):
            _refuse_write_into_a_copy(node, made_from, graph)
        strategy = gplan.strategies.get(node)
        if strategy is None:
            continue
        out_sharded = is_sharded(strategy.output)
        for planned, req in strategy.inputs.items():
            if req is None:
                continue
            cur = gplan.placements.get(planned, R)
            inp = editor.current(planned)  # a rewrite may have replaced it (e.g. bias added after the reduction)
            if cur == req:
                if cur.is_replicate and out_sharded:
                    sharded_consumers[inp].append(node)
                continue
            key = (inp, req)
            if key not in cache:
                steps = _redistribute(graph, inp, cur, req, group.handle, node, editor.layout, group.rank,
                                      gplan.placements)
                cache[key] = steps[-1]
                made_from[steps[-1]] = inp
                for step in steps:
                    if step.target is collectives.local_chunk:
                        source = step.args[0]
                        sharded_consumers[source].append(step)
            node.replace_input_with(inp, cache[key])
            if req.is_replicate and out_sharded:
                # a gathered/reduced value used on shards: its gradient is partial too
                sharded_consumers[cache[key]].append(node)
            if writes_data(node) and node.args[0] is cache[key]:
                _write_back(graph, node, inp, cur, req, cache[key], group.handle, editor.layout, group.rank, gplan)
        if writes_data(node) and isinstance(node.args[0], fx.Node):
            written = next((v for (v, _), made in cache.items() if node.args[0] in (v, made)), node.args[0])
            # copies made before the write are stale now, but the one written into: copies of the value written,
            # and, for a write through a view (``buf[:, :1].copy_(x)``), of the tensor it views and of its other views
            family = _storage_family(written)
            for key in [k for k in cache if k[0] in family and cache[k] is not node.args[0]]:
                del cache[key]
        if strategy.local is not None:
            users_before = {v: set(v.users) for v in node.all_input_nodes}
            apply_local_op(node, strategy.local, editor)
            _hand_over_consumers(node, users_before, sharded_consumers)
    # graph outputs: partial sums are reduced; shards stay local (the module gathers on request)
    out = next(n for n in graph.nodes if n.op == "output")
    new_args = []
    for value in out.args[0]:
        placed = gplan.placements.get(value) if isinstance(value, fx.Node) else None
        if isinstance(placed, Placement) and (placed.is_partial or placed.is_expert_rows):
            if (value, R) in cache:  # already reduced for a consumer inside the graph: one all-reduce serves both
                value = cache[(value, R)]
            else:
                value = _redistribute(graph, value, placed, R, group.handle, out, editor.layout, group.rank,
                                      gplan.placements)[-1]
        new_args.append(value)
    out.args = (tuple(new_args),)
    return sharded_consumers


def _hand_over_consumers(node: fx.Node, users_before: dict, sharded_consumers: dict) -> None:
    """A local op that moved an input of ``node`` into ops of its own (grouped_mm's rows rolled first): those
    ops consume it on shards now, so its gradient reduction goes in front of them."""
    for value, before in users_before.items():
        if node in sharded_consumers.get(value, ()) and value not in node.all_input_nodes:
            consumers = sharded_consumers[value]
            consumers.remove(node)
            consumers.extend(u for u in value.users if u not in before)


def _sum_whole_rows(graph: fx.Graph, gplan: GraphPlan, editor: GraphEditor) -> None:
    """Parameters with whole segments (plan/placement.py) are read through ``sum_grad_rows``: the
    gradient of those rows is partial on each rank, summed there once per step."""
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    for node in placeholders:
        p = gplan.placements.get(node)
        if not (isinstance(p, Placement) and p.whole) or not requires_grad(node):  # a cache's state: no gradient
            continue
        with graph.inserting_after(placeholders[-1]):
            summed = graph.call_function(collectives.sum_grad_rows, (
                node, p.dim, p.whole_ranges(editor.local_size), editor.group_handle))
        editor.replace_uses(node, summed)
