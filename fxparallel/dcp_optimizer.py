"""``optimizer.state_dict()`` handed to torch.distributed.checkpoint, as users do by habit.

A torch optimizer over the parallel model's parameters keeps, per parameter, state of the shard's shape (Adam's
``exp_avg`` / ``exp_avg_sq``, SGD's momentum). Handed to ``dcp.save`` as it is, DCP would take every rank's
state under the same key (``state.0.exp_avg``) for the whole tensor and keep one: a checkpoint that reloads every
rank with one rank's moments (measured: Adam's state off by 0.03 after one step at TP=2, silently). So once an
optimizer has stepped any of the parallel model's shards (a global step hook notices it), its ``state_dict()``
hands out each such state tensor as a new tensor on the same storage carrying DCP's checkpointable protocol for
its parameter's pieces (``dcp_state.describe``, as ``model.state_dict()`` does), and its ``load_state_dict``
receives plain tensors again. DCP then saves full-shape state that ``dcp.load`` reads back exactly, at any tp
size. So does the state of a run of experts (experts spread over data-parallel ranks: the pieces of the whole
tensor the run holds, at any tp, tp = 1 included). Under FSDP at tp > 1 a state is a DTensor of this rank's tp shard
split over the dp ranks, which DCP would take for the whole tensor (measured at tp=2: Adam's state off by 0.04 after
a save and load, silently): it is described by the pieces of the full tensor its chunk holds, as for
``model.state_dict()``.
Optimizers over Trainer's DTensor views are DCP's own business and left alone."""
from __future__ import annotations

import weakref

import torch

from .dcp_full_state import full_state_dict_given, full_state_dict_requested
from .dcp_state import describe, fsdp_rows_of
from .load.expert_runs import cut_to_run, like_run_of
from .parallel_models import known_parameters

_ADOPTED: "weakref.WeakSet" = weakref.WeakSet()
_HOOK: list = []


def install_hook() -> None:
    """Watch the optimizers that step a parallel model's shards (``parallel_models.py``); once per process."""
    if not _HOOK:
        from torch.optim.optimizer import register_optimizer_step_post_hook

        _HOOK.append(register_optimizer_step_post_hook(_adopt))


def _shards() -> dict:
    """{id(parameter): Known} of the parameters whose state DCP cannot place from the state alone: this rank's
    tensor-parallel shard (plain, or FSDP's DTensor of it) or run of experts. Trainer's DTensor views describe
    themselves."""
    return {key: known for key, known in known_parameters().items()
            if not known.view and (known.sharded or known.run is not None)}


def _adopt(optimizer, _args, _kwargs) -> None:
    if optimizer in _ADOPTED:
        return
    _ADOPTED.add(optimizer)
    shards = _shards()
    if any(id(p) in shards for group in optimizer.param_groups for p in group["params"]):
        optimizer.register_state_dict_post_hook(_describe_state)
        optimizer.register_load_state_dict_pre_hook(_plain_state)


def _shard_entries(optimizer, state_dict: dict):
    """(state entry, parameter, Known) of each of ``_shards`` with state in ``state_dict`` (the optimizer's, states
    by index); each entry a copy put in its place, so that changing it changes neither the live state (torch hands
    out its own dicts) nor the caller's."""
    shards = _shards()
    params = [p for group in optimizer.param_groups for p in group["params"]]
    indices = [i for group in state_dict["param_groups"] for i in group["params"]]
    for index, param in zip(indices, params):
        entry = state_dict["state"].get(index)
        if id(param) in shards and entry is not None:
            entry = state_dict["state"][index] = dict(entry)
            yield entry, param, shards[id(param)]


def _describe_state(optimizer, state_dict: dict) -> dict:
    """Each shard's state described for DCP (FSDP's DTensor by the rows of the shard its chunk holds), or, for torch's
    ``get_optimizer_state_dict(full_state_dict=True)``, complete (gathered over ep, dp and tp: ``dcp_full_state.py``)."""
    from .runtime.dtensor import full_tensor

    complete = full_state_dict_requested("optim")
    for entry, param, known in _shard_entries(optimizer, state_dict):
        group = known.tp_group
        for key, value in entry.items():
            if not (isinstance(value, torch.Tensor) and value.shape == param.shape and value.dim() > 0):
                continue
            if complete:  # (a run of experts gathered over its ep group first)
                entry[key] = full_tensor(like_run_of(value, param) if known.run else value, known.plan, group)
                continue
            entry[key] = value.detach()  # a new tensor on the same storage: the live state stays as it is
            describe(entry[key], known.plan, group.rank, group.size, known.run, fsdp_rows_of(value))
    return state_dict


def _plain_state(optimizer, state_dict: dict) -> dict:
    """What ``load_state_dict`` keeps must not answer DCP's ``size()`` (the full tensor's); within torch's
    ``set_optimizer_state_dict(full_state_dict=True)``, which pairs the complete states with the parameters by
    name, each shard's states are cut from them (``dcp_full_state.py``)."""
    for entry in state_dict["state"].values():
        for key, value in entry.items():
            if isinstance(value, torch.Tensor) and "__create_write_items__" in vars(value):
                entry[key] = value.detach()
    if full_state_dict_given("optim"):
        from torch.distributed.tensor import DTensor, distribute_tensor

        for entry, param, known in _shard_entries(optimizer, state_dict):
            plan, group = known.plan, known.tp_group
            for key, value in entry.items():
                if not isinstance(value, torch.Tensor) or not tuple(value.shape) == tuple(plan.shape) != tuple(
                        param.shape):
                    continue
                if isinstance(value, DTensor):  # under FSDP torch spread the complete state over FSDP's mesh
                    value = value.full_tensor()
                shard = cut_to_run(plan.shard_of(value, group.rank, group.size), known.run)
                # under FSDP: this rank's chunk of the tp shard, placed as the parameter
                entry[key] = distribute_tensor(shard, param.device_mesh, param.placements) if isinstance(
                    param, DTensor) else shard
    return state_dict
