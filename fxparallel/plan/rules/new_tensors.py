"""A new tensor made from another: ``x.new_empty(*sizes)`` / ``new_zeros`` / ``new_ones``, which reads only ``x``'s
dtype and device. Where the sizes keep ``x``'s size at its sharded dim, the new tensor is sharded like ``x``, its
size there rewritten to the local one: MLA's keys (DeepSeek-V2/V3, Kimi-Linear, MiniCPM3, ...) are a
``kv.new_empty(*kv.shape[:-1], d)`` filled through slices (``keys[..., :n].copy_(k_nope)``,
``rules/cache_writes.py``), so its heads stay split as ``kv``'s are. Otherwise it is replicated, whole."""
from __future__ import annotations

from ..placement import R
from ..size_arguments import spelled_out
from .base import Strategy, register
from .dim_maps import _same
from .views import _view_size


def _new_like(node, placements, ctx):
    x = node.args[0]
    p, out, given = placements[x], ctx.fake(node), ctx.fake(x)
    sizes, _ = spelled_out(node)
    strategies = []
    # the size at the split a literal (Dynamo writes static sizes so), which the rewrite makes this rank's
    if p.is_plain_shard and out is not None and given is not None and out.dim() == given.dim() == len(sizes) \
            and isinstance(sizes[p.dim], int) and _same(sizes[p.dim], given.shape[p.dim]):
        strategies.append(Strategy({x: None}, p, local=_view_size(p.dim, sizes[p.dim]),
                                   note="a new tensor shaped like its input's shard"))
    strategies.append(Strategy({x: None}, R, note="a new tensor, whole"))
    return strategies


register("new_empty", "new_zeros", "new_ones")(_new_like)
