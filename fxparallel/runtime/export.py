"""Export a consolidated Hugging Face directory (config.json + safetensors) from the sharded model.

One path serves ``export_pretrained(model, mesh, dir)`` (a training job's mesh: TP x FSDP x CP)
and ``model.save_pretrained(dir)`` (``hf_methods.py``; a plain tensor-parallel model, or one
under ``apply_data_parallel``): an ``ExportScope`` says who takes part and who writes.

Every tensor is gathered over tp and dp x cp (one parameter at a time, so peak extra
memory on the ranks other than the writer is one full tensor); the writer keeps them and
writes with transformers' own ``save_pretrained``, so tied weights are stored once, under
the name transformers expects, and ``AutoModelForCausalLM.from_pretrained`` loads it. The
writer holds the whole model (in ``dtype``) while writing. A failure of the writer is raised
on every rank of the scope (never a hang).
"""
from __future__ import annotations

import copy
import os
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist

from ..errors import CheckpointError
from .dtensor import full_tensor
from .fsdp import reshard


@dataclass(frozen=True)
class ExportScope:
    """Who takes part in an export: ``tp`` (a ParallelMesh or the model's TPGroup) names the
    tensor-parallel gather, ``group`` the process group of every rank that must call (None: the
    default group; also None for one process without torch.distributed, see ``single``),
    ``writer`` whether this rank writes, ``device`` where the agreement on errors runs."""

    tp: object
    group: object
    writer: bool
    device: torch.device
    single: bool = False  # one process: nothing to agree on

    @classmethod
    def of_mesh(cls, mesh, is_main_process: bool = True) -> "ExportScope":
        """A training job's mesh: every rank of the job calls, global rank 0 writes."""
        return cls(mesh, None, mesh.rank == 0 and is_main_process, mesh.device)

    @classmethod
    def of_model(cls, model, is_main_process: bool = True) -> "ExportScope":
        """A model without a mesh: its tp group calls and tp rank 0 writes; under data parallelism
        (FSDP DTensors gather over dp x cp too) or context parallelism (several tp groups hold the same
        model) every rank of the job calls and global rank 0 writes. Replicas of a plain tp model
        (several tp groups, no FSDP) pass ``is_main_process=False`` on all groups but one."""
        group = model.tp_group
        if is_data_parallel(model) or getattr(model, "cp_group", None) is not None:
            return cls(group, None, dist.get_rank() == 0 and is_main_process, model.device)
        if group.process_group is None:  # one process, no torch.distributed
            return cls(group, None, is_main_process, model.device, single=True)
        return cls(group, group.process_group, group.rank == 0 and is_main_process, model.device)


def is_data_parallel(model) -> bool:
    """Is ``model`` under ``apply_data_parallel`` (its parameters FSDP DTensors)?"""
    return getattr(model, "_fxparallel_data_parallel", None) is not None


def _gather(model, scope: ExportScope, dtype: Optional[torch.dtype], keep: bool) -> dict:
    """{Hugging Face name: full tensor on CPU}, kept only when ``keep`` (collective over the scope).
    Tied parameters are gathered once and appear under every name."""
    state = {}
    reshard(model)
    for name, param in model.named_parameters():
        plan = model.plan.param(name)
        full = full_tensor(param, plan, scope.tp)
        if keep:
            full = full.to("cpu", dtype=dtype or full.dtype)
            for n in (plan.name,) + tuple(plan.aliases):
                state[n] = full
        del full
    return state


def gather_full_state_dict(model, mesh=None, dtype: Optional[torch.dtype] = None, to_rank0_only: bool = True) -> dict:
    """{Hugging Face name: full tensor on CPU} (collective); empty on ranks other than the writer
    (global rank 0 with a mesh, else tp rank 0) when ``to_rank0_only``. Tied parameters appear
    under every name. ``mesh``: the training job's ParallelMesh, or None (see ``ExportScope``)."""
    scope = ExportScope.of_mesh(mesh) if mesh is not None else ExportScope.of_model(model)
    return _gather(model, scope, dtype, keep=scope.writer or not to_rank0_only)


def _save(model, state: dict, directory: str, dtype: Optional[torch.dtype], save_kwargs: dict) -> None:
    """Write ``state`` (every full tensor) as a transformers checkpoint (the writer only)."""
    from transformers import AutoModelForCausalLM

    from ..load.source import causal_lm_class

    out_dtype = dtype or next(iter(state.values())).dtype
    cls = causal_lm_class(model.config, "save_pretrained", trust_remote_code=True)  # (the model was built already)
    with torch.device("meta"):
        hf = cls._from_config(model.config, dtype=out_dtype) if cls else AutoModelForCausalLM.from_config(
            model.config, dtype=out_dtype)
    expected = set(hf.state_dict())
    missing = sorted(expected - set(state))
    if missing:
        raise CheckpointError(f"export: the parallel model has no tensors for {', '.join(missing[:5])}")
    hf.load_state_dict({k: v for k, v in state.items() if k in expected}, strict=True, assign=True)
    hf.tie_weights()
    generation_config = getattr(model, "generation_config", None)
    if generation_config is not None:  # the checkpoint's, as transformers keeps it
        hf.generation_config = copy.deepcopy(generation_config)
    os.makedirs(directory, exist_ok=True)
    hf.config.dtype = out_dtype
    hf.save_pretrained(directory, **save_kwargs)


def _agree(error: Optional[BaseException], scope: ExportScope, directory: str) -> None:
    """Raise the writer's error on every rank of the scope (collective)."""
    if not scope.single:
        message = None if error is None else f"{type(error).__name__}: {error}"
        messages = [None] * dist.get_world_size(scope.group)
        dist.all_gather_object(messages, message, group=scope.group)
        failed = [(r, m) for r, m in enumerate(messages) if m is not None]
    else:
        failed = []
    if error is not None:
        raise error
    if failed:
        rank, message = failed[0]
        raise CheckpointError(f"rank {rank} failed to write {directory}: {message}")


def write_pretrained(model, directory: str, scope: ExportScope, *, dtype: Optional[torch.dtype] = None,
                     **save_kwargs) -> Optional[str]:
    """Gather every tensor over ``scope`` and write ``directory`` on its writer (collective).
    ``save_kwargs`` go to transformers' ``save_pretrained`` (max_shard_size, variant, ...).
    Returns the directory on the writer, None elsewhere."""
    state = _gather(model, scope, dtype, keep=scope.writer)
    error = None
    if scope.writer:
        try:
            _save(model, state, directory, dtype, save_kwargs)
        except Exception as err:  # noqa: BLE001 - reported to every rank below
            error = err
    del state
    _agree(error, scope, directory)
    return directory if scope.writer else None


def export_pretrained(model, mesh, directory: str, *, dtype: Optional[torch.dtype] = None,
                      max_shard_size="5GB") -> Optional[str]:
    """Write ``directory`` as a Hugging Face checkpoint (collective; rank 0 writes). Returns the
    directory on rank 0, None elsewhere."""
    return write_pretrained(model, directory, ExportScope.of_mesh(mesh), dtype=dtype, max_shard_size=max_shard_size)
