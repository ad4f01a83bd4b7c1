"""Expert parallelism: whole experts per rank, and the ops that carry their rows (placement ``E``).

With ``expert_parallel``, each rank holds whole experts: the stacked expert weights (and their
biases) are split along dim 0, experts [start, start + n) on a rank. transformers' experts kernel
gathers each routed (token, expert) pair's weights, ``W[expert_ids]``; on a rank that gather
reads its own experts and a stand-in for the others' (``ops/expert_parallel.py``), so the rows of
its result, and of everything computed row by row from them, are right only for this rank's
experts: placement ``E(n)``, the rows being the leading ``n`` dims.

Row by row: pointwise ops (activations, the routing weights' product, a bias), batched products
over the rows, reductions and norms over the other dims, views that keep each row's elements
together (``[S, h] -> [tokens, top_k, h]``). Summing over rows (the combine of top-k experts)
first zeroes the other ranks' rows (``mask_foreign_rows``): the result is a partial sum, reduced
by the block's one all-reduce with the shared experts'. Any other op reads the rows made whole:
zeroed and all-reduced, which is exact too (each row is right on exactly one rank).

A replicated input of a row-wise op (the tokens, the routing weights) that requires grad gets its
gradient all-reduced, as any replicated value used on shards: each rank's part comes from its
own experts' rows (the others' are zeroed before they reach the loss).
"""
from __future__ import annotations

import torch
from torch.fx.experimental.symbolic_shapes import statically_known_true

from ..op_traits import NORMALIZED_SHAPE_ARG, POINTWISE, REDUCTIONS, op_name
from ..placement import E, P, R, S
from .base import LocalOp, Strategy, arg, norm_dim, tensor_inputs
from .reductions import dim_and_keepdim, reduced_dims

_ROW_PRODUCTS = frozenset({"bmm", "baddbmm", "matmul"})
_KEEP_ROWS = frozenset({"unsqueeze", "squeeze", "transpose", "chunk", "split", "contiguous"})
_RESHAPES = frozenset({"view", "reshape"})


def _same(a, b) -> bool:
    return statically_known_true(a == b) if isinstance(a, torch.SymInt) or isinstance(b, torch.SymInt) else a == b


def _same_shape(a, b) -> bool:
    return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))


def _numel(sizes):
    n = 1
    for s in sizes:
        n = n * s
    return n


EXPERT_PARALLEL = "expert parallel: whole experts per rank"
_GROUPED = frozenset({"grouped_mm", "transformers::grouped_mm_fallback"})


def expert_gather(node, x, ids, ctx) -> list:
    """``W[ids]`` of an expert parameter (dim 0 = experts): this rank's experts, rows ``E``."""
    experts = int(ctx.size(x, 0))
    return [Strategy({x: S(0), ids: R}, E(ctx.ndim(ids)), name="expert gather", note=EXPERT_PARALLEL,
                     local=LocalOp.of("expert_gather", experts=experts))]


def expert_groups(node, inputs: dict, ctx) -> Strategy:
    """``grouped_mm(x, W, offs)`` (rows sorted by expert) with whole experts per rank: this rank's rows, ``E(1)``."""
    experts = int(ctx.size(node.args[1], 0))
    return Strategy(inputs, E(1), name="expert groups", note=EXPERT_PARALLEL,
                    local=LocalOp.of("local_expert_groups", experts=experts))


def is_expert_parameter(x, ctx) -> bool:
    """A parameter stacked by expert (weights [E, out, in], biases [E, out]) of a model planned with
    expert parallelism (``layout.expert_parameters``)."""
    return x in ctx.experts


def strategies(node, placements, ctx) -> list:
    """How ``node`` runs when some input has expert rows; [] when it is not row-wise (then its inputs are
    made whole)."""
    inputs = tensor_inputs(node)
    rows = [i for i in inputs if placements[i] is not None and placements[i].is_expert_rows]
    lead = placements[rows[0]].dim
    shape = ctx.fake(rows[0]).shape[:lead]
    if any(placements[i].dim != lead or not _same_shape(ctx.fake(i).shape[:lead], shape) for i in rows):
        return []
    name = op_name(node)
    if name in _GROUPED:  # this rank's rows times this rank's experts
        x, w = node.args[0], node.args[1]
        if rows != [x] or lead != 1 or not (placements[w] == S(0) or is_expert_parameter(w, ctx)):
            return []
        return [expert_groups(node, {i: (E(1) if i is x else S(0) if i is w else R) for i in inputs}, ctx)]
    if any(placements[i] is not None and not placements[i].is_replicate and i not in rows for i in inputs):
        return []
    req = {i: (placements[i] if i in rows else R) for i in inputs}
    out = _output(node, name, inputs, rows, lead, shape, ctx)
    if out is None:
        return []
    if out.is_partial:
        return [Strategy(req, P, name="expert combine", note="sum over expert rows: a partial sum",
                         local=LocalOp.of("mask_foreign_rows", lead=lead))]
    value = node.meta.get("example_value")
    if isinstance(value, torch.Tensor):
        return [Strategy(req, out, name="expert rows")]
    return [Strategy(req, tuple(out for _ in value), name="expert rows")]


