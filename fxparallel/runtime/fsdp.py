"""Data parallelism over dp x cp with FSDP2, on top of the tensor-parallel shards.

Order of composition: ``parallelize`` first (each rank holds its TP shard as a plain
tensor), then ``apply_data_parallel`` (FSDP2 shards each TP shard over the dp x cp
ranks of its tp position along dim 0). Every rank of a dp x cp group holds the same
TP position, so the shards FSDP splits have the same shape on all of them.

FSDP units: one per decoder layer, plus the root. ``parallelize`` splits each local
graph by decoder layer (``ops/layer_units.py``): the root code calls the module at
``model.layers.{i}`` and that module runs its layer's piece, reading its parameters from
itself. ``fully_shard`` goes on each module ``model.fsdp_units()`` lists, then on the root
(embeddings, tied head, final norm). So a layer's parameters are all-gathered in its
forward pre-hook and freed after it (and again around its backward): one layer is
unsharded at a time in forward, two in backward (FSDP prefetches the next one), plus the
root, instead of the whole model (``benchmarks/fsdp_memory.py``). ``per_layer=False``, or a graph
that could not be split by layer (a warning says why), gives the root unit alone.
Layer units do not cast their inputs under mixed precision: the values crossing layers
are exactly those of the unsplit graph, already in the dtype it was captured in.

Experts spread over dp ranks (``ep_mesh``) stay outside FSDP: ``runtime/experts_over_dp.py``.

Gradient reduction: FSDP reduces with a plain SUM over dp x cp (divide factor 1).
The loss convention that makes the sum right is in ``runtime/loss_normalization.py``: each rank
backpropagates ``sum of its token losses / tokens in the global batch``, so the
summed gradient is the gradient of the global-batch mean, whatever the layout.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

MODES = ("shard", "replicate")
MIXED_PRECISION = {None: None, "none": None, "fp32": None, "bf16": torch.bfloat16, "bfloat16": torch.bfloat16,
                   "fp16": torch.float16, "float16": torch.float16}


@dataclass(frozen=True)
class DataParallelInfo:
    mode: str
    param_dtype: Optional[torch.dtype]
    units: int  # number of fully_shard calls (per-layer units + root)
    forward_group: Optional[object] = None  # shard mode: the dp x cp process group a forward all-gathers over


def _fsdp_mesh(mesh, mode: str):
    """FSDP's mesh: dp x cp (shard), or 2-D (replicate, shard): HSDP with ``mesh.dp_replicate`` replicas of each
    shard group (``DP_SHARD_SIZE``), or (dp x cp, 1) in replicate mode, which keeps whole TP shards on every rank."""
    if mode == "replicate":
        return mesh.unflattened("dp_cp", mesh.dp_cp_size)
    return mesh.dp_cp_mesh if mesh.dp_replicate == 1 else mesh.unflattened("dp_cp", mesh.dp_replicate)


def _prepare_mixed_precision(model, param_dtype) -> None:
    """The generated graph has its capture dtype baked in (e.g. RMSNorm's cast back to the
    input dtype), so it must have been captured in the compute dtype: parallelize with
    ``dtype=param_dtype``. The parameters then become fp32 master weights here; FSDP casts
    them to ``param_dtype`` for each forward."""
    graph_dtype = getattr(model, "dtype_", None)
    if graph_dtype != param_dtype:
        raise ValueError(
            f"mixed precision {param_dtype} needs a model captured in {param_dtype}, but it was parallelized with "
            f"dtype={graph_dtype}: call fxparallel.parallelize(..., dtype={param_dtype}) (the weights become fp32 "
            "master copies here)"
        )
    with torch.no_grad():
        for _, param in model.local_named_parameters():
            if param.dtype != torch.float32:
                param.data = param.data.float()


def apply_data_parallel(model, mesh, *, mode: str = "shard", mixed_precision: Optional[str] = None,
                        reshard_after_forward: Optional[bool] = None, per_layer: bool = True):
    """Wrap ``model`` (a ParallelCausalLM) with FSDP2 over ``mesh.dp_cp_mesh``; returns it.

    ``mode``: "shard" (FSDP: parameters, gradients and optimizer states split over
    dp x cp; HSDP where ``init_mesh(dp_shard=...)`` / ``DP_SHARD_SIZE`` is below dp: split over each
    group of dp_shard x cp ranks, replicated over the groups) or "replicate" (every rank keeps whole
    TP shards; gradients all-reduced).
    ``mixed_precision``: None (compute in the parameters' dtype) or "bf16" (bf16
    compute and all-gathers, fp32 gradient reduction and master weights; the model
    must come from ``parallelize(..., dtype=torch.bfloat16)``, see
    ``_prepare_mixed_precision``).
    ``per_layer``: one FSDP unit per decoder layer plus the root (default), or the root only.
    """
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    from ..dtensor_parameters import dtensor_views
    from ..shard_parameter import guard_fsdp_parameters
    from .experts_over_dp import check_experts_mesh, sum_expert_gradients
    from .train import check_context_parallel

    check_context_parallel(model, mesh)
    if dtensor_views(model):
        raise ValueError("apply_data_parallel: this model's parameters are DTensor views for transformers.Trainer / "
                         "accelerate (model.tp_size was read), which train one tensor-parallel group without FSDP; "
                         "for dp x tp, apply it to a model nothing has handed to Trainer, and train with "
                         "fxparallel.runtime.train_step")
    if mode not in MODES:
        raise ValueError(f"data parallel mode must be one of {MODES}, got {mode!r}")
    if mixed_precision not in MIXED_PRECISION:
        raise ValueError(f"mixed_precision must be one of {sorted(k for k in MIXED_PRECISION if k)} or None, "
                         f"got {mixed_precision!r}")
    experts = check_experts_mesh(model, mesh)  # a run of experts per ep rank: not FSDP's
    param_dtype = MIXED_PRECISION[mixed_precision]
    if param_dtype is not None:
        _prepare_mixed_precision(model, param_dtype)
    reduce_dtype = torch.float32 if param_dtype else None
    root_policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    unit_policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype, cast_forward_inputs=False)
    dp_mesh = _fsdp_mesh(mesh, mode)
    units = list(getattr(model, "fsdp_units", lambda: [])()) if per_layer else []
    for unit in units:
        fully_shard(unit, mesh=dp_mesh, mp_policy=unit_policy, reshard_after_forward=reshard_after_forward,
                    ignored_params=set(experts))
    fully_shard(model, mesh=dp_mesh, mp_policy=root_policy, reshard_after_forward=reshard_after_forward,
                ignored_params=set(experts))
    sum_expert_gradients(experts, mesh)
    for module in units + [model]:
        # SUM over dp x cp: the loss is already divided by the global token count (runtime/loss_normalization.py).
        module.set_gradient_divide_factor(1.0)
        module.set_force_sum_reduction_for_comms(True)  # no PREMUL_SUM (gloo lacks it; factor 1 needs no scaling)
    guard_fsdp_parameters(model)  # torch's clip_grad_norm_ / GradScaler over a list of them: refused at tp > 1
    forward_group = mesh.dp_cp_mesh.get_group() if mode == "shard" and mesh.dp_cp_size > 1 else None
    model._fxparallel_data_parallel = DataParallelInfo(mode, param_dtype, len(units) + 1, forward_group)
    return model


def is_data_parallel(model) -> bool:
    """Is ``model`` under ``apply_data_parallel`` (its parameters FSDP DTensors)?"""
    return getattr(model, "_fxparallel_data_parallel", None) is not None


def reshard(model) -> None:
    """Register the sharded parameters again on every FSDP unit of ``model``.

    The root unit keeps its unsharded parameters after a forward (reshard_after_forward
    is False for the root) until a backward frees them; after a forward without
    backward (evaluation, logits) ``named_parameters()`` would return those temporary
    full tensors. Checkpointing and export call this first so they see, and write
    into, the sharded parameters the optimizer owns.
    """
    from torch.distributed.fsdp import FSDPModule

    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()
