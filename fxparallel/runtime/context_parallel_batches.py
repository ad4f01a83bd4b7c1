"""Batches for context parallelism: shift labels globally, then give each cp rank its chunks.

Every cp rank of a dp group gets the same rows (``StepBatches`` depends on the dp
rank only) and keeps its load-balanced chunks of the sequence dimension: with S
tokens cut into 2*cp chunks, cp rank i keeps chunks i and 2*cp-1-i
(``fxparallel.ops.context_parallel_attention.chunks_of``). Labels are shifted BEFORE the
split (label t = token t+1, the last one -100): a chunk's loss cannot look at the
next chunk's first token, so the model takes them shifted (see the rewrite module).
"""
from __future__ import annotations

import torch

from ..errors import ContextParallelError
from ..ops.context_parallel_attention import chunks_of

IGNORE_INDEX = -100


def shift_labels(labels: torch.Tensor) -> torch.Tensor:
    """Hugging Face labels (aligned with input_ids) -> the target of each position (last: ignored)."""
    pad = torch.full_like(labels[..., :1], IGNORE_INDEX)
    return torch.cat([labels[..., 1:], pad], dim=-1)


def _check_length(length: int, cp: int) -> int:
    if length % (2 * cp):
        raise ContextParallelError(f"sequence length {length} does not divide into 2*cp = {2 * cp} equal chunks "
                                   f"(context parallelism over {cp} ranks); use a multiple of {2 * cp}")
    return length // (2 * cp)


def split_sequence(x: torch.Tensor, cp_rank: int, cp: int, dim: int = 1) -> torch.Tensor:
    """This cp rank's two chunks of ``x`` along ``dim`` (head chunk, then tail chunk)."""
    c = _check_length(x.shape[dim], cp)
    return torch.cat([x.narrow(dim, j * c, c) for j in chunks_of(cp_rank, cp)], dim=dim)


def unsplit_sequence(parts, dim: int = 1) -> torch.Tensor:
    """The inverse of ``split_sequence``: ``parts[i]`` is cp rank i's piece; returns the whole sequence."""
    cp = len(parts)
    c = parts[0].shape[dim] // 2
    chunks = [None] * (2 * cp)
    for rank, part in enumerate(parts):
        for half, j in enumerate(chunks_of(rank, cp)):
            chunks[j] = part.narrow(dim, half * c, c)
    return torch.cat(chunks, dim=dim)


def split_for_context_parallel(batch: dict, cp_rank: int, cp: int) -> dict:
    """{input_ids, labels (aligned with input_ids)} of a dp rank -> this cp rank's
    {input_ids, labels (shifted), position_ids (global)}, all [b, S / cp]."""
    ids = batch["input_ids"]
    labels = batch.get("labels", ids)
    _check_length(ids.shape[-1], cp)
    positions = torch.arange(ids.shape[-1], device=ids.device).expand(ids.shape)
    return {"input_ids": split_sequence(ids, cp_rank, cp), "labels": split_sequence(shift_labels(labels), cp_rank, cp),
            "position_ids": split_sequence(positions, cp_rank, cp)}
