"""The experts' weights in the runtime when they are spread over data-parallel ranks (``ep_mesh``): FSDP2,
their gradients, and their checkpoints.

Each rank of an ep group holds its own run of the experts (``load/expert_runs.py``), so FSDP, which shards every
parameter over all dp ranks and sums its gradient over them, must leave those weights alone: they are FSDP's
``ignored_params`` (under bf16 mixed precision they stay fp32 master weights, cast for each grouped product by the
exchange itself). Their gradients already sum the rows of every rank of the ep group (the exchange's
backward); the ranks holding the same run in the other dp blocks (``expert_dp_mesh``) add theirs by one
all-reduce (SUM, as FSDP's: ``runtime/loss_normalization.py``) of each backward's gradient.

Checkpoints describe a run to DCP as the pieces of the full tensor it holds (``run_views``): the same keys and
full shapes as without ep (a fused weight split by its parts: one key per part), so a checkpoint saved at one
ep layout loads at any other, or without ep, and back."""
from __future__ import annotations

import torch
import torch.distributed as dist

from ..load.expert_runs import pieces_in_run
from .fused_forms import SEGMENT, described


def check_experts_mesh(model, mesh) -> list:
    """The parameters holding a run of experts (none without ep), after checking the mesh spreads them as
    ``parallelize`` did."""
    ep = getattr(model, "ep_group", None) if getattr(model, "expert_runs", None) else None
    size = ep.size if ep is not None else 1
    if size != getattr(mesh, "ep", 1):
        raise ValueError(f"the model's experts are spread over {size} data-parallel ranks but the mesh has "
                         f"EP_SIZE={mesh.ep}: parallelize with ep_group=mesh.ep_mesh of this mesh")
    if ep is None:
        return []
    return [p for p in model.parameters() if getattr(p, "_fxparallel_expert_run", None)]


def sum_expert_gradients(params: list, mesh) -> None:
    """Sum each expert-run gradient over ``mesh.expert_dp_mesh`` as a backward computes it (nothing with one dp
    block): the hook sees this backward's gradient before it is added to ``.grad``, so gradients accumulated over
    several backwards are each summed once, as FSDP sums the others."""
    if not params or mesh.expert_dp_size == 1:
        return
    group = mesh.expert_dp_mesh.get_group()

    def summed(grad: torch.Tensor) -> torch.Tensor:
        grad = grad.clone()
        dist.all_reduce(grad, group=group)
        return grad

    for param in params:
        param.register_hook(summed)


def run_views(tensor: torch.Tensor, plan_param, run: tuple, mesh) -> dict:
    """{key suffix ("" or ``.segment<i>``): a view telling DCP which pieces of the full tensor ``tensor`` holds}
    for ``tensor`` (an expert-run parameter, or an optimizer state of its shape; ``run``: its (first expert,
    count, experts in the tp shard)): its tp shard's pieces (``ParamPlan.pieces``) cut to the run along dim 0."""
    p = plan_param.placement
    full = list(plan_param.shape)
    starts = [sum(p.segments[:i]) for i in range(len(p.segments))] if p.segments else []
    found: dict = {}
    for src, dst in pieces_in_run(plan_param.pieces(mesh.tp_rank, mesh.tp), run):
        offsets = [s.start for s in src]
        sizes = [s.stop - s.start for s in src]
        view = tensor[dst]
        suffix, shape = "", list(full)
        if starts:  # a fused weight split by its parts: each part is saved as a tensor of its own
            part = max(i for i, start in enumerate(starts) if start <= offsets[p.dim])
            offsets[p.dim] -= starts[part]
            shape[p.dim] = p.segments[part]
            suffix = f"{SEGMENT}{part}"
        found.setdefault(suffix, (shape, []))[1].append((torch.Size(offsets), torch.Size(sizes), view))
    return {suffix: described(pieces, shape, tensor) for suffix, (shape, pieces) in found.items()}
