"""Reductions and normalizations along given dimensions (mean, sum, softmax, ...).

They stay sharded when the sharded dimension is not among the reduced ones. A sum or
mean over the sharded dimension is a partial sum: each rank reduces its shard and one
all-reduce of the (small) result completes it. That is how a norm over a whole sharded
projection (OLMo-2's q/k norm over all heads, BitNet's sub-norms) costs one float per
token instead of gathering the projection.
"""
from __future__ import annotations

from ..op_traits import LINEAR_REDUCTIONS, REDUCTIONS, SHAPE_KEEPING, op_name
from ..placement import P, R
from .base import LocalOp, Strategy, arg, norm_dim, register, tensor_inputs


def dim_and_keepdim(node) -> tuple:
    """The ``dim`` and ``keepdim`` arguments, where each op's signature puts them: ``norm(x, p, dim, keepdim)``,
    ``std(x, dim, unbiased, keepdim)`` (also ``std(x, unbiased)``), the others ``op(x, dim, keepdim)``."""
    name = op_name(node)
    if name == "norm":
        return arg(node, 2, "dim", None), arg(node, 3, "keepdim", False)
    if name in ("std", "var"):
        dim = arg(node, 1, "dim", None)
        return (None if isinstance(dim, bool) else dim), arg(node, 3, "keepdim", False)
    return arg(node, 1, "dim", None), arg(node, 2, "keepdim", False)


def reduced_dims(dim, ndim):
    """The dims a reduction's ``dim`` argument names (all of them for None), or None if not plain ints."""
    if dim is None:
        return list(range(ndim))
    if isinstance(dim, int):
        return [norm_dim(dim, ndim)]
    if isinstance(dim, (tuple, list)) and all(isinstance(d, int) for d in dim):
        return [norm_dim(d, ndim) for d in dim]
    return None


def _reduce(node, placements, ctx):
    inputs = tensor_inputs(node)
    if len(inputs) != 1 or node.args[0] is not inputs[0]:
        return []
    x = inputs[0]
    p = placements[x]
    strategies = []
    if p.is_shard:
        dim, keepdim = dim_and_keepdim(node)
        dims, keepdim = reduced_dims(dim, ctx.ndim(x)), bool(keepdim)
        shape_keeping = op_name(node) in SHAPE_KEEPING
        if dims is not None and p.dim not in dims:
            out_dim = p.dim if (keepdim or shape_keeping) else p.dim - sum(1 for d in dims if d < p.dim)
            strategies.append(Strategy({x: p}, p.with_dim(out_dim)))
        elif dims is not None and op_name(node) in LINEAR_REDUCTIONS:
            mean = op_name(node) == "mean"
            strategies.append(Strategy({x: p}, P, own_bytes=ctx.bytes_per_token(node),
                                       local=LocalOp.of("mean_of_full", parts=tuple(p.parts(int(ctx.size(x, p.dim))))) if mean else None,
                                       note="partial sum over the sharded dimension"))
    strategies.append(Strategy({x: R}, R))
    return strategies


register(*sorted(REDUCTIONS), blocks=True)(_reduce)
