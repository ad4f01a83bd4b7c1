"""Apply a graph plan: turn the full-shape captured graph into this rank's local graph.

Passes, in order:
1. ``insert_redistributions``: where a consumer needs another placement than its
   input has, insert the collective (all-gather, all-reduce) or local slice, and
   let each rule rewrite its node to local shapes (head counts in views, vocab
   ranges, bias after reduction).
2. ``insert_gradient_reductions``: a replicated value that requires grad and is
   consumed on shards gets a ``copy_to_tp`` (identity forward, all-reduce
   backward), one per value, shared by all its sharded consumers (q, k and v share
   one). A value used only on shards and made from one other value (a MoE block's
   ``x.repeat_interleave(k).unsqueeze(-1)`` in front of the experts) passes the
   reduction up to that value, so the block's consumers share one all-reduce.
3. ``bind_inputs``: parameters and buffers become attributes under their Hugging
   Face names; size symbols are read from the arguments; meta device constants
   become the runtime device.
"""
from __future__ import annotations

import operator
from collections import defaultdict
from typing import Optional

import torch
import torch.fx as fx

from ..errors import ShardingError
from ..group import TPGroup
from ..plan.grad_reduction import reduction_point
from ..plan.placement import R, Placement, is_sharded
from ..plan.rules.base import requires_grad
from ..plan.solver import GraphPlan
from ..plan.layout import ShardLayout, uneven_split  # noqa: I001
from . import collectives


class RewriteContext:
    """What a rule's rewrite may use: local sizes, this rank's offsets, collective insertion."""

    def __init__(self, graph: fx.Graph, group: TPGroup, layout: Optional[ShardLayout] = None):
        self.graph = graph
        self.group = group
        self.tp = group.size
        self.layout = layout or ShardLayout(group.size)  # each rank's part of a sharded size (may be uneven)
        self.rank = group.rank
        self.group_handle = group.handle
        self._replaced = {}  # node -> the node that took over its uses (e.g. linear -> all_reduce -> + bias)

    def replace_uses(self, old: fx.Node, new: fx.Node) -> None:
        """Move every use of ``old`` (except by ``new`` itself) to ``new``, and remember it:
        consumers planned against ``old`` must read ``new`` (see ``current``)."""
        old.replace_all_uses_with(new, delete_user_cb=lambda user: user is not new)
        for key in ("example_value", "nn_module_stack"):  # the value, and where it comes from (plan's "where")
            if key in old.meta:
                new.meta.setdefault(key, old.meta[key])
        self._replaced[old] = new

    def current(self, node: fx.Node) -> fx.Node:
        """The node that now carries ``node``'s value, after rewrites that replaced it."""
        while node in self._replaced:
            node = self._replaced[node]
        return node

    def local_size(self, full: int) -> int:
        """This rank's part of a sharded dimension of ``full`` (ranks may differ: uneven splits)."""
        if not self.layout.can_split(full):
            raise ShardingError(f"size {full} does not divide by tp size {self.tp} and has no uneven split")
        return self.layout.local(full, self.rank)

    def shard_start(self, full: int) -> int:
        self.local_size(full)
        return self.layout.start(full, self.rank)

    @staticmethod
    def full_size(node: fx.Node, dim: int) -> int:
        return int(node.meta["example_value"].shape[dim])

    def local_parts(self, p: Placement) -> list:
        """This rank's size of each segment of the segmented shard ``p`` (a whole one entire)."""
        return p.local_parts(self.local_size)

    def partial_grad_after(self, node: fx.Node) -> None:
        """A whole segment taken out as a replicated value: its gradient goes back partial (``partial_grad``)."""
        with self.graph.inserting_after(node):
            partial = self.graph.call_function(collectives.partial_grad, (node, self.group_handle))
        self.replace_uses(node, partial)

    def all_reduce_after(self, node: fx.Node) -> fx.Node:
        with self.graph.inserting_after(node):
            reduced = self.graph.call_function(collectives.all_reduce, (node, self.group_handle))
        reduced.meta["example_value"] = node.meta.get("example_value")
        self.replace_uses(node, reduced)
        return reduced


def uneven_sizes(node: fx.Node, p: Placement, layout) -> Optional[tuple]:
    """Per-rank sizes of ``node``'s shard ``p``, one tuple per segment (or of its block), if uneven;
    None if even."""
    value = node.meta.get("example_value")
    if not p.is_shard or not isinstance(value, torch.Tensor):
        return None
    return uneven_split(p, int(value.shape[p.dim]), layout)


def _redistribute(graph, node: fx.Node, src: Placement, dst: Placement, handle: int, before: fx.Node,
                  layout=None, rank: int = 0) -> list:
    """Insert the ops that turn ``node`` from ``src`` into ``dst``; returns the new nodes, last one last."""
    steps = []
    value = node
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


def _blockwise(graph, value: fx.Node, p: Placement, block: Optional[int], collective) -> list:
    """``collective(value, dim)`` on ``p``'s dim, or for a blocked shard (``block`` elements per block
    in ``value``) on the block factor: unflatten it, gather or chunk it, flatten back."""
    if p.block is None:
        return [collective(value, p.dim)]
    blocks = graph.call_method("unflatten", (value, p.dim, (-1, block)))
    done = collective(blocks, p.dim + 1)
    return [blocks, done, graph.call_method("flatten", (done, p.dim, p.dim + 1))]


