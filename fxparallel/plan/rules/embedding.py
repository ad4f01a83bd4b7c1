"""Embedding lookup: vocab-parallel (each rank holds a range of rows; ids outside
it give zeros, and the partial results are summed), hidden-parallel, or replicated."""
from __future__ import annotations

import torch.fx as fx

from ..placement import P, R, S
from .base import LocalOp, Strategy, register


def _embedding(node, placements, ctx):
    ids, w = node.args[0], node.args[1]
    if not isinstance(w, fx.Node) or ctx.fake(w) is None or ctx.fake(w).dim() != 2:
        return []
    vocab, hidden = ctx.fake(w).shape
    last = ctx.fake(node).dim() - 1
    strategies = []
    if ctx.can_split(vocab):
        strategies.append(Strategy({ids: R, w: S(0)}, P, note="vocab-parallel embedding", name="vocab",
                                   own_bytes=ctx.bytes_per_token(node), local=LocalOp.of("vocab_parallel_embedding")))
    if ctx.can_split(hidden):
        strategies.append(Strategy({ids: R, w: S(1)}, S(last), note="hidden-parallel embedding", name="hidden"))
    strategies.append(Strategy({ids: R, w: R}, R, note="replicated embedding", name="replicate"))
    return strategies


register("embedding")(_embedding)
