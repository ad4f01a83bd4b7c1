"""Export a consolidated Hugging Face directory (config.json + safetensors) from the sharded model.

Every tensor is gathered over tp and dp x cp (one parameter at a time, so peak extra
memory on the ranks other than 0 is one full tensor); rank 0 keeps them and writes
with transformers' own ``save_pretrained``, so tied weights are stored once, under
the name transformers expects, and ``AutoModelForCausalLM.from_pretrained`` loads it.
Rank 0 holds the whole model (in ``dtype``) while writing.
"""
from __future__ import annotations

import os
from typing import Optional

import torch
import torch.distributed as dist

from ..errors import CheckpointError
from .dtensor import full_tensor
from .fsdp import reshard


def gather_full_state_dict(model, mesh, dtype: Optional[torch.dtype] = None, to_rank0_only: bool = True) -> dict:
    """{Hugging Face name: full tensor on CPU} (collective); empty on ranks other than 0 when
    ``to_rank0_only``. Tied parameters appear under every name."""
    state = {}
    reshard(model)
    for name, param in model.named_parameters():
        plan = model.plan.param(name)
        full = full_tensor(param, plan, mesh)
        if mesh.rank == 0 or not to_rank0_only:
            full = full.to("cpu", dtype=dtype or full.dtype)
            for n in (plan.name,) + tuple(plan.aliases):
                state[n] = full
        del full
    return state


def export_pretrained(model, mesh, directory: str, *, dtype: Optional[torch.dtype] = None,
                      max_shard_size="5GB") -> Optional[str]:
    """Write ``directory`` as a Hugging Face checkpoint (collective; rank 0 writes). Returns the
    directory on rank 0, None elsewhere."""
    from transformers import AutoModelForCausalLM

    state = gather_full_state_dict(model, mesh, dtype)
    error = None
    if mesh.rank == 0:
        try:
            config = model.config
            out_dtype = dtype or next(iter(state.values())).dtype
            with torch.device("meta"):
                hf = AutoModelForCausalLM.from_config(config, dtype=out_dtype)
            expected = set(hf.state_dict())
            missing = sorted(expected - set(state))
            if missing:
                raise CheckpointError(f"export: the parallel model has no tensors for {', '.join(missing[:5])}")
            hf.load_state_dict({k: v for k, v in state.items() if k in expected}, strict=True, assign=True)
            hf.tie_weights()
            os.makedirs(directory, exist_ok=True)
            hf.config.dtype = out_dtype
            hf.save_pretrained(directory, safe_serialization=True, max_shard_size=max_shard_size)
        except Exception as err:  # noqa: BLE001 - reported to every rank below
            error = err
    flag = torch.tensor([0.0 if error is None else 1.0], device=mesh.device)
    dist.all_reduce(flag)
    if error is not None:
        raise error
    if flag.item():
        raise CheckpointError(f"rank 0 failed to export {directory}")
    return directory if mesh.rank == 0 else None
