"""Rewrite the sizes a view / reshape / expand spells out, from full to local.

``x.view(b, s, heads, d)`` on a head-sharded ``x`` must say this rank's number of heads.
The sizes may be literals, graph values (``x.size(0)``) or one tuple computed in the graph
(``x.size()[:-1] + (heads, d)``), which is spelled out element by element first."""
from __future__ import annotations

import operator

import torch
import torch.fx as fx

from ..errors import ShardingError
from ..plan.size_arguments import spelled_out


def _spelled_out_sizes(node, editor):
    """(sizes, rebuild) of a view/reshape, one entry per output dim even when the shape is one
    value computed in the graph."""
    sizes, rebuild = spelled_out(node)
    if len(sizes) == 1 and isinstance(sizes[0], fx.Node) and not isinstance(
        sizes[0].meta.get("example_value"), (int, torch.SymInt)
    ):
        sizes, rebuild = _explode_size_node(node, sizes[0], editor)
    return sizes, rebuild


def _explode_size_node(node, size_node, editor):
    """``x.view(shape)`` where ``shape`` is computed in the graph (e.g. ``x.size()[:-1] + (heads, dim)``):
    spell it out element by element, static sizes as literals, symbolic ones read from ``shape``."""
    out = node.meta["example_value"]
    sizes = []
    for i, s in enumerate(out.shape):
        if isinstance(s, int):
            sizes.append(s)
        else:
            with editor.graph.inserting_before(node):
                sizes.append(editor.graph.call_function(operator.getitem, (size_node, i)))

    def rebuild(new):
        node.args = (node.args[0], tuple(new))

    return sizes, rebuild


def local_view_size(node, editor, dim: int, full: int, segmented=None) -> None:
    """Replace the literal size ``full`` at ``dim`` with its local size (this rank's part of
    each segment, for the segmented shard ``segmented``)."""
    sizes, rebuild = _spelled_out_sizes(node, editor)
    if dim >= len(sizes):
        return
    value = sizes[dim]
    if isinstance(value, int) and value != -1:
        if value != full:
            raise ShardingError(f"{node.format_node()}: size {value} at dim {dim} is not the expected {full}")
        sizes[dim] = sum(editor.local_parts(segmented)) if segmented else editor.local_size(full)
        rebuild(sizes)


def block_view_size(node, editor, dim: int, block: int) -> None:
    """The size at ``dim`` of a blocked dim: ``outer * block`` becomes ``outer * local``, for a
    literal and for a size computed in the graph (``batch * heads``) alike."""
    sizes, rebuild = _spelled_out_sizes(node, editor)
    if dim >= len(sizes) or sizes[dim] == -1:
        return
    value, local = sizes[dim], editor.local_size(block)
    if isinstance(value, int):
        sizes[dim] = value // block * local
    else:
        with editor.graph.inserting_before(node):
            outer = editor.graph.call_function(operator.floordiv, (value, block))
            sizes[dim] = editor.graph.call_function(operator.mul, (outer, local))
    rebuild(sizes)
