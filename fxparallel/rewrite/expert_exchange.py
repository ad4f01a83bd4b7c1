"""Pass: expert_exchange. With experts spread over data-parallel ranks (``parallelize(..., ep_group=...)``), every
grouped product of an expert weight becomes ``ops/expert_exchange.exchanged_grouped_mm``: its rows go to the
ep rank holding their expert and come back. The weight, bound as a parameter, is this rank's run of experts
(``ParallelCausalLM`` keeps only those). Any other use of a stacked expert weight (transformers' batched_mm
kernel gathers one per routed row) would need every expert: refused, naming the op.

Then each MoE block's two products (gate_up, then down, over the same offsets) share one exchange
(``one_exchange_per_block``): the rows are dispatched before the first, the ops between them (the activation:
row by row) run on the dispatched rows, and the second's products are combined: the rows travel out and back once
per block instead of once per product. Where whole experts per tp rank roll this rank's rows to the front around
each product (``ops/expert_parallel.py``), the unroll after the first and the roll before the second cancel out and
are left out. Any op between them that is not row by row (or reads a value from elsewhere than a parameter, as
GPT-OSS's biases picked per row) keeps the two exchanges."""
from __future__ import annotations

import operator

import torch.fx as fx

from ..errors import ShardingError
from ..ops.expert_exchange import KERNELS, combine_rows, dispatch_rows, exchanged_grouped_mm, local_grouped_mm
from ..ops.expert_parallel import roll_to_local_rows, unroll_local_rows
from ..plan.op_traits import POINTWISE, op_name
from ..plan.rules.base import arg

# ops between an expert weight and its grouped product (transformers transposes it unless it is stored so)
_THROUGH = frozenset({"transpose", "permute", "t", "contiguous", "to", "clone", "alias"})


def exchange_expert_rows(graph: fx.Graph, expert_weights: frozenset, handle: int) -> int:
    """Rewrite each grouped product of a stacked expert weight (HF names ``expert_weights``); returns how many."""
    count = 0
    for node in [n for n in graph.nodes if n.op == "get_attr" and n.target in expert_weights]:
        for product, weight in _products(node):
            kernel = op_name(product)
            x, offs = product.args[0], arg(product, 2, "offs")
            if kernel not in KERNELS or product.args[1] is not weight or not isinstance(offs, fx.Node):
                raise ShardingError(
                    f"expert parallelism over data-parallel ranks (ep_group): expert weight {node.target} is read by "
                    f"{product.name} ({kernel or product.target}), not by a grouped product of rows sorted by "
                    "expert; it needs transformers' grouped_mm experts kernel (config.experts_implementation = "
                    "'grouped_mm'; the CPU default here is batched_mm)")
            with graph.inserting_before(product):
                exchanged = graph.call_function(exchanged_grouped_mm, (x, weight, offs),
                                                {"handle": handle, "kernel": kernel})
            exchanged.meta = dict(product.meta)
            product.replace_all_uses_with(exchanged)
            graph.erase_node(product)
            count += 1
    return count


def _products(weight: fx.Node):
    """(first user past the ops in ``_THROUGH``, the value it takes) for every use of ``weight``."""
    for user in list(weight.users):
        if op_name(user) in _THROUGH:
            yield from _products(user)
        else:
            yield user, weight


def one_exchange_per_block(graph: fx.Graph) -> int:
    """Fuse the exchanges of each pair of products described in the module docstring; returns how many pairs."""
    fused = 0
    for second in [n for n in graph.nodes if n.target is exchanged_grouped_mm]:
        found = _pair(second)
        if found is not None:
            _fuse(graph, second, *found)
            fused += 1
    return fused


def _rolled(node):
    """(roll node, its output index) when ``node`` is ``getitem(roll_to_local_rows(...), i)``, else (None, None)."""
    if node.op == "call_function" and node.target is operator.getitem and isinstance(node.args[0], fx.Node) \
            and node.args[0].target is roll_to_local_rows:
        return node.args[0], node.args[1]
    return None, None


