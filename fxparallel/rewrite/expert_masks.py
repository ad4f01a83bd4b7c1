"""Where expert rows (placement ``E``, ``plan/rules/expert_rows.py``) leave the rows: zero the rows of other
ranks' experts, found from the gather that made them."""
from __future__ import annotations

import torch.fx as fx

from ..errors import ShardingError
from ..ops.expert_parallel import gather_local_experts, mask_foreign_rows


def _gather_of(value: fx.Node, placements: dict) -> fx.Node:
    """The rewritten expert gather that ``value``'s rows come from, walking back through expert rows only."""
    frontier, seen = [value], {value}
    while frontier:
        node = frontier.pop(0)
        if node.target is gather_local_experts:
            return node
        for source in node.all_input_nodes:
            p = placements.get(source)
            if source not in seen and (source.target is gather_local_experts
                                       or (p is not None and not isinstance(p, tuple) and p.is_expert_rows)):
                seen.add(source)
                frontier.append(source)
    raise ShardingError(f"expert rows of {value.name} come from no expert gather")


def masked_rows(graph: fx.Graph, value: fx.Node, lead: int, before: fx.Node, placements: dict) -> fx.Node:
    """Insert, before ``before``, ``value`` with the rows of other ranks' experts zeroed."""
    gather = _gather_of(value, placements)
    _, ids, start, count = gather.args
    with graph.inserting_before(before):
        masked = graph.call_function(mask_foreign_rows, (value, ids, start, count, lead))
    masked.meta["example_value"] = value.meta.get("example_value")
    return masked
