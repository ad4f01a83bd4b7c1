"""Mixture-of-experts weights: 3-D parameters [experts, out, in] sharded like a dense MLP.

transformers stores each MoE layer's experts stacked: ``gate_up_proj`` [E, 2I, H] and
``down_proj`` [E, H, I]. Its kernels either gather the weights of the chosen experts
(``W[expert_ids]`` then ``bmm``, the batched_mm kernel) or pass the whole stack with
per-expert row offsets (``grouped_mm``). Both are a per-expert matmul, so each expert
splits like a dense MLP: gate_up on its output features (each rank its slice of gate
and of up, as a segmented shard) and down on its input features (a partial sum).

This file holds
* ``weight_choices``: the placements an expert weight may take, decided at its first use
  (the gather or the transpose in front of grouped_mm); dim 0 (experts) is never split.
* the gather rule: indexing dim 0 with a tensor of ids keeps a shard of the other dims,
  and moves a partial sum's rows (it is linear);
* the grouped_mm rule (``torch._grouped_mm`` and transformers' fallback custom op).
"""
from __future__ import annotations

import torch
import torch.fx as fx

from ..placement import P, R, S
from .base import Strategy, arg, register, tensor_inputs
from .expert_rows import EXPERT_PARALLEL, expert_gather, expert_groups, is_expert_parameter
from .fused import output_segments, whole_segments

_SEARCH_DEPTH = 4  # users followed from a weight to the matmul output that gets split


def is_weight(node, ndim: int) -> bool:
    """A trainable parameter with exactly ``ndim`` dimensions."""
    value = node.meta.get("example_value") if isinstance(node, fx.Node) else None
    return (node.op == "placeholder" and isinstance(value, torch.Tensor) and value.dim() == ndim
            and value.is_floating_point() and value.requires_grad)


def is_expert_weight(node) -> bool:
    """A parameter with three or more dimensions (stacked expert weights)."""
    value = node.meta.get("example_value") if isinstance(node, fx.Node) else None
    return isinstance(value, torch.Tensor) and value.dim() >= 3 and is_weight(node, value.dim())


def expert_note(weight, ctx) -> str:
    """Why an expert weight takes its placement (the plan report's reason)."""
    if is_expert_parameter(weight, ctx):
        return EXPERT_PARALLEL
    return "expert weights (each rank its slice of every expert)" if is_expert_weight(weight) else ""


def _static(size):
    return size if isinstance(size, int) else None


def weight_segments(weight: fx.Node, dim: int, tp: int, find=None):
    """Segments of ``weight``'s dim ``dim`` when a matmul output made from it is later split (gate/up).

    Follows the weight's users a few steps (gather, transpose, bmm, squeeze) and asks the fused-projection
    analysis about every value whose last dimension has that size. Segments only say which rows a rank
    holds: a wrong guess costs a gather later, never a wrong number."""
    size = _static(weight.meta["example_value"].shape[dim])
    frontier, seen = [weight], {weight}
    for _ in range(_SEARCH_DEPTH):
        nxt = []
        for node in frontier:
            for user in node.users:
                if user in seen:
                    continue
                seen.add(user)
                nxt.append(user)
                value = user.meta.get("example_value")
                if isinstance(value, torch.Tensor) and value.dim() > 0 and _static(value.shape[-1]) == size:
                    segments = (find or (lambda n: output_segments(n, tp)))(user)
                    if segments:
                        return segments
        frontier = nxt
    return None


def weight_choices(weight: fx.Node, ctx, first_dim: int = 1) -> list:
    """Placements a weight may take: a shard of each dim from ``first_dim`` on (an expert weight's dim 0
    is its experts) that splits over the ranks, evenly or by the layout's uneven sizes (every fused
    part, if the dim is fused), or replicated. With expert parallelism: whole experts (``expert_rows.py``)."""
    if first_dim == 1 and is_expert_parameter(weight, ctx):
        return [S(0)]
    shape = weight.meta["example_value"].shape
    choices = []
    for d in range(first_dim, len(shape)):
        size = _static(shape[d])
        if not size:
            continue
        if first_dim == 0:  # a plain matrix (Falcon's weight.T): a multi-query part kept whole
            found = weight_segments(weight, d, ctx.tp, lambda n: whole_segments(n, ctx.tp, ctx.head_dim, ctx.can_split))
            if found:
                choices.append(S(d, found[0], whole=found[1]))
        segments = weight_segments(weight, d, ctx.tp, lambda n: output_segments(n, ctx.tp, ctx.can_split))
        if segments or ctx.can_split(size):
            choices.append(S(d, segments))
    return choices + [R]