def insert_redistributions(graph: fx.Graph, gplan: GraphPlan, group: TPGroup) -> dict:
    """Pass 1. Returns, per replicated value, the consumers that use it on shards."""
    ctx = RewriteContext(graph, group, gplan.layout)
    _sum_whole_rows(graph, gplan, ctx)
    cache = {}
    sharded_consumers = defaultdict(list)
    for node in list(graph.nodes):
        strategy = gplan.strategies.get(node)
        if strategy is None:
            continue
        out_sharded = is_sharded(strategy.output)
        for planned, req in strategy.inputs.items():
            if req is None:
                continue
            cur = gplan.placements.get(planned, R)
            inp = ctx.current(planned)  # a rewrite may have replaced it (e.g. bias added after the reduction)
            if cur == req:
                if cur.is_replicate and out_sharded:
                    sharded_consumers[inp].append(node)
                continue
            key = (inp, req)
            if key not in cache:
                steps = _redistribute(graph, inp, cur, req, group.handle, node, ctx.layout, group.rank)
                cache[key] = steps[-1]
                for step in steps:
                    if step.target is collectives.local_chunk:
                        source = step.args[0]
                        sharded_consumers[source].append(step)
            node.replace_input_with(inp, cache[key])
            if req.is_replicate and out_sharded:
                # a gathered/reduced value used on shards: its gradient is partial too
                sharded_consumers[cache[key]].append(node)
        if strategy.rewrite is not None:
            strategy.rewrite(node, ctx)
    # graph outputs: partial sums are reduced; shards stay local (the module gathers on request)
    out = next(n for n in graph.nodes if n.op == "output")
    new_args = []
    for value in out.args[0]:
        if isinstance(value, fx.Node) and isinstance(gplan.placements.get(value), Placement) and gplan.placements[value].is_partial:
            if (value, R) in cache:  # already reduced for a consumer inside the graph: one all-reduce serves both
                value = cache[(value, R)]
            else:
                with graph.inserting_before(out):
                    value = graph.call_function(collectives.all_reduce, (value, group.handle))
        new_args.append(value)
    out.args = (tuple(new_args),)
    return sharded_consumers


def _sum_whole_rows(graph: fx.Graph, gplan: GraphPlan, ctx: RewriteContext) -> None:
    """Parameters with whole segments (plan/placement.py) are read through ``sum_grad_rows``: the
    gradient of those rows is partial on each rank, summed there once per step."""
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    for node in placeholders:
        p = gplan.placements.get(node)
        if not (isinstance(p, Placement) and p.whole):
            continue
        with graph.inserting_after(placeholders[-1]):
            summed = graph.call_function(collectives.sum_grad_rows, (
                node, p.dim, p.whole_ranges(ctx.local_size), ctx.group_handle))
        ctx.replace_uses(node, summed)


def _hoist_reductions(sharded_consumers: dict) -> dict:
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
            value.meta["fxparallel_passes_grad_reduction"] = True  # the plan names its consumers instead
            moved = True
    return consumers


