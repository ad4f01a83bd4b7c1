"""The dropout sites of a rewritten graph: each ``F.dropout`` / attention with ``dropout_p`` becomes a
kernel that keeps this rank's part of one logical mask (``ops/dropout_kernels.py``, whose docstring
says how), with the cut of its placement; the ``dropout_mode`` pass wires the module's ``training``
flag into every site."""
from __future__ import annotations

import warnings

import torch
import torch.fx as fx
import torch.nn.functional as F

from ..errors import ContextParallelError, ShardingError
from ..ops.dropout_kernels import attention_dropout, logical_dropout
from ..plan.layout import uneven_split
from ..plan.placement import Placement, shard_pieces
from .fx_nodes import SDPA, node_arg, same_size


# ---- local ops (plan/rules/dropout.py names them) ---------------------------------------------
def tp_cuts(node: fx.Node, editor, placement, dim_of=None) -> tuple:
    """The tensor-parallel cut of ``placement`` (R: none) for a node of that full shape."""
    if not isinstance(placement, Placement) or not placement.is_shard:
        return ()
    if placement.whole:
        raise ShardingError(f"dropout {node.name}: a {placement} shard has no slice of the logical mask")
    if placement.block is not None:  # batch x heads flattened: this rank's heads of every row
        split = uneven_split(placement, placement.block, editor.layout)
        pieces = shard_pieces(placement.block, editor.rank, editor.tp, None, split)
        return (("blocks", placement.dim, placement.block, tuple(pieces)),)
    full = node.meta["example_value"].shape[placement.dim]
    if not isinstance(full, int):
        raise ShardingError(f"dropout {node.name}: its dim {placement.dim} has no fixed size to slice the mask by")
    split = uneven_split(placement, full, editor.layout)
    pieces = shard_pieces(full, editor.rank, editor.tp, placement.segments, split)
    return (("pieces", placement.dim, full, tuple(pieces)),)


def dropout_on_shards(node: fx.Node, editor, placement) -> None:
    """``F.dropout(x, p, True)`` -> ``logical_dropout(x, p, cuts)``: the flag is wired later."""
    x = node.args[0] if node.args else node.kwargs["input"]
    p = node.args[1] if len(node.args) > 1 else node.kwargs.get("p", 0.5)
    node.target, node.args = logical_dropout, (x, p)
    node.kwargs = {"cuts": tp_cuts(node, editor, placement), "training": None}


def attention_with_dropout(node: fx.Node, editor, placement) -> None:
    """sdpa with dropout_p > 0 -> ``attention_dropout`` with the heads cut of its output."""
    node.target = attention_dropout
    node.kwargs = {**node.kwargs, "cuts": tp_cuts(node, editor, placement), "training": None}




# ---- passes ------------------------------------------------------------------------------------
def replicated_sites(graph: fx.Graph) -> int:
    """Pass ``dropout_sites`` (after ``redistribute``): the dropouts the plan left replicated (no strategy:
    every input replicated) become ``logical_dropout`` / ``attention_dropout`` with no cut, like the
    sharded ones, so the module's flag decides for them too."""
    from ..capture.dropout_sites import is_identity_dropout

    count = 0
    for node in graph.nodes:
        if node.op != "call_function":
            continue
        if node.target is F.dropout and not is_identity_dropout(node):
            dropout_on_shards(node, None, None)
        elif node.target in SDPA and node_arg(node, 4, "dropout_p", 0.0) not in (0, 0.0):
            attention_with_dropout(node, None, None)
        else:
            continue
        count += 1
    return count


def add_cut(node: fx.Node, cut) -> None:
    node.kwargs = {**node.kwargs, "cuts": tuple(node.kwargs.get("cuts", ())) + (cut,)}


def cut_sequence_chunks(graph: fx.Graph, captured, cp) -> int:
    """Context parallelism: each dropout's mask is this rank's chunks of the logical sequence (the graph
    runs on the local tokens; the dim holding them is found by its size: the sequence of the arguments,
    or batch x sequence)."""

    sites = [n for n in graph.nodes if n.op == "call_function" and n.target is logical_dropout]
    if not sites:
        return 0
    names = ("input_ids", "position_ids", "labels")  # [batch, sequence] each; Dynamo may name either by any
    seqs = [sym for sym, (arg, dim) in captured.symbol_sources.items() if arg in names and dim == 1]
    batches = [(sym, arg) for sym, (arg, dim) in captured.symbol_sources.items() if arg in names and dim == 0]
    batch_arg = batches[0][1] if batches else None
    batch = batches[0][0] if batches else captured.static_sizes.get(("input_ids", 0))
    if not seqs or batch is None:
        raise ContextParallelError("dropout under context parallelism: the graph's sequence length is not a "
                                   "dimension of its arguments")
    rows_of = [b for b, _ in batches] or [batch]
    batch_node = None
    for node in sites:
        shape = tuple(node.meta["example_value"].shape)
        dims = [(d, False) for d, size in enumerate(shape) if any(same_size(size, q) for q in seqs)]
        if batch != 1:
            dims += [(d, True) for d, size in enumerate(shape)
                     if any(same_size(size, b * q) for b in rows_of for q in seqs)]
        if len(dims) != 1:
            raise ContextParallelError(f"dropout {node.name} of shape {shape} has no single sequence dim, so its "
                                       "mask cannot be cut into context-parallel chunks")
        dim, flat = dims[0]
        rows = None
        if flat and isinstance(batch, int):
            rows = batch
        elif flat:
            if batch_node is None:
                placeholder = next(n for n in graph.nodes if n.op == "placeholder"
                                   and captured.inputs.get(n.name) == batch_arg)
                last = [n for n in graph.nodes if n.op == "placeholder"][-1]
                with graph.inserting_after(last):
                    batch_node = graph.call_function(torch.ops.aten.sym_size.int, (placeholder, 0))
            rows = batch_node
        add_cut(node, ("chunks", dim, cp.size, cp.rank, rows))
    return len(sites)


def bind_training_flag(graph: fx.Graph) -> int:
    """Pass ``dropout_mode``: every dropout site reads ``self.training`` of the module running the code
    (the parallel module; a decoder layer's piece gets it from the root). Returns the sites."""
    sites = [n for n in graph.nodes if n.op == "call_function" and getattr(n.target, "dropout_site", False)
             and "training" in n.kwargs and n.kwargs["training"] is None]
    if not sites:
        return 0
    first = next(n for n in graph.nodes if n.op != "placeholder")
    with graph.inserting_before(first), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # FX warns that Dynamo's module lacks it: the parallel module has it
        flag = graph.get_attr("training")
    for node in sites:
        node.kwargs = {**node.kwargs, "training": flag}
    return len(sites)
