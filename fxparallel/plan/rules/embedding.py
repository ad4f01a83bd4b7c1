"""Embedding lookup: vocab-parallel (each rank holds a range of rows; ids outside
it give zeros, and the partial results are summed), hidden-parallel, or replicated."""
from __future__ import annotations

import torch
import torch.fx as fx
import torch.nn.functional as F

from ..placement import P, R, S
from .base import Strategy, arg, register


def _vocab_parallel(node: fx.Node, ctx):
    from ...rewrite.functional import vocab_parallel_embedding

    ids, weight = node.args[0], node.args[1]
    padding_idx = arg(node, 2, "padding_idx")
    vocab = ctx.full_size(weight, 0)
    node.target = vocab_parallel_embedding
    node.args = (ids, weight, ctx.shard_start(vocab), ctx.local_size(vocab),
                 padding_idx if isinstance(padding_idx, int) else None)
    node.kwargs = {}


def _embedding(node, placements, ctx):
    ids, w = node.args[0], node.args[1]
    if not isinstance(w, fx.Node) or ctx.fake(w) is None or ctx.fake(w).dim() != 2:
        return []
    vocab, hidden = ctx.fake(w).shape
    last = ctx.fake(node).dim() - 1
    strategies = []
    if ctx.can_split(vocab):
        strategies.append(Strategy({ids: R, w: S(0)}, P, note="vocab-parallel embedding", name="vocab",
                                   own_bytes=ctx.bytes_per_token(node), rewrite=_vocab_parallel))
    if ctx.can_split(hidden):
        strategies.append(Strategy({ids: R, w: S(1)}, S(last), note="hidden-parallel embedding", name="hidden"))
    strategies.append(Strategy({ids: R, w: R}, R, note="replicated embedding", name="replicate"))
    return strategies


register(F.embedding, torch.embedding)(_embedding)
