"""Writing into a KV cache: ``cache.index_copy_(dim, positions, new)`` (transformers' StaticCache), and a
linear-attention / state-space layer's state written whole: ``state.copy_(new)`` (its convolution window and
recurrent state: each rank keeps the channels or heads it computes, as the forward splits them; Mamba-2's
convolution window keeps x's channels by heads and B's and C's whole where every rank computes them whole).
A ``copy_`` into a value the graph computed (MLA's keys, filled through slices) writes it as it is placed.

The cache is state the solver places like a parameter (``capture/static_cache.py``): written with the
new keys / values of a sharded attention, it is sharded the same way (each rank caches its own
kv heads); written with replicated ones (more ranks than kv heads), it is replicated. Positions
index the sequence dim, which is never the sharded one."""
from __future__ import annotations

import torch.fx as fx

from ..placement import R
from .base import Strategy, arg, norm_dim, register


def _index_copy(node, placements, ctx):
    cache, dim, positions, new = node.args[0], arg(node, 1, "dim"), arg(node, 2, "index"), arg(node, 3, "source")
    if not isinstance(dim, int):
        return []
    dim = norm_dim(dim, ctx.ndim(cache))
    p = placements[new]
    strategies = []
    if p.is_plain_shard and p.dim != dim:
        strategies.append(Strategy({cache: p, positions: R, new: p}, p, note="cache written by its shard",
                                   name="shard"))
    strategies.append(Strategy({cache: R, positions: R, new: R}, R, note="replicated cache", name="replicate"))
    return strategies


register("index_copy_")(_index_copy)


def _state_copy(node, placements, ctx):
    state, new = node.args[0], arg(node, 1, "src")
    if not isinstance(state, fx.Node) or not isinstance(new, fx.Node):
        return []
    if state.op != "placeholder":  # a computed value (MLA's keys filled through slices, rules/new_tensors.py):
        # written as it is placed, never redistributed (a redistributed copy would take the write, not it)
        kept = placements[state]
        if not (kept.is_replicate or kept.is_plain_shard):
            return []
        return [Strategy({state: kept, new: _source_for(kept, state, new, ctx)}, kept,
                         note="written in place as it is placed", name="in place")]
    p = placements[new]
    strategies = []
    if p.is_shard and p.block is None:
        strategies.append(Strategy({state: p, new: p}, p, note="state written by its shard", name="shard"))
    strategies.append(Strategy({state: R, new: R}, R, note="replicated state", name="replicate"))
    return strategies


register("copy_", whole=True)(_state_copy)


def _source_for(kept, state, new, ctx):
    """What ``copy_`` needs of its source to write ``state``'s shard ``kept``: the same shard, or the source whole
    where it broadcasts along that dim (it lacks it, or has size 1 there), aligned from the right."""
    if kept.is_replicate:
        return R
    dim = kept.dim - (ctx.ndim(state) - ctx.ndim(new))
    return R if dim < 0 or ctx.size(new, dim) == 1 else kept.with_dim(dim)
