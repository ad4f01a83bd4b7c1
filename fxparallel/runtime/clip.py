"""Gradient clipping by the true global norm over every mesh dimension.

Each element of the full model's gradient must be counted exactly once:

* TP-sharded parameters (``S(d)``): every tp rank holds a different slice, so their
  squares are summed over tp.
* TP-replicated parameters (``R``): every tp rank holds the same complete gradient,
  so only tp rank 0 contributes (summing over tp would count them tp times). The
  whole segments of a fused weight (``S(0)[64,8R,8R]``) are the same: tp rank 0 only.
* FSDP shards (DTensor ``Shard(0)`` over dp x cp) are disjoint: summed over dp x cp.
  In replicate mode (or without FSDP) every dp x cp rank holds the same gradient,
  so only dp x cp rank 0 contributes; under HSDP only the first replica of each shard.
* A run of experts (experts over dp ranks, ``runtime/experts_over_dp.py``) is disjoint within its ep group
  and the same on the ranks holding the same run (``expert_dp_mesh``): only the first of those counts it.

The sum of squares is then one all-reduce over the whole world.
"""
from __future__ import annotations

import math

import torch
import torch.distributed as dist

from .dtensor import first_replica, fsdp_rows, local_part


def _grads_with_multiplicity(model, mesh):
    """(local gradient tensor, counts here?, [its whole-segment rows, counted elsewhere]) for every
    parameter with a gradient."""
    out = []
    for name, param in model.named_parameters():
        if param.grad is None:
            continue
        plan = model.plan.param(name)
        tp_replicated = not plan.placement.is_shard
        grad = local_part(param.grad)
        if getattr(param, "_fxparallel_expert_run", None):
            out.append((grad, (not tp_replicated or mesh.tp_rank == 0) and mesh.expert_dp_rank == 0, []))
            continue
        counts = (not tp_replicated or mesh.tp_rank == 0) and first_replica(param.grad, mesh)
        out.append((grad, counts, _whole_rows(plan, param.grad, mesh) if mesh.tp_rank else []))
    return out


def _whole_rows(plan, sharded, mesh) -> list:
    """The parts of this rank's gradient of ``plan``'s parameter (``sharded``: FSDP's DTensor, or the plain tensor)
    that are whole segments, as views of its local part: the same on every tp rank."""
    p = plan.placement
    if not p.whole:
        return []
    grad = local_part(sharded)
    pieces = plan.pieces(mesh.tp_rank, mesh.tp)
    ranges = [(pieces[i][1][p.dim].start, pieces[i][1][p.dim].stop) for i in p.whole]
    offset = 0
    if p.dim == 0:  # FSDP holds one torch.chunk of the tp shard's rows (all of them without FSDP)
        offset = fsdp_rows(sharded, plan.local_shape(mesh.tp, mesh.tp_rank)[0])[0]
    views = []
    for start, stop in ranges:
        start, stop = max(start - offset, 0), min(stop - offset, grad.shape[p.dim])
        if stop > start:
            views.append(grad.narrow(p.dim, start, stop - start))
    return views


def global_grad_norm(model, mesh, norm_type: float = 2.0) -> torch.Tensor:
    """The norm of the full model's gradient (same value on every rank)."""
    grads = _grads_with_multiplicity(model, mesh)
    norm_type = float(norm_type)
    device = mesh.device
    if math.isinf(norm_type):
        local = torch.zeros((), dtype=torch.float32, device=device)
        for g, _, _ in grads:  # max is insensitive to counting twice
            if g.numel():
                local = torch.maximum(local, g.detach().abs().max().float())
        dist.all_reduce(local, op=dist.ReduceOp.MAX)
        return local
    total = torch.zeros((), dtype=torch.float64 if device.type == "cpu" else torch.float32, device=device)
    for g, counts, counted_elsewhere in grads:
        if counts and g.numel():
            total += g.detach().float().abs().pow(norm_type).sum().to(total.dtype)
            for part in counted_elsewhere:
                total -= part.detach().float().abs().pow(norm_type).sum().to(total.dtype)
    dist.all_reduce(total)
    return total.pow(1.0 / norm_type).float()


def clip_grad_norm_(model, max_norm: float, mesh, norm_type: float = 2.0) -> torch.Tensor:
    """Scale every gradient so the global norm is at most ``max_norm``; returns the norm before clipping.

    Like ``torch.nn.utils.clip_grad_norm_`` (coefficient ``max_norm / (norm + 1e-6)``,
    capped at 1), but over the sharded model.
    """
    norm = global_grad_norm(model, mesh, norm_type)
    coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
    grads = [local_part(p.grad) for p in model.parameters() if p.grad is not None]
    if grads:
        torch._foreach_mul_(grads, coef.to(grads[0].device, grads[0].dtype))
    return norm
