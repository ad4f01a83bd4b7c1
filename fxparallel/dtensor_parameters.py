"""The parallel model's parameters seen as DTensors over the tensor-parallel group: how
``transformers.Trainer`` and accelerate train it exactly.

transformers' own tensor-parallel models hold DTensor parameters, and the tools around them rely on it:
Trainer clips with ``clip_grad_norm_(model.parameters(), max_grad_norm)``, which is the norm of the whole
model's gradient only over DTensor gradients. Over plain tensors it is each rank's own norm: the ranks
clip by different factors (silently), and replicated weights drift apart.

The graphs run on plain local tensors, so the registered parameters stay plain. In this mode
``named_parameters()`` / ``parameters()`` answer with a DTensor view of each (``DTensor.from_local`` on
the same storage, placement ``Shard(d)`` or ``Replicate()`` from the plan): an optimizer built on them
updates the model's own shards in place (one built earlier on the plain parameters is re-pointed at the views
when it steps: ``optimizer_views.py``). After each backward a hook moves the gradient of every plain
parameter onto its view (no copy the first time, an in-place add under gradient accumulation), so
``clip_grad_norm_`` sums the shards' squares over the group once and counts replicated weights once: one
all-reduce, the same total norm on every rank.

The mode starts when Trainer or accelerate reads ``model.tp_size`` (transformers' sign that a model was
sharded before they saw it; they then leave it unwrapped, no DistributedDataParallel, and give every tp
rank the same batch), when torch's ``clip_grad_norm_`` iterates ``model.parameters()`` at tp > 1 (a loop of
one's own; ``views_for_clipping``), or with ``use_dtensor_parameters(model)``. Only placements DTensor can state are
allowed: a fused weight of equal parts (gate / up) is a ``_StridedShard`` (``trainer_placement``); one of unequal
parts (q / k / v with fewer kv heads) or an uneven split is refused naming the parameter, before anything
changes.

Data parallelism around the tp group (world = dp x tp, the model parallelized over the tp sub-mesh of the job's
mesh): the views are DTensors over the (dp, tp) mesh, ``Replicate()`` over dp, and their gradients are averaged
over dp once per optimizer step (``trainer_data_parallel.py``); Trainer learns the dp size from
``config.distributed_config`` (``DistributedConfig(tp_size, dp_replicate_size)``) and splits the data over dp only.
A model under fxparallel's FSDP (``runtime.apply_data_parallel``) keeps FSDP's parameters instead, and answers views
only while it is clipped (``trainer_fsdp.py``)."""
from __future__ import annotations

import functools

import torch
import torch.distributed as dist

from .errors import GroupError
from .optimizer_views import follow_view
from .trainer_data_parallel import DataParallelGradients, view_mesh


class DTensorParametersError(GroupError):
    """The parallel model cannot present its parameters as DTensors (placement, data parallelism)."""


def dtensor_views(model):
    """{id(plain parameter): its DTensor view}, or None outside the mode."""
    return model.__dict__.get("_dtensor_views")


TRAINER = ("transformers.Trainer / accelerate", "train it with fxparallel.runtime.train_step")
CLIPPING = "torch.nn.utils.clip_grad"  # the module of torch's clip_grad_norm_
_CLIPPING_USER = ("torch.nn.utils.clip_grad_norm_(model.parameters(), ...) (over the plain shards each rank would "
                  "clip by its own norm)", "clip with fxparallel.runtime.clip_grad_norm_(model, max_norm, mesh), as "
                  "fxparallel.runtime.train_step does")


