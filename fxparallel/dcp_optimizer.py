"""``optimizer.state_dict()`` handed to torch.distributed.checkpoint, as users do by habit.

A torch optimizer over the parallel model's parameters keeps, per parameter, state of the shard's shape (Adam's
``exp_avg`` / ``exp_avg_sq``, SGD's momentum). Handed to ``dcp.save`` as it is, DCP would take every rank's
state under the same key (``state.0.exp_avg``) for the whole tensor and keep one: a checkpoint that reloads every
rank with one rank's moments (measured: Adam's state off by 0.03 after one step at TP=2, silently). So once an
optimizer has stepped any of the parallel model's shards (a global step hook notices it), its ``state_dict()``
hands out each such state tensor as a new tensor on the same storage carrying DCP's checkpointable protocol for
its parameter's pieces (``dcp_state.describe``, as ``model.state_dict()`` does), and its ``load_state_dict``
receives plain tensors again. DCP then saves full-shape state that ``dcp.load`` reads back exactly, at any tp
size. Optimizers over DTensors (Trainer's views, FSDP) are DCP's own business and left alone."""
from __future__ import annotations

import weakref

import torch

from .dcp_full_state import full_state_dict_given, full_state_dict_requested
from .dcp_state import describe
from .parallel_models import known_parameters

_ADOPTED: "weakref.WeakSet" = weakref.WeakSet()
_HOOK: list = []


def install_hook() -> None:
    """Watch the optimizers that step a parallel model's shards (``parallel_models.py``); once per process."""
    if not _HOOK:
        from torch.optim.optimizer import register_optimizer_step_post_hook

        _HOOK.append(register_optimizer_step_post_hook(_adopt))


def _shards() -> dict:
    """{id(plain shard): (its ParamPlan, its model's TPGroup)} of every parallel model alive at tp > 1 (DTensors
    describe themselves)."""
    return {key: (known.plan, known.tp_group) for key, known in known_parameters().items()
            if known.sharded and known.plain}


def _adopt(optimizer, _args, _kwargs) -> None:
    if optimizer in _ADOPTED:
        return
    _ADOPTED.add(optimizer)
    shards = _shards()
    if any(id(p) in shards for group in optimizer.param_groups for p in group["params"]):
        optimizer.register_state_dict_post_hook(_describe_state)
        optimizer.register_load_state_dict_pre_hook(_plain_state)


def _shard_entries(optimizer, state_dict: dict):
    """(state entry, parameter, ParamPlan, TPGroup) of each plain shard with state in ``state_dict`` (the
    optimizer's, states by index); each entry a copy put in its place, so that changing it changes neither the
    live state (torch hands out its own dicts) nor the caller's."""
    shards = _shards()
    params = [p for group in optimizer.param_groups for p in group["params"]]
    indices = [i for group in state_dict["param_groups"] for i in group["params"]]
    for index, param in zip(indices, params):
        entry = state_dict["state"].get(index)
        if id(param) in shards and entry is not None:
            entry = state_dict["state"][index] = dict(entry)
            yield (entry, param, *shards[id(param)])


def _describe_state(optimizer, state_dict: dict) -> dict:
    """Each shard's state described for DCP, or, for torch's ``get_optimizer_state_dict(full_state_dict=True)``,
    complete (gathered over the tp group: ``dcp_full_state.py``)."""
    from .runtime.dtensor import full_tensor

    complete = full_state_dict_requested("optim")
    for entry, param, plan, group in _shard_entries(optimizer, state_dict):
        for key, value in entry.items():
            if isinstance(value, torch.Tensor) and value.shape == param.shape and value.dim() > 0:
                if complete:
                    entry[key] = full_tensor(value, plan, group)
                else:
                    entry[key] = value.detach()  # a new tensor on the same storage: the live state stays plain
                    describe(entry[key], plan, group.rank, group.size)
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
        for entry, param, plan, group in _shard_entries(optimizer, state_dict):
            for key, value in entry.items():
                if isinstance(value, torch.Tensor) and tuple(value.shape) == tuple(plan.shape) != tuple(param.shape):
                    entry[key] = plan.shard_of(value, group.rank, group.size)
    return state_dict
