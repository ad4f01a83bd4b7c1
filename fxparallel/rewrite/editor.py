"""``GraphEditor``: what the rewrite passes and local ops use to change the graph in place:
local sizes of sharded dimensions, this rank's offsets, and collective insertion that keeps
track of which node now carries a value."""
from __future__ import annotations

from typing import Optional

import torch.fx as fx

from ..errors import ShardingError
from ..group import TPGroup
from ..plan.layout import ShardLayout
from ..plan.placement import Placement
from ..ops import collectives


class GraphEditor:
    def __init__(self, graph: fx.Graph, group: TPGroup, layout: Optional[ShardLayout] = None,
                 placements: Optional[dict] = None):
        self.graph = graph
        self.placements = placements or {}  # the plan's placement per node (what a local op traces back)
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
