"""Pass: expert_exchange. With experts spread over data-parallel ranks (``parallelize(..., ep_group=...)``), every
grouped product of an expert weight becomes ``ops/expert_exchange.exchanged_grouped_mm``: its rows go to the
ep rank holding their expert and come back. The weight, bound as a parameter, is this rank's run of experts
(``ParallelCausalLM`` keeps only those). Any other use of a stacked expert weight (transformers' batched_mm
kernel gathers one per routed row) would need every expert: refused, naming the op."""
from __future__ import annotations

import torch.fx as fx

from ..errors import ShardingError
from ..ops.expert_exchange import KERNELS, exchanged_grouped_mm
from ..plan.op_traits import op_name
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