def _pair(second: fx.Node):
    """(first product, the ops between, the value the second takes, the rolls or None) when ``second``'s rows come
    row by row from another exchanged product over the same offsets."""
    x, offs = second.args[0], second.args[2]
    roll2, _ = _rolled(x)
    if roll2 is not None:  # whole experts per tp rank: rows rolled to the front around each product
        roll2b, _ = _rolled(offs)
        if roll2b is not roll2:
            return None
        x = roll2.args[0]
    chain, stack, first = set(), [x], None
    while stack:
        node = stack.pop()
        source = _source(node, roll2)
        if source is not None:
            if first not in (None, source):
                return None
            first = source
            continue
        if node in chain:
            continue
        if not _row_by_row(node):
            return None
        chain.add(node)
        stack += [i for i in node.all_input_nodes if i.op != "get_attr"]
    if first is None:
        return None
    head = first if roll2 is None else next(iter(first.users))  # (the unroll after a rolled product)
    inside = chain | {head}
    if any(u not in inside and u is not (roll2 or second) for n in inside for u in n.users):
        return None  # a value between the products used elsewhere: it needs the rows in their own order
    if roll2 is not None:
        roll1, _ = _rolled(first.args[0])
        if roll1 is None or roll1.args[1:] != roll2.args[1:]:
            return None
        return first, head, chain, x, (roll1, roll2)
    if first.args[2] is not offs:
        return None
    return first, head, chain, x, None


def _source(node: fx.Node, rolled):
    """The exchanged product ``node`` is (or, rolled, unrolls), else None."""
    if rolled is None:
        return node if node.target is exchanged_grouped_mm else None
    product = node.args[0] if node.target is unroll_local_rows else None
    if product is not None and product.target is exchanged_grouped_mm and len(product.users) == 1:
        return product
    return None


def _row_by_row(node: fx.Node) -> bool:
    """An op that acts on each row alone, sizes of other dims as given (so it runs on any number of rows)."""
    name = op_name(node)
    if name in POINTWISE:
        return True
    if name in ("chunk", "split"):
        dim = node.kwargs.get("dim", node.args[2] if len(node.args) > 2 else 0)
        return isinstance(dim, int) and dim != 0 and (dim > 0 or dim >= -_ndim(node.args[0]) + 1)
    if name == "getitem":
        index = node.args[1]
        if isinstance(index, int):  # a part of a chunk / split
            return op_name(node.args[0]) in ("chunk", "split")
        index = index if isinstance(index, tuple) else (index,)
        return bool(index) and (index[0] is Ellipsis and len(index) == 2 or index[0] == slice(None)) and \
            all(isinstance(i, slice) or i is Ellipsis for i in index)
    return False


def _ndim(node) -> int:
    value = node.meta.get("example_value") if isinstance(node, fx.Node) else None
    return value.dim() if value is not None else 0


def _fuse(graph: fx.Graph, second: fx.Node, first: fx.Node, head: fx.Node, chain: set, x: fx.Node, rolls) -> None:
    handle, kernel = first.kwargs["handle"], first.kwargs["kernel"]
    with graph.inserting_before(first):
        dispatched = graph.call_function(dispatch_rows, (first.args[0], first.args[2], handle))
        rows = graph.call_function(operator.getitem, (dispatched, 0))
        route = graph.call_function(operator.getitem, (dispatched, 1))
        product = graph.call_function(local_grouped_mm, (rows, first.args[1], route, kernel))
    env = {head: product}
    with graph.inserting_before(second):
        for node in [n for n in graph.nodes if n in chain]:  # (in graph order)
            env[node] = graph.node_copy(node, lambda a: env.get(a, a))
        out = graph.call_function(local_grouped_mm, (env[x], second.args[1], route, kernel))
        combined = graph.call_function(combine_rows, (out, route))
    combined.meta = dict(second.meta)
    second.replace_all_uses_with(combined)
    if rolls is not None:  # the unroll after the second reads the same mask and index as after the first
        roll1, roll2 = rolls
        for user in list(roll2.users):
            twin = next((u for u in roll1.users if u.args[1] == user.args[1]), None)
            if twin is None:
                with graph.inserting_after(roll1):
                    twin = graph.call_function(operator.getitem, (roll1, user.args[1]))
            user.replace_all_uses_with(twin)
    _erase_unused(graph, chain | {second, head, first} | ({rolls[1], *rolls[1].users} if rolls else set()))


def _erase_unused(graph: fx.Graph, candidates: set) -> None:
    """Erase the ``candidates`` no node reads any more, and the getitems and rolls only they read, until none is
    left unread (nothing of the products' former path runs)."""
    candidates = set(candidates)
    changed = True
    while changed:
        changed = False
        for node in reversed(list(graph.nodes)):
            if node in candidates and not node.users:
                candidates.discard(node)
                candidates.update(i for i in node.all_input_nodes
                                  if i.target in (operator.getitem, roll_to_local_rows))
                graph.erase_node(node)
                changed = True
