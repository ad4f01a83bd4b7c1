"""Where expert rows (placement ``E``, ``plan/rules/expert_rows.py``) leave the rows: zero the rows of other
ranks' experts. Which rows are this rank's is traced back to what made them: an expert gather (by the ids),
a grouped product of this rank's experts (by its offsets), through row permutations (``x[perm]``)."""
from __future__ import annotations

import operator

import torch.fx as fx

from ..errors import ShardingError
from ..ops.expert_parallel import gather_local_experts, mask_foreign_rows, rows_of_experts, unroll_local_rows
from ..plan.rules.experts import gather_index

_SOURCES = (gather_local_experts, unroll_local_rows)


def _is_rows(node: fx.Node, placements: dict) -> bool:
    p = placements.get(node)
    return node.target in _SOURCES or (p is not None and not isinstance(p, tuple) and p.is_expert_rows)


def _mine(graph: fx.Graph, value: fx.Node, placements: dict) -> fx.Node:
    """A node giving, per row of ``value`` (flattened over its row dims), whether it is this rank's expert's."""
    node = value
    while True:
        if node.target is gather_local_experts:
            _, ids, start, count = node.args
            return graph.call_function(rows_of_experts, (ids, start, count))
        if node.target is unroll_local_rows:
            _, mine, back = node.args
            return graph.call_function(operator.getitem, (mine, back))
        index = gather_index(node) if node.target is operator.getitem else None
        if index is not None and _is_rows(node.args[0], placements):
            # rows permuted by an index (grouped_mm's rows put back in token order): their mask alike
            return graph.call_function(operator.getitem, (_mine(graph, node.args[0], placements), index))
        sources = [s for s in node.all_input_nodes if _is_rows(s, placements)]
        if not sources:
            raise ShardingError(f"expert rows of {value.name} come from no expert gather or grouped product")
        node = sources[0]


def masked_rows(graph: fx.Graph, value: fx.Node, lead: int, before: fx.Node, placements: dict) -> fx.Node:
    """Insert, before ``before``, ``value`` with the rows of other ranks' experts zeroed."""
    with graph.inserting_before(before):
        mine = _mine(graph, value, placements)
        masked = graph.call_function(mask_foreign_rows, (value, mine, lead))
    masked.meta["example_value"] = value.meta.get("example_value")
    return masked
