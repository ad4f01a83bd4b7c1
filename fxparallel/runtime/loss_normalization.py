"""Loss normalization: the loss is the mean over every label token of the global batch.

Labels follow the Hugging Face convention: ``labels`` is aligned with ``input_ids``
(usually ``labels == input_ids``) and the model's loss shifts them internally, so
the tokens that count are ``labels[:, 1:] != -100``.

Each rank's model returns the mean over its own tokens. Ranks differ in token
counts (padding, -100 masks), so averaging those means would weight tokens
unequally. Instead each rank backpropagates

    local_mean * local_tokens / global_tokens  (= sum of its token losses / global tokens)

and FSDP SUMS gradients over dp x cp (divide factor 1, ``runtime/fsdp.py``): the
result is the gradient of the global-batch mean, for every (dp, tp, cp) layout.
Tensor-parallel ranks of one dp group see the same batch, so they agree on both
counts; the global count is summed over dp x cp only.

Context parallelism: labels are shifted before the sequence is split
(``runtime/context_parallel_batches.py``), so every position of a chunk counts
(``shifted=True``: ``labels != -100``); the cp ranks' counts add up to the row's.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

IGNORE_INDEX = -100


def label_tokens(labels: torch.Tensor, shifted: bool = False) -> torch.Tensor:
    """Number of tokens the causal LM loss counts (unless ``shifted``, the loss shifts labels itself)."""
    return ((labels if shifted else labels[..., 1:]) != IGNORE_INDEX).sum()


def global_label_count(labels: torch.Tensor, mesh, shifted: bool = False) -> torch.Tensor:
    """Tokens counted by the loss over the whole global batch (sum over dp x cp), as a tensor on the mesh's
    device: reading it is the caller's choice (``train_step`` reads it once, its one host sync per step)."""
    count = label_tokens(labels, shifted).to(mesh.device, torch.int64)  # exact at any count (float32 is not past 2**24)
    if mesh.dp_cp_size > 1:
        dist.all_reduce(count, group=mesh.dp_cp_group)
    return count


def global_label_tokens(labels: torch.Tensor, mesh, shifted: bool = False) -> int:
    """``global_label_count`` as a Python int (a host sync)."""
    return int(global_label_count(labels, mesh, shifted).item())


def refuse_empty_batch(global_tokens: int) -> None:
    if global_tokens <= 0:
        raise ValueError("the global batch has no label tokens (every label is -100)")


def scaled_loss(model, input_ids: torch.Tensor, labels: torch.Tensor, global_tokens, shifted: bool = False,
                **kwargs):
    """Forward; returns (loss to backpropagate, this rank's token-loss sum as a detached tensor).

    ``global_tokens``: an int, or ``global_label_count``'s tensor (then read by nobody here: the caller refuses
    an empty global batch before the backward, as ``train_step`` does). A rank without any label token still runs
    forward and backward (its collectives must match the other ranks'); it contributes zero. Nothing here waits
    for the device: the rank's own count stays a tensor.
    """
    if not isinstance(global_tokens, torch.Tensor):
        refuse_empty_batch(global_tokens)
    local = label_tokens(labels, shifted)
    # with no label token the model's mean would be 0/0: give it one dummy token, weighted by zero below
    labels = labels.clone()
    where = (..., 0 if shifted else 1)
    labels[where] = torch.where(local == 0, torch.zeros_like(labels[where]), labels[where])
    out = model(input_ids=input_ids, labels=labels, **kwargs)
    local = local.to(out.loss.device)
    if isinstance(global_tokens, torch.Tensor):
        global_tokens = global_tokens.to(local.device, torch.float64)
    loss = out.loss * (local.double() / global_tokens).to(out.loss.dtype)  # the ratio rounded once, as a float's
    return loss, (out.loss.detach() * local.to(out.loss.dtype)).float()