def insert_gradient_reductions(graph: fx.Graph, sharded_consumers: dict, handle: int, gplan: GraphPlan) -> list:
    """Pass 2. Returns the replicated values whose gradient is all-reduced."""
    sharded_consumers = _hoist_reductions(sharded_consumers)
    reduced = []
    for value, consumers in sharded_consumers.items():
        if not requires_grad(value):
            continue
        if value.target is collectives.partial_grad and set(value.users) <= set(consumers):
            # a whole segment used only on shards: its gradient is already partial, as the weight
            # it came from expects (plan/placement.py): neither all-reduce it nor keep one rank's
            value.replace_all_uses_with(value.args[0])
            graph.erase_node(value)
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
    ``value`` and ``users``; after the last placeholder if ``value`` is one."""
    anchor = value
    if value.op == "placeholder":
        anchor = [n for n in graph.nodes if n.op == "placeholder"][-1]
    with graph.inserting_after(anchor):
        f = graph.call_function(collectives.copy_to_tp, (value, handle))
    f.meta["example_value"] = value.meta.get("example_value")
    for user in set(users):
        user.replace_input_with(value, f)
    return f


def _map_devices(obj, device: torch.device):
    if isinstance(obj, torch.device) and obj.type == "meta":
        return device
    if isinstance(obj, (tuple, list)):
        return type(obj)(_map_devices(o, device) for o in obj)
    if isinstance(obj, dict):
        return {k: _map_devices(v, device) for k, v in obj.items()}
    if isinstance(obj, str) and obj == "meta":
        return str(device)
    return obj


def bind_inputs(graph: fx.Graph, captured, device: torch.device) -> None:
    """Pass 3: placeholders for parameters/buffers -> attributes; sizes -> read from arguments."""
    import warnings

    with warnings.catch_warnings():
        # the attributes live on the ParallelCausalLM, not on Dynamo's GraphModule: FX would warn per attribute
        warnings.simplefilter("ignore")
        _bind_inputs(graph, captured, device)


def mutates_in_place(node: fx.Node) -> bool:
    """Does the node write into one of its inputs (``x.scatter_(...)``, ``x += y``)? Its result
    may be unused while the mutation is read later (DeepSeek-style routing builds its group
    mask with ``scatter_``), so dead-code elimination must keep it; FX counts method calls
    as pure."""
    if node.op not in ("call_method", "call_function"):
        return False
    name = node.target if isinstance(node.target, str) else getattr(node.target, "__name__", "")
    if name.startswith("__"):
        return name in ("__setitem__", "__iadd__", "__isub__", "__imul__", "__itruediv__")
    return name.endswith("_") or (node.target in _INPLACE_OPERATORS)


_INPLACE_OPERATORS = {getattr(operator, n) for n in ("iadd", "isub", "imul", "itruediv", "ifloordiv", "imod", "ipow",
                                                      "imatmul", "iand", "ior", "ixor", "ilshift", "irshift")}


def _bind_inputs(graph: fx.Graph, captured, device: torch.device) -> None:
    graph.eliminate_dead_code(is_impure_node=lambda n: n.is_impure() or mutates_in_place(n))
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    first_real = next(n for n in graph.nodes if n.op != "placeholder")
    new_inputs = {}
    with graph.inserting_before(placeholders[0]):
        for node in placeholders:
            if node.name in captured.inputs:
                new_inputs[captured.inputs[node.name]] = graph.placeholder(captured.inputs[node.name])
    for node in placeholders:
        if node.name in captured.inputs:
            node.replace_all_uses_with(new_inputs[captured.inputs[node.name]])
    with graph.inserting_before(first_real):
        for node in placeholders:
            if node.name in captured.params or node.name in captured.buffers:
                target = captured.params.get(node.name) or captured.buffers[node.name]
                attr = graph.get_attr(target)
                attr.meta = dict(node.meta)
                node.replace_all_uses_with(attr)
            elif node.name in captured.symbols:
                arg_name, dim = captured.symbols[node.name]
                size = graph.call_function(torch.ops.aten.sym_size.int, (new_inputs[arg_name], dim))
                node.replace_all_uses_with(size)
    for node in placeholders:
        graph.erase_node(node)
    # attributes of Dynamo's own module (e.g. the bodies of custom autograd functions)
    owner = captured.gm
    for node in graph.nodes:
        if node.op == "get_attr" and node.target not in captured.params.values() and \
                node.target not in captured.buffers.values() and hasattr(owner, str(node.target)):
            name = f"_fxparallel_graph_{id(graph)}_{node.target}".replace(".", "_")
            captured.attributes[name] = getattr(owner, str(node.target))
            node.target = name
    for node in graph.nodes:
        node.args = _map_devices(node.args, device)
        node.kwargs = _map_devices(node.kwargs, device)


def generate_forward(graph: fx.Graph):
    """Python code of the local graph, as a function ``forward(self, **arguments)`` whose
    ``self`` is the module that owns the parameters."""
    from torch.fx.graph_module import _forward_from_src

    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # FX warns about module paths it cannot fetch; they are attributes here
        code = graph.python_code(root_module="self")
    return _forward_from_src(code.src, dict(code.globals)), code.src


def localize(captured, gplan: GraphPlan, group: TPGroup, device: torch.device, sequence_parallel: bool = False):
    """Run the three passes on the captured graph (in place). Returns the values with reduced grads.

    With ``sequence_parallel`` the sequence-parallel pass runs before inputs are bound; its
    report is kept as ``captured.sequence_parallel``."""
    graph = captured.gm.graph
    sharded_consumers = insert_redistributions(graph, gplan, group)
    reduced = insert_gradient_reductions(graph, sharded_consumers, group.handle, gplan)
    if sequence_parallel and group.size > 1:  # with one rank there is nothing to shard
        from .sequence_parallel import apply_sequence_parallel

        captured.sequence_parallel = apply_sequence_parallel(graph, captured, group)
        reduced = reduced + captured.sequence_parallel.reduced
    bind_inputs(graph, captured, device)
    return reduced


def output_placements(captured, gplan: GraphPlan) -> dict:
    """Placement of each named graph output (before binding)."""
    out = next(n for n in captured.gm.graph.nodes if n.op == "output")
    return {name: gplan.placements.get(v) for name, v in zip(captured.outputs, out.args[0])}


def output_split_sizes(captured, gplan: GraphPlan) -> dict:
    """Per-rank sizes along the sharded dim of each sharded graph output (before binding): what
    gathering it or naming this rank's range (``vocab_range``) needs when the split is uneven."""
    out = next(n for n in captured.gm.graph.nodes if n.op == "output")
    sizes = {}
    for name, value in zip(captured.outputs, out.args[0]):
        p = gplan.placements.get(value) if isinstance(value, fx.Node) else None
        if isinstance(p, Placement) and p.is_shard and not p.segments:
            full = int(value.meta["example_value"].shape[p.dim])
            sizes[name] = gplan.layout.sizes(full) if gplan.layout else None
    return sizes