def use_dtensor_parameters(model, user: tuple = TRAINER) -> None:
    """Enter the mode (see the module docstring); once per model, a no-op afterwards. ``user``: (who needs the
    views, what to do instead), for the refusals."""
    if dtensor_views(model) is not None:
        return
    from torch.distributed.tensor import DTensor, Replicate
    from transformers.distributed import DistributedConfig

    from .runtime.dtensor import contiguous_stride

    who, instead = user
    group = model.tp_group
    if model.cp_group is not None and user is not TRAINER:  # (Trainer's context parallelism: trainer_context_parallel.py)
        raise DTensorParametersError(f"{who} with context parallelism (cp_group) is not supported: {instead}")
    if getattr(model, "expert_runs", None):  # (the dp ranks of an ep group hold other experts: no view states that)
        raise DTensorParametersError(f"{who} with experts over data-parallel ranks (ep_group) is not supported: "
                                     f"{instead}")
    from .runtime.fsdp import is_data_parallel

    if model.cp_group is not None:  # Trainer's context-parallel steps (trainer_context_parallel.py)
        from .trainer_context_parallel import enter_trainer

        enter_trainer(model)
    if user is TRAINER and is_data_parallel(model):
        if model.cp_group is not None:
            raise DTensorParametersError(
                f"{who} with context parallelism on a model under fxparallel's FSDP (apply_data_parallel) is not "
                "supported: hand Trainer the model without apply_data_parallel (its dp and cp ranks then keep whole "
                f"tp shards and average their gradients), or {instead}")
        from .trainer_fsdp import enter

        enter(model, view_mesh(model, who), who, instead)  # fxparallel's FSDP in Trainer's hands: trainer_fsdp.py
        model.__dict__["_dtensor_views"] = {}  # (no views but the clipping ones)
        return
    placements = {}
    for name, param in model.local_named_parameters():
        if isinstance(param, DTensor):
            raise DTensorParametersError(
                f"{name} is already a DTensor (fxparallel.runtime.apply_data_parallel sharded it over the data-parallel "
                f"ranks): {who} cannot work on a model under fxparallel's FSDP; {instead}")
        try:
            placements[id(param)] = trainer_placement(model.plan.param(name), group.size)
        except NotImplementedError as err:
            raise DTensorParametersError(
                f"{who} needs the parallel model's parameters as DTensors, and {err}: DTensor has no placement for "
                f"it. {instead[0].upper()}{instead[1:]} (every placement is handled there), or choose a tp size "
                "without such shards") from None
    mesh = view_mesh(model, who)
    over_dp = [Replicate()] * (mesh.ndim - 1)
    views = {}
    for name, param in model.local_named_parameters():
        full = tuple(model.plan.param(name).shape)
        view = torch.nn.Parameter(
            DTensor.from_local(param.detach(), mesh, over_dp + [placements[id(param)]], run_check=False, shape=full,
                               stride=contiguous_stride(full)), requires_grad=param.requires_grad)
        views[id(param)] = view
        follow_view(param, view)  # an optimizer built on the plain parameter before now steps the view
    dp = DataParallelGradients(mesh.get_group(0), list(views.values())) if mesh.ndim == 2 else None
    for _, param in model.local_named_parameters():
        _hook(param, views[id(param)], dp)
    model.__dict__["_dtensor_views"] = views
    model.__dict__["_dtensor_data_parallel"] = dp
    if group.size > 1 or dp is not None:  # transformers' record of a sharded model, which Trainer and accelerate read
        # (the data-parallel size without cp: Trainer adds ParallelismConfig's cp_size to it)
        model.config.distributed_config = DistributedConfig(tp_size=group.size,
                                                            dp_replicate_size=dp.size // model.cp_size if dp else 1)


def views_for_clipping(model) -> dict:
    """Enter the mode from within torch's ``clip_grad_norm_`` (in a loop of one's own, the optimizer built on the
    plain parameters before: re-pointed when it steps, ``optimizer_views.py``), the gradients of the backward just
    run moved onto the views (averaged over dp with data parallelism around the tp group, as a backward in the mode
    would have), before any is scaled; a model with no DTensor view is refused, naming the way that clips it."""
    use_dtensor_parameters(model, _CLIPPING_USER)
    views, dp = dtensor_views(model), model.__dict__.get("_dtensor_data_parallel")
    for _, param in model.local_named_parameters():
        if param.grad is not None:
            _move_gradient(views[id(param)], None, param)
    if dp is not None:
        dp.average()
    return views


def trainer_placement(plan_param, tp: int):
    """The DTensor placement of a parameter's view: ``tp_placement``'s, and for a fused weight of equal parts split
    evenly (gate / up, GPT-2's q / k / v, MoE experts' gate_up) ``_StridedShard(d, split_factor=parts)``: rank r
    holds its piece of each part, which is that placement's layout, so ``full_tensor()``, clipping and the
    optimizer see the true weight. Unequal parts (q / k / v with fewer kv heads), uneven splits and parts every
    rank holds whole have no placement: NotImplementedError."""
    from torch.distributed.tensor.placement_types import _StridedShard

    from .runtime.dtensor import tp_placement

    p = plan_param.placement
    segments = p.segments
    if not segments or p.whole or p.block is not None or getattr(plan_param, "split", ()) \
            or len(set(segments)) != 1 or segments[0] % tp:
        return tp_placement(plan_param)
    return _StridedShard(p.dim, split_factor=len(segments))


def _hook(param, view, dp=None) -> None:
    """Move ``param``'s gradients onto ``view`` from now on, once (a frozen parameter takes no hook: a LoRA
    adapter's base weights); ``dp``: the model's ``DataParallelGradients``, told of each backward."""
    if param.requires_grad and not getattr(param, "_fxparallel_moves_grad", False):
        param.register_post_accumulate_grad_hook(functools.partial(_move_gradient, view, dp))
        param._fxparallel_moves_grad = True


def follow_requires_grad(model) -> None:
    """After parameters were frozen or unfrozen (``set_adapter``): the views take gradients where the
    parameters do."""
    views = dtensor_views(model)
    for _, param in model.local_named_parameters() if views else ():
        views[id(param)].requires_grad_(param.requires_grad)
        _hook(param, views[id(param)], model.__dict__.get("_dtensor_data_parallel"))


def refresh_views(model) -> None:
    """After ``model.to(...)`` / ``model.half()``: point every view at its parameter's (new) storage, keeping the
    view objects (an optimizer's references stay valid)."""
    views = dtensor_views(model)
    if not views:
        return
    for _, param in model.local_named_parameters():
        view = views[id(param)]
        if view._local_tensor.data_ptr() != param.data_ptr() or view.dtype != param.dtype:
            # ``view.data = ...`` would leave the DTensor's local tensor behind: swap the whole object's contents
            fresh = torch.nn.Parameter(like_view(view, param.detach()), requires_grad=view.requires_grad)
            torch.utils.swap_tensors(view, fresh)


def _move_gradient(view, dp, param) -> None:
    """Post-accumulate-grad hook of a plain parameter: its gradient goes onto ``view``."""
    grad, param.grad = param.grad, None
    if grad is None or not view.requires_grad:
        return
    if view.grad is None:
        view.grad = like_view(view, grad)
    else:
        view.grad._local_tensor.add_(grad)
    if dp is not None:
        dp.after_backward(view)


def like_view(view, local):
    """A DTensor with ``view``'s mesh, placements and global shape over the local tensor ``local``."""
    from torch.distributed.tensor import DTensor

    return DTensor.from_local(local, view.device_mesh, view.placements, run_check=False, shape=view.shape,
                              stride=view.stride())
