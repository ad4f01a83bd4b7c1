"""The table of local ops: how a node changes to run on local shards, one function per
``LocalOp`` kind a rule may name (``plan/rules/base.py``). Rules decide; this file edits.

Each function takes the node, the ``GraphEditor`` and the op's arguments."""
from __future__ import annotations

import operator

import torch
import torch.fx as fx

from ..plan.placement import Placement
from ..plan.rules.base import LocalOp, arg
from .dropout_masks import attention_with_dropout, dropout_on_shards
from .expert_masks import masked_rows
from ..ops.expert_parallel import gather_local_experts, roll_to_local_rows, unroll_local_rows
from ..ops.shapes import full_size
from ..plan.op_traits import op_name
from ..plan.rules.dim_maps import index_shard_dim
from ..plan.rules.experts import gather_index
from .editor import GraphEditor
from ..ops.vocab_parallel import vocab_parallel_cross_entropy as _vocab_ce
from ..ops.vocab_parallel import vocab_parallel_embedding as _vocab_embedding
from .view_sizes import block_view_size, local_view_size


def vocab_parallel_embedding(node: fx.Node, editor: GraphEditor) -> None:
    """Each rank looks up its range of rows; ids outside it give zeros (summed later)."""
    ids, weight = node.args[0], node.args[1]
    padding_idx = arg(node, 2, "padding_idx")
    vocab = editor.full_size(weight, 0)
    node.target = _vocab_embedding
    node.args = (ids, weight, editor.shard_start(vocab), editor.local_size(vocab),
                 padding_idx if isinstance(padding_idx, int) else None)
    node.kwargs = {}


def vocab_parallel_cross_entropy(node: fx.Node, editor: GraphEditor) -> None:
    logits, target = node.args[0], arg(node, 1, "target")
    vocab = editor.full_size(logits, 1)
    node.target = _vocab_ce
    node.args = (logits, target, editor.shard_start(vocab), editor.group_handle,
                 arg(node, 4, "ignore_index", -100), arg(node, 6, "reduction", "mean"))
    node.kwargs = {}


def bias_after_reduce(node: fx.Node, editor: GraphEditor, bias_index: int, dense: bool) -> None:
    """``op(..., bias)`` on partial sums becomes ``all_reduce(op(...)) + bias``; ``dense``:
    the op is ``addmm(bias, x, w)``, which becomes ``mm(x, w)``."""
    args = list(node.args)
    bias = args[bias_index] if len(args) > bias_index else node.kwargs.get("bias")
    if len(args) > bias_index:
        args[bias_index] = None
    kwargs = {k: v for k, v in node.kwargs.items() if k != "bias"}
    if dense:
        node.target = torch.mm
        args = [a for i, a in enumerate(args) if i != bias_index]
        kwargs = {k: v for k, v in kwargs.items() if k not in ("beta", "alpha")}
    node.args, node.kwargs = tuple(args), kwargs
    reduced = editor.all_reduce_after(node)
    with editor.graph.inserting_after(reduced):
        added = editor.graph.call_function(operator.add, (reduced, bias))
    editor.replace_uses(reduced, added)


def local_split_sizes(node: fx.Node, editor: GraphEditor, placement: Placement, groups=None) -> None:
    """``fused.split(sizes)`` into the segments of a segmented shard, or into runs of them (``groups``: the
    segments' indices of each part): this rank's part of each (a whole segment entire; its getitem gets a
    partial gradient)."""
    args = list(node.args)
    if node.target in ("split", torch.split):
        local = editor.local_parts(placement)
        if groups is not None:
            local = [sum(local[i] for i in group) for group in groups]
        if len(args) > 1:
            args[1] = local
            node.args = tuple(args)
        else:
            key = "split_size_or_sections" if "split_size_or_sections" in node.kwargs else "split_size"
            node.kwargs = {**node.kwargs, key: local}
    # chunk(k): equal segments have equal local parts (same size, same split)
    whole = placement.whole if groups is None else [k for k, group in enumerate(groups)
                                                    if len(group) == 1 and group[0] in placement.whole]
    for user in list(node.users):
        if user.target is operator.getitem and user.args[1] in whole:
            editor.partial_grad_after(user)


def mean_of_full(node: fx.Node, editor: GraphEditor, parts: tuple) -> None:
    """A local mean divides by the local count; the all-reduced sum of the local means must be
    the mean over the full dimension: scale each by local / full."""
    local = sum(editor.local_size(s) for s in parts)
    with editor.graph.inserting_after(node):
        scaled = editor.graph.call_function(operator.mul, (node, local / sum(parts)))
    editor.replace_uses(node, scaled)


def segment_slice(node: fx.Node, editor: GraphEditor, placement: Placement, index, position: int,
                  segment: int) -> None:
    """``fused[..., a:b]`` of one segment (``index``: as planned, a one-item list index already
    read as its slice): the slice of this rank's part of that segment."""
    items = list(index) if isinstance(index, tuple) else [index]
    parts = editor.local_parts(placement)  # this rank's parts (may be uneven; a whole one entire)
    start = sum(parts[:segment])
    items[position] = slice(start, start + parts[segment])
    node.args = (node.args[0], tuple(items) if isinstance(index, tuple) else items[0])
    if segment in placement.whole:
        editor.partial_grad_after(node)