def input_choices(x, placements, ctx, matrices: bool = False) -> list:
    """The placements to consider for input ``x``: all choices for an expert weight (and, with
    ``matrices``, for a weight matrix: Falcon's ``x @ self.weight.T``), else its own."""
    if is_expert_weight(x):
        return weight_choices(x, ctx)
    if matrices and is_weight(x, 2):
        return weight_choices(x, ctx, first_dim=0)
    return [placements[x]]


# ---- gather by ids ---------------------------------------------------------------------------------------

def gather_index(node: fx.Node):
    """The ids tensor of ``x[ids]`` / ``x[(ids,)]`` (an integer tensor indexing dim 0), else None."""
    index = node.args[1]
    if isinstance(index, tuple) and len(index) == 1:
        index = index[0]
    value = index.meta.get("example_value") if isinstance(index, fx.Node) else None
    if isinstance(value, torch.Tensor) and not value.is_floating_point() and value.dtype != torch.bool:
        return index
    return None


def gather_strategies(node, x, ids, placements, ctx, dim: int = 0) -> list:
    """Rows of ``x`` picked along ``dim`` by replicated ``ids``: other dims keep their shard; a partial stays
    partial (picking rows is linear). With expert parallelism, an expert parameter's experts (``expert_rows.py``),
    as of a value split by experts like them (a LoRA-adapted weight, ``W + B @ A``)."""
    if dim == 0 and (is_expert_parameter(x, ctx) or ctx.experts and placements[x] == S(0)):
        return expert_gather(node, x, ids, ctx)
    ndim, ids_ndim = ctx.ndim(x), ctx.ndim(ids)
    out = ctx.fake(node)
    strategies = []
    for p in input_choices(x, placements, ctx):
        if p.is_partial and len(x.users) == 1:  # (a partial used twice is reduced once, where it is made)
            strategies.append(Strategy({x: P, ids: R}, P, note="rows of a partial sum", name="gather"))
        elif p.is_shard and p.dim != dim:
            o = p.dim + ids_ndim - 1 if p.dim > dim else p.dim
            if 0 <= o < out.dim():
                strategies.append(Strategy({x: p, ids: R}, p.with_dim(o), note=expert_note(x, ctx), name="gather"))
    strategies.append(Strategy({x: R, ids: R}, R, name="replicate"))
    return strategies if ndim > dim else []


def _index_select(node, placements, ctx):
    x, dim, ids = node.args[0], arg(node, 1, "dim"), arg(node, 2, "index")
    if not isinstance(dim, int) or not isinstance(ids, fx.Node) or ctx.fake(ids) is None:
        return []
    return gather_strategies(node, x, ids, placements, ctx, dim=dim % ctx.ndim(x))


register("index_select")(_index_select)


# ---- grouped_mm ------------------------------------------------------------------------------------------

def _grouped_mm(node, placements, ctx):
    """``grouped_mm(x [S, K], w [E, K, N], offs)``: per expert, rows ``offs[e-1]:offs[e]`` of x times w[e]."""
    x, w = node.args[0], node.args[1]
    fx_, fw = ctx.fake(x), ctx.fake(w)
    if fx_ is None or fw is None or fx_.dim() != 2 or fw.dim() != 3:
        return []
    rest = {i: R for i in tensor_inputs(node) if i not in (x, w)}
    if placements[w] == S(0) and ctx.experts or is_expert_parameter(w, ctx):
        return [expert_groups(node, {x: R, w: S(0), **rest}, ctx)]
    k, n = _static(fw.shape[1]), _static(fw.shape[2])
    strategies = []
    segments = output_segments(node, ctx.tp, ctx.can_split) if n else None
    if segments or (n and ctx.can_split(n)):
        strategies.append(Strategy({x: R, w: S(2, segments), **rest}, S(1, segments), name="column",
                                   note="column-parallel experts (grouped_mm)"))
    if k and ctx.can_split(k):
        strategies.append(Strategy({x: S(1), w: S(1), **rest}, P, own_bytes=ctx.bytes_per_token(node), name="row",
                                   note="row-parallel experts (grouped_mm)"))
    strategies.append(Strategy({x: R, w: R, **rest}, R, name="replicate"))
    return strategies


# transformers' fallback custom op is registered when its moe integration is imported: named, not looked up
register("grouped_mm", "transformers::grouped_mm_fallback")(_grouped_mm)
