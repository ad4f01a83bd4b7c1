"""Matrix products: linear (nn.Linear), addmm (GPT-2's Conv1D) and matmul.

For a weight-bearing product the rule offers the Megatron pair:
column-parallel (weight split on output features; replicated input -> sharded
output) and row-parallel (weight split on input features; sharded input ->
partial output, reduced later). A row-parallel bias is added once, after the
all-reduce. Replication is always available; the solver decides by cost.

A fused projection with a part of fewer heads than ranks (multi-query attention's k and
v) is column-parallel with that part whole on every rank (``fused.whole_segments``).
"""
from __future__ import annotations

import torch.fx as fx

from ..placement import P, R, S
from .base import LocalOp, Strategy, arg, register, tensor_inputs
from .experts import input_choices
from .fused import output_segments, whole_segments


def _columns(node, ctx, x, weights: dict, out_dim: int, note: str, out_features: int) -> list:
    """The column strategies of a projection (``weights``: operand -> its sharded dim): first a fused one's with
    whole parts, then split by its parts (or plainly), each for the parts found shallow, then deep
    (``fused.output_segments``) where those differ."""
    strategies, seen = [], set()
    for deep in (False, True):
        found = whole_segments(node, ctx.tp, ctx.head_dim, ctx.can_split, ctx.shared_widths, deep)
        if found and found not in seen:
            seen.add(found)
            segments, whole = found
            strategies.append(Strategy({x: R, **{w: S(d, segments, whole=whole) for w, d in weights.items()}},
                                       S(out_dim, segments, whole=whole), name="column",
                                       note=f"{note} (fused: {len(segments)} parts, {len(whole)} kept whole: fewer "
                                            f"heads than ranks or read by every head)"))
    for deep in (False, True):
        segments = output_segments(node, ctx.tp, ctx.can_split, deep)
        if (segments or ctx.can_split(out_features)) and segments not in seen:
            seen.add(segments)
            strategies.append(Strategy({x: R, **{w: S(d, segments) for w, d in weights.items()}}, S(out_dim, segments),
                                       note=note + (f" (fused: {len(segments)} parts split alike)" if segments else ""),
                                       name="column"))
    return strategies


def _linear(node, placements, ctx):
    x = arg(node, 0, "input")
    w = arg(node, 1, "weight")
    b = arg(node, 2, "bias")
    if not isinstance(w, fx.Node) or ctx.fake(w) is None or ctx.fake(w).dim() != 2:
        return []
    out = ctx.fake(node)
    last = out.dim() - 1
    px = placements[x]
    out_features, in_features = ctx.fake(w).shape
    bias = {b: None} if isinstance(b, fx.Node) else {}
    nbytes = ctx.bytes_per_token(node)
    # whole parts first: the search is depth-first and the split kv heads would be gathered downstream
    strategies = _columns(node, ctx, x, {w: 0, **{k: 0 for k in bias}}, last, "column-parallel linear", out_features)
    if ctx.can_split(in_features):
        if bias:
            strategies.append(Strategy({x: S(ctx.ndim(x) - 1), w: S(1), **{k: R for k in bias}}, R,
                                       note="row-parallel linear (bias added after the all-reduce)",
                                       own_bytes=nbytes, local=LocalOp.of("bias_after_reduce", bias_index=2, dense=False), name="row"))
        else:
            strategies.append(Strategy({x: S(ctx.ndim(x) - 1), w: S(1)}, P, note="row-parallel linear",
                                       own_bytes=nbytes, name="row"))
    if px.is_shard and px.dim != ctx.ndim(x) - 1:
        strategies.append(Strategy({x: px, w: R, **{k: R for k in bias}}, px, note="replicated linear on a sharded batch", name="batch"))
    strategies.append(Strategy({x: R, w: R, **{k: R for k in bias}}, R, note="replicated linear", name="replicate"))
    return strategies


register("linear", whole=True)(_linear)


