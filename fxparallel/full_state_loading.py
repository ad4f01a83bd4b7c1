"""``model.load_state_dict`` of complete tensors: each full-shape value becomes this rank's shard.

nn.Module's ``load_state_dict`` takes what ``state_dict()`` gives, this rank's shards. A state dict of the whole
model (transformers' ``state_dict()``, a ``save_pretrained`` file; Trainer's ``resume_from_checkpoint`` loads one)
holds full-shape tensors, which nn.Module refuses for every sharded parameter (size mismatch). Before nn.Module
copies, a value whose shape is its parameter's full shape, where that differs from the shard's, is replaced by
this rank's piece of it (``ParamPlan.shard_of``: fused weights and uneven splits included; with experts spread over
data-parallel ranks, its run of them: ``load/expert_runs.py``; under FSDP, ``runtime.apply_data_parallel``, FSDP's
chunk of the shard, as a DTensor like the parameter: ``runtime/dtensor.fsdp_chunk``). A value of any other shape is
left to nn.Module's own check."""
from __future__ import annotations

import torch

from .load.expert_runs import cut_to_run


def shard_full_values(module, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                      error_msgs) -> None:
    """nn.Module's load_state_dict pre-hook (see the module docstring); counts the loads (``inputs.py`` compares
    the count across the tp ranks)."""
    from torch.distributed.tensor import DTensor

    from .runtime.dtensor import fsdp_chunk
    from .runtime.fsdp import is_data_parallel, reshard

    module._weights_loaded += 1
    group = module.tp_group
    if is_data_parallel(module):
        reshard(module)  # the sharded parameters registered (a forward leaves the root's gathered)
    for name, param in module.local_named_parameters(remove_duplicate=False):
        value = state_dict.get(prefix + name)
        if not isinstance(value, torch.Tensor) or isinstance(value, DTensor):
            continue
        try:
            plan = module.plan.param(name)
        except KeyError:  # not a planned parameter: nn.Module's own check
            continue
        if isinstance(param, DTensor):  # FSDP's chunk of this rank's shard
            if tuple(value.shape) == tuple(plan.shape):
                state_dict[prefix + name] = fsdp_chunk(plan.shard_of(value, group.rank, group.size), param)
            continue
        if tuple(value.shape) == tuple(plan.shape) != tuple(param.shape):
            # experts spread over data-parallel ranks: this rank's run
            state_dict[prefix + name] = cut_to_run(plan.shard_of(value, group.rank, group.size),
                                                   module.expert_runs.get(plan.name))