def _output(node, name, inputs, rows, lead, shape, ctx):
    """The placement of ``node``'s output (``E(n)`` or ``P``), or None if it does not act row by row."""
    value = node.meta.get("example_value")
    outs = value if isinstance(value, (tuple, list)) else (value,)
    if not all(isinstance(o, torch.Tensor) for o in outs):
        return None
    x = node.args[0] if node.args else None
    if name in POINTWISE or name in _ROW_PRODUCTS or name in NORMALIZED_SHAPE_ARG:
        # rows stay where they are: every input with rows is as wide as the output, so they align from the left
        if any(ctx.ndim(i) != outs[0].dim() for i in rows) or not _same_shape(outs[0].shape[:lead], shape):
            return None
        if name in _ROW_PRODUCTS and outs[0].dim() - 2 < lead:
            return None
        if name in NORMALIZED_SHAPE_ARG and outs[0].dim() - _normalized_dims(node) < lead:
            return None
        return E(lead)
    if x not in rows or len(rows) != 1:
        return None
    if name in _KEEP_ROWS:
        dim = arg(node, 1, "dim", None) if name != "transpose" else None
        dims = [arg(node, 1, "dim0"), arg(node, 2, "dim1")] if name == "transpose" else [dim]
        if name == "chunk" or name == "split":
            dims = [arg(node, 2, "dim", 0)]
        if name == "contiguous":
            dims = []
        if any(not isinstance(d, int) for d in dims):
            return None
        if any(norm_dim(d, ctx.ndim(x) + (name == "unsqueeze")) < lead for d in dims):
            return None
        return E(lead)
    if name == "getitem":
        from .experts import gather_index  # (experts.py builds on this file)

        index = gather_index(node)
        if index is not None:  # rows picked or permuted by an index (grouped_mm's back in token order)
            return E(ctx.ndim(index)) if lead == 1 and index not in rows else None
        return E(lead) if _keeps_rows(node.args[1], lead, ctx.ndim(x)) else None
    if name in _RESHAPES:
        return _reshaped(x, outs[0], lead, shape, ctx)
    if name in REDUCTIONS:
        dims = reduced_dims(dim_and_keepdim(node)[0], ctx.ndim(x))  # (dim where each signature puts it)
        if dims is None:
            return None
        if all(d >= lead for d in dims):
            return E(lead)
        if name == "sum":  # over rows (the top-k combine): linear, so the masked rows sum to a partial sum
            return P
    return None


def _normalized_dims(node) -> int:
    shape = arg(node, NORMALIZED_SHAPE_ARG[op_name(node)], "normalized_shape", ())
    return len(shape) if isinstance(shape, (tuple, list)) else 1


def _keeps_rows(index, lead, ndim) -> bool:
    """Does ``x[index]`` leave the leading ``lead`` dims whole (basic indexing of the others only)?"""
    items = list(index) if isinstance(index, tuple) else [index]
    if any(i is None or not isinstance(i, (int, slice, type(Ellipsis))) for i in items):
        return False
    if Ellipsis in items:
        after = items[items.index(Ellipsis) + 1:]
        before = items[:items.index(Ellipsis)]
        if ndim - len(after) < lead and after:
            return False
        items = before
    return all(isinstance(i, slice) and i == slice(None) for i in items[:lead]) and \
        all(not isinstance(i, int) for i in items[:lead])


def _reshaped(x, out, lead, shape, ctx):
    """A view keeps each row's elements together when the output's leading dims hold exactly the rows and
    the rest the same elements (row-major): ``[S, h] -> [T, k, h]`` is rows over two dims."""
    rows = _numel(shape)
    for j in range(1, out.dim() + 1):
        if _same(_numel(out.shape[:j]), rows) and _same(_numel(out.shape[j:]), _numel(ctx.fake(x).shape[lead:])):
            return E(j)
    return None