def _addmm(node, placements, ctx):
    b, x, w = node.args[0], node.args[1], node.args[2]
    if not all(isinstance(n, fx.Node) for n in (b, x, w)) or ctx.fake(w).dim() != 2:
        return []
    in_features, out_features = ctx.fake(w).shape
    nbytes = ctx.bytes_per_token(node)
    # whole parts first: the search is depth-first and the split kv heads would be gathered downstream
    strategies = _columns(node, ctx, x, {b: ctx.ndim(b) - 1, w: 1}, 1, "column-parallel (Conv1D)", out_features)
    if ctx.can_split(in_features):
        strategies.append(Strategy({b: R, x: S(1), w: S(0)}, R, own_bytes=nbytes,
                                   local=LocalOp.of("bias_after_reduce", bias_index=0, dense=True),
                                   note="row-parallel (Conv1D, bias added after the all-reduce)", name="row"))
    strategies.append(Strategy({b: R, x: R, w: R}, R, note="replicated (Conv1D)", name="replicate"))
    return strategies


register("addmm", whole=True)(_addmm)


def _matmul(node, placements, ctx):
    inputs = tensor_inputs(node)
    if len(node.args) < 2 or not all(isinstance(a, fx.Node) for a in node.args[:2]):
        return []
    a, b = node.args[0], node.args[1]
    fa, fb, out = ctx.fake(a), ctx.fake(b), ctx.fake(node)
    if fa is None or fb is None or fa.dim() < 2 or fb.dim() < 2:
        return [Strategy({i: R for i in inputs}, R)]
    na, nb, no = fa.dim(), fb.dim(), out.dim()
    strategies = []
    # contraction dim sharded on both sides -> partial sum
    if ctx.can_split(fa.shape[-1]):
        strategies.append(Strategy({a: S(na - 1), b: S(nb - 2)}, P, own_bytes=ctx.bytes_per_token(node), name="row"))
    # rows of a (a segmented shard, e.g. gathered gate/up expert weights, keeps its segments; a weight
    # matrix on the left, Mamba's ``dt_proj.weight @ x``, may be split by rows here)
    pb = placements[b]
    for pa in input_choices(a, placements, ctx, matrices=True):
        if ctx.can_split(out.shape[-2]) and pa.is_shard and pa.dim == na - 2:
            strategies.append(Strategy({a: pa, b: R}, pa.with_dim(no - 2), name="rows"))
    # columns of b
    if ctx.can_split(out.shape[-1]):
        pb = pb if pb.is_shard and pb.dim == nb - 1 else S(nb - 1)
        strategies.append(Strategy({a: R, b: pb}, pb.with_dim(no - 1), name="column"))
    strategies.extend(_batch_strategies(node, (a, b), placements, ctx))
    strategies.append(Strategy({a: R, b: R}, R))
    return strategies


def _batch_strategies(node, operands, placements, ctx) -> list:
    """A batch dim (aligned from the right, not one of the two matrix dims) sharded alike in every
    operand that has it; an operand broadcast there is used whole. Blocked shards pass through."""
    no = ctx.ndim(node)
    strategies = []
    for x in operands:
        p = placements[x]
        nx = ctx.ndim(x)
        if p.is_shard and p.dim < nx - 2:
            d = p.dim + no - nx
            parts = p.parts(ctx.size(node, d))
            if all(ctx.can_split(s) for s in parts):
                req = {}
                for y in operands:
                    yd = d - (no - ctx.ndim(y))
                    req[y] = R if yd < 0 or ctx.size(y, yd) == 1 else p.with_dim(yd)
                strategies.append(Strategy(req, p.with_dim(d), note="batched matmul on local batch entries"))
    return strategies


register("matmul", "bmm", blocks=True, whole=True)(_matmul)


def _baddbmm(node, placements, ctx):
    """``input + batch1 @ batch2`` (scaled): Bloom's ALiBi scores. Sharded along the batch only."""
    x, b1, b2 = arg(node, 0, "input"), arg(node, 1, "batch1"), arg(node, 2, "batch2")
    operands = [t for t in (x, b1, b2) if isinstance(t, fx.Node)]
    if len(operands) != 3 or any(ctx.fake(t) is None for t in operands):
        return []
    return _batch_strategies(node, operands, placements, ctx) + [Strategy({t: R for t in operands}, R)]


register("baddbmm", blocks=True)(_baddbmm)
