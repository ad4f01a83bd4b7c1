"""Vocab-parallel embedding and cross-entropy: the ops that let logits stay sharded."""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ..group import group_by_handle


def vocab_parallel_embedding(ids, weight, start: int, length: int, padding_idx=None):
    """Look up the rows this rank holds; other ids give zeros (summed over ranks later)."""
    outside = (ids < start) | (ids >= start + length)
    local = (ids - start).masked_fill(outside, 0)
    if padding_idx is not None:
        padding_idx = padding_idx - start if start <= padding_idx < start + length else None
    out = F.embedding(local, weight, padding_idx)
    return out.masked_fill(outside.unsqueeze(-1), 0.0)


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target, start, handle, ignore_index):
        group = group_by_handle(handle)
        logits = logits.float()
        n, local_vocab = logits.shape
        local_max = logits.max(dim=1).values
        shifted = logits - local_max.unsqueeze(1)
        local_lse = torch.log(torch.exp(shifted).sum(dim=1)) + local_max
        local_target = target - start
        mine = (local_target >= 0) & (local_target < local_vocab) & (target != ignore_index)
        idx = local_target.clamp(0, local_vocab - 1)
        target_logit = torch.where(mine, logits.gather(1, idx.unsqueeze(1)).squeeze(1), torch.zeros_like(local_max))
        stats = torch.stack([local_lse, target_logit], dim=0)  # [2, n]
        if group.size > 1:
            parts = [torch.empty_like(stats) for _ in range(group.size)]
            dist.all_gather(parts, stats.contiguous(), group=group.process_group)
            gathered = torch.stack(parts, dim=0)  # [tp, 2, n]
        else:
            gathered = stats.unsqueeze(0)
        lse = torch.logsumexp(gathered[:, 0], dim=0)
        target_logit = gathered[:, 1].sum(dim=0)
        valid = target != ignore_index
        loss = torch.where(valid, lse - target_logit, torch.zeros_like(lse))
        ctx.save_for_backward(logits, lse, idx, mine, valid)
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        logits, lse, idx, mine, valid = ctx.saved_tensors
        probs = torch.exp(logits - lse.unsqueeze(1))
        probs.scatter_add_(1, idx.unsqueeze(1), -mine.to(probs.dtype).unsqueeze(1))
        grad = probs * (grad_loss * valid.to(grad_loss.dtype)).unsqueeze(1)
        return grad, None, None, None, None


def vocab_parallel_cross_entropy(logits, target, start: int, handle: int, ignore_index: int = -100,
                                 reduction: str = "mean"):
    """F.cross_entropy over logits whose class dimension is sharded across the group."""
    per_token = _VocabParallelCrossEntropy.apply(logits, target, start, handle, ignore_index)
    per_token = per_token.to(logits.dtype) if logits.dtype != torch.float32 else per_token
    if reduction == "none":
        return per_token
    if reduction == "sum":
        return per_token.sum()
    count = (target != ignore_index).sum()
    return per_token.sum() / count


vocab_parallel_cross_entropy.FORWARD, vocab_parallel_cross_entropy.BACKWARD = "all_gather", None
