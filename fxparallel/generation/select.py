"""Choose the next token from logits split by vocabulary over the tp ranks, without gathering them.

Greedy: each rank sends its best (value, global id) per row, 2 numbers; the largest value wins,
the lowest id among equal values (``torch.argmax``'s choice on the full row, since lower ranks hold
lower ids). Top-k sampling (with temperature and top-p after it): each rank sends its own top k
(values and ids); the global top k is among those tp * k candidates, and transformers' warpers run
on the candidates unchanged (a token outside the top k has probability 0 either way). Where other
logits processors need the whole row, the row of the last position only is gathered
(``full_scores``) and transformers' processors run on it unchanged."""
from __future__ import annotations

import torch
import torch.distributed as dist


def vocab_parallel_argmax(local: torch.Tensor, start: int, group) -> torch.Tensor:
    """``local``: [batch, local vocab] scores of this rank's ids ``start ..``; returns [batch] global ids."""
    values, ids = local.max(dim=-1)
    ids = ids + start
    if group is None or group.process_group is None or group.size == 1:
        return ids
    both = torch.stack([values.to(torch.float64), ids.to(torch.float64)])  # [2, batch]; ids exact in float64
    rows = [torch.empty_like(both) for _ in range(group.size)]
    dist.all_gather(rows, both, group=group.process_group)
    table = torch.stack(rows)  # [tp, 2, batch]
    best = table[:, 0].max(dim=0).values
    winner = (table[:, 0] == best).to(torch.int64).argmax(dim=0)  # first (lowest) rank holding the best value
    return table[winner, 1, torch.arange(local.shape[0], device=local.device)].to(torch.long)


def full_scores(local: torch.Tensor, sizes, group) -> torch.Tensor:
    """The whole row of each sequence's scores ([batch, vocab]) from each rank's slice."""
    if group is None or group.process_group is None or group.size == 1:
        return local
    from ..ops import collectives

    uneven = (tuple(sizes),) if sizes and len(set(sizes)) > 1 else None
    return collectives.all_gather(local.contiguous(), local.dim() - 1, group.handle, None, uneven)


def _gather_rows(t: torch.Tensor, group) -> torch.Tensor:
    """[tp, *t.shape]: every rank's ``t``."""
    rows = [torch.empty_like(t) for _ in range(group.size)]
    dist.all_gather(rows, t.contiguous(), group=group.process_group)
    return torch.stack(rows)


def top_k_candidates(local: torch.Tensor, start: int, k: int, group) -> tuple:
    """(scores [batch, tp * k'], global ids [batch, tp * k']) holding every row's global top k."""
    values, ids = local.topk(min(k, local.shape[-1]), dim=-1)
    ids = ids + start
    if group is None or group.process_group is None or group.size == 1:
        return values, ids
    if local.shape[-1] < k:  # a small shard: pad to k so every rank sends the same size
        pad = k - local.shape[-1]
        values = torch.cat([values, values.new_full((values.shape[0], pad), float("-inf"))], dim=-1)
        ids = torch.cat([ids, ids.new_zeros((ids.shape[0], pad))], dim=-1)
    both = torch.cat([values.to(torch.float64), ids.to(torch.float64)], dim=-1)  # ids exact in float64
    table = _gather_rows(both, group)  # [tp, batch, 2k]
    width = values.shape[-1]
    scores = table[..., :width].permute(1, 0, 2).reshape(local.shape[0], -1).to(local.dtype)
    ids = table[..., width:].permute(1, 0, 2).reshape(local.shape[0], -1).to(torch.long)
    return scores, ids
