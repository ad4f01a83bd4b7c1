"""``num_items_in_batch``: transformers.Trainer's loss normalization under gradient accumulation.

With it, transformers' causal-LM loss is the SUM of the call's token losses divided by
``num_items_in_batch`` (the label tokens of every micro-batch of the optimizer step, over the
data-parallel ranks), so that accumulated micro-batches weigh each token equally. The parallel
model's graph computes the mean over the call's own label tokens; the sum is that mean times
their count (``labels[..., 1:] != -100``, as the loss shifts the labels itself)."""
from __future__ import annotations

import torch

from .errors import ArgumentError

IGNORE_INDEX = -100


def check_items_in_batch(num_items_in_batch, labels) -> None:
    """Refuse, naming the argument, what the loss cannot honour (raised after the ranks' exchange)."""
    if num_items_in_batch is None or labels is None:  # without labels there is no loss to normalize (transformers)
        return
    if isinstance(num_items_in_batch, torch.Tensor) and num_items_in_batch.numel() != 1:
        raise ArgumentError(f"num_items_in_batch must be one number, got a tensor of shape "
                            f"{tuple(num_items_in_batch.shape)}")


def loss_over_items(mean_loss: torch.Tensor, labels: torch.Tensor, num_items_in_batch,
                    shifted: bool = False) -> torch.Tensor:
    """The sum of this call's token losses divided by ``num_items_in_batch`` (no host sync); ``shifted``: the
    labels are shifted already (context parallelism: this cp rank's chunks of Trainer's ``shift_labels``, every
    position a target)."""
    count = ((labels if shifted else labels[..., 1:]) != IGNORE_INDEX).sum()
    # a call without label tokens: the mean is 0/0; its sum is 0 (transformers' value)
    total = torch.where(count > 0, mean_loss * count.to(mean_loss.dtype), torch.zeros_like(mean_loss))
    if isinstance(num_items_in_batch, torch.Tensor):
        num_items_in_batch = num_items_in_batch.to(total.device)
    return total / num_items_in_batch
