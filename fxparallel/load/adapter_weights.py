"""The LoRA adapter's matrices in this rank's shards: read from the adapter's safetensors file under
PEFT's stored names (``adapter_files.stored_name``), each rank reading only its pieces, as the base
model's weights are read (weights.py). With an adapter the base model is frozen (PEFT's
``mark_only_lora_as_trainable``); the active adapter takes gradients when loaded as trainable."""
from __future__ import annotations

import dataclasses

from ..capture.adapters import is_adapter_parameter
from .adapter_files import stored_name
from .weights import load_from_files, load_from_state_dict


def without_adapters(plan):
    """``plan`` (a ShardingPlan) with the base model's parameters only."""
    return dataclasses.replace(plan, params=[p for p in plan.params if not is_adapter_parameter(p.name)])


def load_adapter_weights(module, plan, adapter, rank: int, tp: int) -> int:
    """Read ``adapter``'s (an AdapterSource) matrices into ``module``'s shards and set which parameters take
    gradients; returns the bytes read (collective over the tp group, as load_from_files)."""
    params = [dataclasses.replace(p, aliases=tuple(p.aliases) + (stored_name(p.name, adapter.name),))
              for p in plan.params if is_adapter_parameter(p.name, adapter.name)]
    nbytes = 0
    if adapter.files is not None:
        nbytes = load_from_files(module, dataclasses.replace(plan, params=params), adapter.files, rank, tp,
                                 progress=False)
    else:  # a PeftModel's matrices, in memory
        load_from_state_dict(module, dataclasses.replace(plan, params=params), adapter.state, rank, tp)
    set_trainable(module, adapter.name, adapter.trainable)
    return nbytes


def set_trainable(module, adapter, trainable: bool) -> None:
    """The base model and every other adapter frozen; the matrices of the adapter(s) named ``adapter`` (a name or
    a list) take gradients when ``trainable`` (PEFT's ``set_adapter``)."""
    names = [adapter] if isinstance(adapter, str) else list(adapter)
    for name, param in module.named_parameters():
        param.requires_grad_(trainable and any(is_adapter_parameter(name, a) for a in names))
