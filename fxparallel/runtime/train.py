"""One training step over the mesh: global-token loss, backward, clipping, optimizer step."""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist

from .clip import clip_grad_norm_, global_grad_norm
from .loss import global_label_tokens, scaled_loss


@dataclass
class StepMetrics:
    loss: float  # mean over every label token of the global batch
    grad_norm: float  # global norm before clipping
    tokens: int  # input tokens in the global batch
    seconds: float

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else float("nan")


def check_context_parallel(model, mesh) -> None:
    """CP needs the model's graph to split sequences (ring attention, position offsets);
    refuse cp > 1 until the model says it supports it."""
    if mesh.cp > 1 and not getattr(model, "supports_context_parallel", False):
        raise NotImplementedError(
            f"context parallelism (CP_SIZE={mesh.cp}) is not implemented yet: the parallelized graph does not split "
            "the sequence dimension. Run with CP_SIZE=1 (e.g. put the ranks into DP_SIZE instead)."
        )


def train_step(model, optimizer, batch: dict, mesh, *, max_norm: Optional[float] = None) -> StepMetrics:
    """Run one step on this rank's part of the global batch; every rank returns the same metrics."""
    start = time.perf_counter()
    optimizer.zero_grad(set_to_none=True)
    ids = batch["input_ids"].to(mesh.device)
    labels = batch.get("labels", batch["input_ids"]).to(mesh.device)
    global_tokens = global_label_tokens(labels, mesh)
    loss, local_sum = scaled_loss(model, ids, labels, global_tokens)
    loss.backward()
    if max_norm is not None and max_norm > 0:
        norm = clip_grad_norm_(model, max_norm, mesh)
    else:
        norm = global_grad_norm(model, mesh)
    optimizer.step()
    total = local_sum.to(mesh.device, torch.float32)
    if mesh.dp_cp_size > 1:
        dist.all_reduce(total, group=mesh.dp_cp_group)
    if mesh.device.type == "cuda":
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    return StepMetrics(loss=total.item() / global_tokens, grad_norm=norm.item(),
                       tokens=ids.numel() * mesh.dp_cp_size, seconds=seconds)
