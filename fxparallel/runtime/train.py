"""One training step over the mesh: global-token loss, backward, clipping, optimizer step.

With cp > 1 the step first keeps this cp rank's chunks of the batch (``runtime/context_parallel_batches.py``):
the loss is still the mean over every label token of the global batch.
"""
from __future__ import annotations

import functools
import time
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist

from ..inputs import read_with_argument_check
from ..trainer_fsdp import under_trainer
from .clip import clip_grad_norm_, global_grad_norm
from .context_parallel_batches import split_for_context_parallel
from .loss_normalization import global_label_count, refuse_empty_batch, scaled_loss


@dataclass
class StepMetrics:
    """What a step measured. ``loss`` and ``grad_norm`` are read from the device when first asked for (on a GPU
    that waits for the step's kernels): a loop that logs every n-th step syncs only then."""

    _values: torch.Tensor  # [loss sum over the global batch, grad norm], on the device
    global_tokens: int  # label tokens in the global batch
    tokens: int  # input tokens in the global batch
    seconds: float  # host time of the call (on a GPU: until the step was queued, unless a metric was read)

    @functools.cached_property
    def _floats(self) -> tuple:
        loss_sum, norm = self._values.tolist()
        return loss_sum / self.global_tokens, norm

    @property
    def loss(self) -> float:
        """Mean over every label token of the global batch."""
        return self._floats[0]

    @property
    def grad_norm(self) -> float:
        """Global gradient norm before clipping."""
        return self._floats[1]

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else float("nan")


def check_context_parallel(model, mesh) -> None:
    """With cp > 1 the model must have been parallelized over the mesh's cp group
    (its attention then spans the cp ranks); refuse a model that was not."""
    model_cp = getattr(model, "cp_size", 1)
    if model_cp != mesh.cp:
        raise ValueError(
            f"the mesh has CP_SIZE={mesh.cp} but the model was parallelized for context-parallel size {model_cp}: "
            "call fxparallel.parallelize(..., cp_group=mesh.cp_mesh)"
        )


def train_step(model, optimizer, batch: dict, mesh, *, max_norm: Optional[float] = None) -> StepMetrics:
    """Run one step on this rank's part of the global batch; every rank returns the same metrics.

    ``batch``: this dp rank's rows, ``input_ids`` and Hugging Face ``labels`` (aligned with
    ``input_ids``). With cp > 1 each cp rank keeps its load-balanced chunks of them here
    (labels shifted first, global position_ids), so the sequence length must divide by 2*cp.
    ``model`` may be ``torch.compile(model)``: the forward runs compiled, the rest reads the model in it.
    """
    start = time.perf_counter()
    optimizer.zero_grad(set_to_none=True)
    extra = {}
    forward, model = model, getattr(model, "_orig_mod", model)  # torch.compile's wrapper keeps the model there
    if under_trainer(model):
        raise ValueError("train_step: this model was handed to transformers.Trainer / accelerate (model.tp_size was "
                         "read), whose FSDP gradients average over the data-parallel ranks where train_step's loss "
                         "expects them summed; train it with one of the two, on a model apply_data_parallel "
                         "wrapped afresh")
    check_context_parallel(model, mesh)
    if mesh.cp > 1:
        batch = split_for_context_parallel(batch, mesh.cp_rank, mesh.cp)
        extra["position_ids"] = batch["position_ids"].to(mesh.device)
    ids = batch["input_ids"].to(mesh.device)
    labels = batch.get("labels", batch["input_ids"]).to(mesh.device)
    shifted = mesh.cp > 1
    count = global_label_count(labels, mesh, shifted=shifted)
    # the step's one host sync: the count is read with the forward's argument check (inputs.py), and an empty
    # global batch is refused before the backward, so before anything changes
    with read_with_argument_check(count) as read:
        loss, local_sum = scaled_loss(forward, ids, labels, count, shifted=shifted, **extra)
    global_tokens = read["value"] if "value" in read else int(count.item())
    refuse_empty_batch(global_tokens)
    loss.backward()
    if max_norm is not None and max_norm > 0:
        norm = clip_grad_norm_(model, max_norm, mesh)
    else:
        norm = global_grad_norm(model, mesh)
    optimizer.step()
    total = local_sum.to(mesh.device, torch.float32)
    if mesh.dp_cp_size > 1:
        dist.all_reduce(total, group=mesh.dp_cp_group)
    values = torch.stack([total.reshape(()), norm.to(mesh.device, torch.float32).reshape(())])
    return StepMetrics(values, global_tokens, tokens=ids.numel() * mesh.dp_cp_size,
                       seconds=time.perf_counter() - start)
