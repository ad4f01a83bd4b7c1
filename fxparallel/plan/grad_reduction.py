"""Where to all-reduce the gradient of a replicated value that is used on shards.

A replicated value consumed by sharded ops gets a partial gradient on each rank, so
its gradient is all-reduced in the backward pass (``copy_to_tp``). The reduction may
sit anywhere on the chain of pure reshapes that produced the value: summing before
or after a view, transpose or expand is the same sum. Putting it on the smallest
tensor of that chain moves fewer bytes. The case that matters is GQA with fewer kv
heads than ranks: the kv heads are expanded to one per query head and then sliced
per rank, and the reduction is cheaper before the expansion, by the repeat factor.

The solver (to cost a plan) and the rewrite (to insert the collective) both use
``reduction_point``, so the plan reports what the graph does. Which ops are pure reshapes:
``op_traits.PURE_RESHAPES``.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.fx as fx

from .op_traits import PURE_RESHAPES, op_name
from .rules.base import requires_grad


def _is_pure_reshape(node: fx.Node) -> bool:
    if op_name(node) in PURE_RESHAPES:
        return True
    if op_name(node) == "getitem" and isinstance(node.args[1], tuple):  # x[:, :, None]: adds a dim only
        return all(i is None or i is Ellipsis or i == slice(None) for i in node.args[1])
    return False


def _numel(node: fx.Node) -> int:
    value = node.meta.get("example_value")
    return value.numel() if isinstance(value, torch.Tensor) else 0


def reduction_point(value: fx.Node, is_replicated) -> fx.Node:
    """The node on whose output the gradient of ``value`` is best all-reduced.

    Walk up while the node is a pure reshape of a single replicated input that
    requires grad and has no other user (another user would have its own, already
    complete, gradient summed into the reduction). ``value`` itself must have one
    user, else ``value`` is returned."""
    best, node = value, value
    if len(value.users) != 1:
        return value
    while _is_pure_reshape(node):
        source = node.args[0]
        if not isinstance(source, fx.Node) or len(source.users) != 1 or not requires_grad(source) \
                or not is_replicated(source):
            break
        node = source
        if _numel(node) and _numel(node) < _numel(best):
            best = node
    return best


def hoisted_point(value: fx.Node, is_replicated) -> fx.Node:
    """Where the rewrite reduces the gradient of ``value`` in the end, for the solver's costs: from
    ``reduction_point`` on up through ops made from one value that requires grad, each used only by the op
    before it (``rewrite/gradient_reductions.py`` hoists such reductions: an op's backward is linear in its
    gradient). The node reached may have other users: its one reduction serves them too. A MoE block's rows
    ``x[perm // top_k]`` (or ``x.repeat_interleave(top_k)``) are then charged as ``x``, not top_k times ``x``."""
    node = reduction_point(value, is_replicated)
    while node.op in ("call_function", "call_method") and len(node.users) == 1:
        sources = [n for n in node.all_input_nodes if requires_grad(n)]
        if len(sources) != 1 or not is_replicated(sources[0]):
            break
        node = sources[0]
    return node


def whole_segment_region(value: fx.Node, is_replicated, is_origin) -> Optional[tuple]:
    """(region, origins): the replicated values that ``value`` is made from, back to whole segments of a fused
    projection (``is_origin``), when every value it is made from that requires grad is one of those or made from
    them; None otherwise. A whole segment's gradient is partial by design (plan/placement.py), and every op's
    backward is linear in its gradient, so a value made only from whole segments may keep a partial gradient too:
    no reduction (Mamba-2's B and C of one group, whole on every rank, widened to the heads and multiplied into
    ``C B^T``, which each rank uses for its heads only); a whole segment itself is its own origin, with an empty
    region. The rewrite also checks each region value's users."""
    if is_origin(value):
        return set(), {value}
    region, origins, stack = {value}, set(), [value]
    while stack:
        node = stack.pop()
        if node.op not in ("call_function", "call_method"):
            return None
        for source in node.all_input_nodes:
            if not requires_grad(source):
                continue
            if is_origin(source):
                origins.add(source)
            elif not is_replicated(source):
                return None
            elif source not in region:
                region.add(source)
                stack.append(source)
    return (region, origins) if origins else None