def owned_item(node: fx.Node, editor: GraphEditor, dim: int, position: int, item: int) -> None:
    """``x[..., k, ...]`` on the sharded dim ``dim`` (``position`` in the index): the slice ``k:k+1`` of this
    rank's part where it holds index ``k``, an empty slice elsewhere, summed over that dim: the value on its
    owner, zeros on the others (a partial sum), by the same graph on every rank."""
    x, index = node.args[0], node.args[1]
    items = list(index) if isinstance(index, tuple) else [index]
    full = editor.full_size(x, dim)
    start, size = editor.shard_start(full), editor.local_size(full)
    local = item - start if start <= item < start + size else None
    items[position] = slice(local, local + 1) if local is not None else slice(0, 0)
    node.args = (x, tuple(items) if isinstance(index, tuple) else items[0])
    kept = index_shard_dim(tuple(slice(None) if k == position else it for k, it in enumerate(items)),
                           len(x.meta["example_value"].shape), dim)
    with editor.graph.inserting_after(node):
        summed = editor.graph.call_method("sum", (node, kept))
    editor.replace_uses(node, summed)


def expert_gather(node: fx.Node, editor: GraphEditor, experts: int) -> None:
    """``W[ids]`` of a weight split by whole experts: this rank's experts (``ops/expert_parallel.py``)."""
    weight = node.args[0]
    ids = gather_index(node) if op_name(node) == "getitem" else arg(node, 2, "index")
    node.target = gather_local_experts
    node.args = (weight, ids, editor.shard_start(experts), editor.local_size(experts))
    node.kwargs = {}


def local_expert_groups(node: fx.Node, editor: GraphEditor, experts: int) -> None:
    """``grouped_mm(x, W, offs)`` of rows sorted by expert, with whole experts per rank: the kernel runs on this
    rank's experts' rows only, rolled to the front, with this rank's offsets; the rows are rolled back after."""
    x, weight = node.args[0], node.args[1]
    offsets = node.kwargs["offs"] if "offs" in node.kwargs else node.args[2]
    graph = editor.graph
    with graph.inserting_before(node):
        rolled = graph.call_function(roll_to_local_rows, (x, offsets, editor.shard_start(experts),
                                                          editor.local_size(experts)))
        rows, local_offsets, back, mine = (graph.call_function(operator.getitem, (rolled, i)) for i in range(4))
    rows.meta["example_value"] = x.meta.get("example_value")
    node.args = (rows, weight) + ((local_offsets,) if "offs" not in node.kwargs else ()) + tuple(node.args[3:])
    if "offs" in node.kwargs:
        node.kwargs = {**node.kwargs, "offs": local_offsets}
    with graph.inserting_after(node):
        unrolled = graph.call_function(unroll_local_rows, (node, mine, back))
    editor.replace_uses(node, unrolled)


def mask_foreign_rows(node: fx.Node, editor: GraphEditor, lead: int) -> None:
    """The sum over expert rows (the top-k combine) adds this rank's experts' rows only: a partial sum."""
    x = node.args[0]
    node.replace_input_with(x, masked_rows(editor.graph, x, lead, node, editor.placements))


def local_groups(node: fx.Node, editor: GraphEditor, channels: int, segments=None, whole=()) -> None:
    """A depthwise convolution on this rank's channels (its part of each segment, a whole one entire): one
    group each."""
    groups = sum(part if i in whole else editor.local_size(part) for i, part in enumerate(segments or (channels,)))
    args = list(node.args)
    if len(args) > 6:
        args[6] = groups
        node.args = tuple(args)
    else:
        node.kwargs = {**node.kwargs, "groups": groups}


def local_output_size(node: fx.Node, editor: GraphEditor, full: int) -> None:
    """``repeat_interleave(..., output_size=full)`` on a shard: this rank's part of ``full``."""
    if len(node.args) > 3:
        node.args = (*node.args[:3], editor.local_size(full), *node.args[4:])
    elif "output_size" in node.kwargs:
        node.kwargs = {**node.kwargs, "output_size": editor.local_size(full)}


def full_shape(node: fx.Node, editor: GraphEditor) -> None:
    """``x.size()`` of a shard whose sharded dims are static answers the full sizes (``ops/shapes.py``)."""
    x = node.args[0]
    full = tuple(int(s) if isinstance(s, int) else None for s in x.meta["example_value"].shape)
    node.op, node.target = "call_function", full_size
    node.args, node.kwargs = (x, full), {}


LOCAL_OPS = {
    "vocab_parallel_embedding": vocab_parallel_embedding,
    "vocab_parallel_cross_entropy": vocab_parallel_cross_entropy,
    "bias_after_reduce": bias_after_reduce,
    "local_split_sizes": local_split_sizes,
    "mean_of_full": mean_of_full,
    "local_view_size": local_view_size,
    "block_view_size": block_view_size,
    "segment_slice": segment_slice,
    "local_groups": local_groups,
    "local_output_size": local_output_size,
    "expert_gather": expert_gather,
    "owned_item": owned_item,
    "mask_foreign_rows": mask_foreign_rows,
    "local_expert_groups": local_expert_groups,
    "dropout_on_shards": dropout_on_shards,
    "attention_with_dropout": attention_with_dropout,
    "full_shape": full_shape,
}


def apply_local_op(node: fx.Node, op: LocalOp, editor: GraphEditor) -> None:
    LOCAL_OPS[op.kind](node, editor, **op.kwargs())
