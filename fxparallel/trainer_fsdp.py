"""fxparallel's FSDP (``runtime.apply_data_parallel``) trained by ``transformers.Trainer`` / accelerate over dp x tp,
as transformers' own models sharded at load time with FSDP2 (``DistributedConfig(tp_size=..., fsdp_size=...)``) are.

From Trainer's first read of ``model.tp_size`` (``dtensor_parameters.use_dtensor_parameters``):

- the model reports ``config.distributed_config = DistributedConfig(tp_size=tp, fsdp_size=dp_shard,
  dp_replicate_size=dp // dp_shard)``, so Trainer leaves it unwrapped, splits the data over dp only and builds its
  optimizer on FSDP's sharded parameters; between the micro-batches of gradient accumulation Trainer holds FSDP's
  reduction back itself (HSDP's all-reduce alone where there are replicas), and accelerate's own loop enters
  ``model.no_sync()`` (``deferred_reduction``);
- Trainer multiplies the loss by the dp size (its convention for a model whose data parallelism averages), so FSDP's
  reduced gradients are now divided by the dp size (``_averaging``), as FSDP2's default averages.
  ``apply_data_parallel`` had them summed, for ``runtime.train_step``, whose loss is divided by the global token
  count: ``train_step`` refuses such a model;
- clipping: FSDP's DTensors span the dp ranks only, each holding chunks of this rank's tp shard, so torch's
  ``clip_grad_norm_`` over them would sum squares over dp alone: each tp rank its own norm, the replicated weights
  drifting apart. Iterated by a clipping function (accelerate's ``clip_grad_norm_``, torch's), the model answers a
  DTensor view of each over the (dp, tp) mesh instead: FSDP's placement, then ``Shard`` over tp where the plan splits
  the weight, else ``Replicate``; its gradient a view of FSDP's gradient. The norm is then the whole model's (one
  all-reduce) and the clip scales FSDP's gradients in place. The views serve the norm only: their global layout is
  not the weight's, and nothing else is given them.

Under HSDP (``init_mesh(dp_shard=...)`` below dp) the views are over (dp_replicate, dp_shard, tp): FSDP's
``(Replicate, Shard(0))`` and then the tp placement.

Supported: FSDP or HSDP over the dp ranks (``mode="shard"``; no context parallelism, no experts over dp)."""
from __future__ import annotations

import contextlib
from typing import Optional

import torch

from .callers import functions_on_stack

CLIPPERS = (("torch.nn.utils.clip_grad", None), ("accelerate.accelerator", "clip_grad_norm_"))
MARK = "_fsdp_under_trainer"  # model.__dict__: the DeviceMesh of the clipping views, once in the mode


def enter(model, mesh, who: str, instead: str) -> None:
    """Put a model under ``apply_data_parallel`` in Trainer's hands (see the module docstring); ``mesh``: the
    (dp, tp) DeviceMesh of the job (``trainer_data_parallel.view_mesh``). Refused, naming what is supported, for
    another FSDP layout."""
    import torch.distributed as dist
    from torch.distributed.fsdp import FSDPModule
    from transformers.distributed import DistributedConfig

    from .dtensor_parameters import DTensorParametersError

    info = model._fxparallel_data_parallel
    fsdp_mesh = next(p for _, p in model.local_named_parameters()).device_mesh
    dp_ranks = dist.get_process_group_ranks(mesh.get_group(0))
    if info.mode != "shard" or fsdp_mesh.mesh.flatten().tolist() != dp_ranks:
        raise DTensorParametersError(
            f"{who} on a model under fxparallel's FSDP supports FSDP (or HSDP) over the data-parallel ranks only "
            "(apply_data_parallel(model, mesh) in its default mode, without context parallelism); this model's "
            f"FSDP mesh is {fsdp_mesh} in mode {info.mode!r}: {instead}")
    average = _averaging(len(dp_ranks))
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_all_reduce_hook(average)
    replicas = 1
    if fsdp_mesh.ndim == 2:  # HSDP: the views' mesh (dp_replicate, dp_shard, tp), FSDP's dims then the tp one
        from torch.distributed.device_mesh import DeviceMesh

        replicas = fsdp_mesh.shape[0]
        mesh = DeviceMesh(mesh.device_type, mesh.mesh.reshape(*fsdp_mesh.shape, -1),
                          mesh_dim_names=("dp_replicate", "dp_shard", mesh.mesh_dim_names[1]))
    model.__dict__[MARK] = mesh
    # (Trainer defers HSDP's all-reduce alone between micro-batches where dp_replicate_size > 1)
    model.config.distributed_config = DistributedConfig(tp_size=model.tp_group.size,
                                                        fsdp_size=len(dp_ranks) // replicas,
                                                        dp_replicate_size=replicas)


def _averaging(dp: int):
    """FSDP's hook on each reduced gradient (after HSDP's all-reduce, or FSDP's reduce-scatter): the sum over the dp
    ranks divided by ``dp``. (Not ``set_gradient_divide_factor(dp)``: with the sum reductions gloo needs, FSDP2
    divides twice where its reduce-scatter group has one rank, as HSDP with ``dp_shard=1`` has: half the gradient.)"""
    def average(gradient: torch.Tensor) -> None:
        gradient.div_(dp)

    return average


@contextlib.contextmanager
def deferred_reduction(model):
    """``model.no_sync()``, which accelerate enters between the micro-batches of gradient accumulation: FSDP keeps
    their gradients unsharded and reduces the sum in the next backward outside it, one reduction per optimizer step
    (``set_requires_gradient_sync``, as Trainer defers transformers' own FSDP2 models)."""
    model.set_requires_gradient_sync(False)
    try:
        yield
    finally:
        model.set_requires_gradient_sync(True)


def under_trainer(model) -> bool:
    """Is ``model`` (under ``apply_data_parallel``) in Trainer's hands, its FSDP averaging over dp?"""
    return model.__dict__.get(MARK) is not None


def _clipping() -> bool:
    """Is a clipping function (``CLIPPERS``) iterating the parameters? Frames above this one: ``clip_views``, the
    model's ``named_parameters``, nn.Module's ``parameters``, the clipping function."""
    for module, function in CLIPPERS:
        names = functions_on_stack(module, limit=5)
        if names and (function is None or function in names):
            return True
    return False


def clip_views(model) -> Optional[dict]:
    """{id(FSDP parameter): its view over the (dp, tp) mesh (HSDP's: (dp_replicate, dp_shard, tp)), its gradient
    included} while a clipping function iterates the parameters of a model in the mode; else None."""
    mesh = model.__dict__.get(MARK)
    if mesh is None or not _clipping():
        return None
    from torch.distributed.tensor import DTensor, Replicate, Shard

    views = {}
    for name, param in model.local_named_parameters():
        placement = model.plan.param(name).placement
        placements = [*param.placements, Shard(placement.dim) if placement.is_shard else Replicate()]
        view = torch.nn.Parameter(DTensor.from_local(param._local_tensor, mesh, placements, run_check=False),
                                  requires_grad=param.requires_grad)
        if param.grad is not None:
            view.grad = DTensor.from_local(param.grad._local_tensor, mesh, placements, run_check=False)
        views[id(param)] = view
    return views
