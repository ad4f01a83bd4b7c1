"""Export a consolidated Hugging Face directory (config.json + safetensors) from the sharded model.

One path serves ``export_pretrained(model, mesh, dir)`` (a training job's mesh: TP x FSDP x CP)
and ``model.save_pretrained(dir)`` (``hf_methods.py``; a plain tensor-parallel model, or one
under ``apply_data_parallel``): an ``ExportScope`` says who takes part and who writes.

Every tensor is gathered to the writer alone, one parameter at a time: FSDP's dim-0 chunks
over dp x cp to the rank of each dp x cp group that sits in the writer's tp group, then the
tp shards to the writer (``dist.gather``: the other ranks send their piece and receive
nothing, so no rank but the writer ever holds a full tensor; ``_full_on_writer``). The
writer keeps them and writes with transformers' own ``save_pretrained``, so tied weights are
stored once, under the name transformers expects, and ``AutoModelForCausalLM.from_pretrained``
loads it. The writer holds the whole model (in ``dtype``) while writing. A failure of the
writer is raised on every rank of the scope (never a hang).
"""
from __future__ import annotations

import copy
import os
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from ..capture.adapters import is_adapter_parameter
from ..errors import ArgumentError, CheckpointError
from ..load.coordinate import exchange
from ..ops.collectives import gather_full_to, gather_parts_to
from .dtensor import fsdp_mesh_dim, full_tensor, local_part, tp_of
from .fsdp import is_data_parallel, reshard
from ..load.expert_runs import run_sizes


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
        (FSDP DTensors gather over dp x cp too), context parallelism (several tp groups hold the same
        model) or with experts spread over data-parallel ranks (each run gathered over its ep group, which
        spans tp groups: one writer for them all) every rank of the job calls and global rank 0 writes.
        Replicas of a plain tp model (several tp groups, no FSDP) pass ``is_main_process=False`` on all
        groups but one."""
        group = model.tp_group
        if is_data_parallel(model) or getattr(model, "cp_group", None) is not None or getattr(
                model, "expert_runs", None):
            return cls(group, None, dist.get_rank() == 0 and is_main_process, model.device)
        if group.process_group is None:  # one process, no torch.distributed
            return cls(group, None, is_main_process, model.device, single=True)
        return cls(group, group.process_group, group.rank == 0 and is_main_process, model.device)


def _gather(model, scope: ExportScope, dtype: Optional[torch.dtype]) -> dict:
    """{Hugging Face name: full tensor on CPU} on every rank (collective over the scope).
    Tied parameters are gathered once and appear under every name."""
    reshard(model)
    return _named_full(model, dtype, lambda param, plan: full_tensor(param, plan, scope.tp))


def _gather_to_writer(model, scope: ExportScope, dtype: Optional[torch.dtype], refusal: Optional[Exception] = None,
                      only=None) -> dict:
    """``_gather``'s dict on the writer; empty on the other ranks, which only send their pieces
    (collective over the scope; nothing is gathered when no rank writes). ``only``: a test of the
    parameter names to gather (None: all)."""
    route = _route(scope, refusal)
    if route is None:
        return {}
    reshard(model)
    return _named_full(model, dtype, lambda param, plan: _full_on_writer(param, plan, scope.tp, route), only)


def _named_full(model, dtype: Optional[torch.dtype], full_of, only=None) -> dict:
    """{name and alias: ``full_of(param, plan)`` on CPU in ``dtype``}, skipping None (one parameter at a time);
    ``only``: a test of the names to gather (None: all)."""
    state = {}
    for name, param in model.local_named_parameters():
        if only is not None and not only(name):
            continue
        plan = model.plan.param(name)
        full = full_of(param, plan)
        if full is not None:
            full = full.to("cpu", dtype=dtype or full.dtype)
            for n in plan.names:
                state[n] = full
        del full
    return state


@dataclass(frozen=True)
class _Route:
    """Where an export's full tensors go: this rank (global), the writer, and the writer's tp group
    (global ranks, in group order): the ranks that gather a tp shard for it."""

    rank: int
    writer: int
    writer_tp: tuple


def _route(scope: ExportScope, refusal: Optional[Exception] = None) -> Optional[_Route]:
    """The writer and its tp group, as every rank of the scope learns them (collective); None when no
    rank writes. Agreed rather than assumed: ``is_main_process`` may differ between the ranks.
    ``refusal``: this rank's arguments were refused; it still takes part, then every rank raises (the
    others naming it), so no rank waits in a gather for one that left."""
    if scope.single:
        if refusal is not None:
            raise refusal
        return _Route(0, 0, (0,)) if scope.writer else None
    rank = dist.get_rank()
    mine = None
    if scope.writer:
        _, tp_group = tp_of(scope.tp)
        mine = [rank, dist.get_process_group_ranks(tp_group) if tp_group is not None else [rank]]
    # through the store, not a collective: a rank that calls save_pretrained alone (`if rank == 0: ...`) is
    # named in an error instead of waiting in a gather (load/coordinate.py)
    found = exchange(scope.group, [mine, refusal is not None], "save_pretrained", step="save_pretrained")
    if refusal is not None:
        raise refusal
    refused = [dist.get_global_rank(scope.group, r) if scope.group is not None else r
               for r, (_, bad) in enumerate(found) if bad]
    if refused:
        raise ArgumentError(f"save_pretrained: the arguments of rank {refused[0]} were refused (see the error on that "
                            "rank); every rank must call it with the same arguments")
    writer = next((w for w, _ in found if w is not None), None)
    return None if writer is None else _Route(rank, writer[0], tuple(writer[1]))


def _full_on_writer(param, plan_param, tp_mesh, route: _Route) -> Optional[torch.Tensor]:
    """The complete model tensor on the writer, None on every other rank (collective over the ranks
    holding its pieces). ``dtensor.full_tensor``'s assembly, with gathers to one rank instead of
    all-gathers: the writer receives one ``[tp, *shard]`` buffer and returns a view of it or one copy."""
    tp, group = tp_of(tp_mesh)
    p = plan_param.placement
    split = p.is_shard and tp > 1
    # a tensor whole on every tp rank is gathered over dp x cp by the writer alone
    targets = route.writer_tp if split else (route.writer,)
    shard = _runs_to(param, targets) if getattr(param, "_fxparallel_expert_run", None) else \
        _tp_shard_to(param.detach(), targets)
    if not split:
        return shard if route.rank == route.writer else None
    if shard is None or route.rank not in route.writer_tp:
        return None
    dst = dist.get_group_rank(group, route.writer)
    sizes = [plan_param.local_shape(tp, r)[p.dim] for r in range(tp)]
    sizes = sizes if len(set(sizes)) > 1 else None
    if not p.segments:
        return gather_full_to(shard, p.dim, group, tp, dst, sizes)  # each rank's rows follow the previous rank's
    parts = gather_parts_to(shard, p.dim, group, tp, dst, sizes)
    if parts is None:
        return None
    full = shard.new_empty(tuple(plan_param.shape))
    for rank, part in enumerate(parts):
        for src, piece in plan_param.pieces(rank, tp):  # a whole segment: the same on every rank
            full[src] = part[piece]
    return full


def _runs_to(param, targets: tuple) -> Optional[torch.Tensor]:
    """An expert-run parameter's tp shard on the rank of its ep group that is among ``targets``, None on the
    others (the runs gathered there; ``load/expert_runs.py``)."""
    group = param._fxparallel_expert_group
    members = dist.get_process_group_ranks(group.process_group)
    holders = [r for r in members if r in targets]
    if not holders:  # no rank of this ep group gathers for the writer
        return None
    return gather_full_to(param.detach(), 0, group.process_group, group.size,
                          dist.get_group_rank(group.process_group, holders[0]), run_sizes(param))


def _tp_shard_to(tensor, targets: tuple) -> Optional[torch.Tensor]:
    """This rank's whole tp shard on the rank of its dp x cp group that is among ``targets`` (global
    ranks), None on the others (FSDP's dim-0 chunks, torch.chunk sizes, gathered there); the tensor
    itself where FSDP does not shard it."""
    if not isinstance(tensor, DTensor):
        return tensor
    mesh_dim = fsdp_mesh_dim(tensor)
    if mesh_dim is None:
        return local_part(tensor)
    group = tensor.device_mesh.get_group(mesh_dim)
    members = dist.get_process_group_ranks(group)
    holders = [r for r in members if r in targets]
    if not holders:  # no rank of this group gathers for the writer
        return None
    rows, world = tensor.shape[0], len(members)
    sizes = _chunk_sizes(rows, world)
    local = local_part(tensor)
    if local.numel() == 0:  # an empty chunk (FSDP pads it), shaped for the padding
        local = local.new_zeros((0, *tensor.shape[1:]))
    return gather_full_to(local, 0, group, world, dist.get_group_rank(group, holders[0]),
                          sizes if len(set(sizes)) > 1 else None)


def _chunk_sizes(rows: int, parts: int) -> list:
    """torch.chunk's sizes of ``rows`` over ``parts`` (FSDP's), trailing ranks possibly empty."""
    size = -(-rows // parts)
    return [max(0, min(size, rows - r * size)) for r in range(parts)]


def gather_full_state_dict(model, mesh=None, dtype: Optional[torch.dtype] = None, to_rank0_only: bool = True) -> dict:
    """{Hugging Face name: full tensor on CPU} (collective); empty on ranks other than the writer
    (global rank 0 with a mesh, else tp rank 0) when ``to_rank0_only``, which then never receive a
    full tensor. Tied parameters appear under every name. ``mesh``: the training job's ParallelMesh,
    or None (see ``ExportScope``)."""
    scope = ExportScope.of_mesh(mesh) if mesh is not None else ExportScope.of_model(model)
    return _gather_to_writer(model, scope, dtype) if to_rank0_only else _gather(model, scope, dtype)


def _save(model, state: dict, directory: str, dtype: Optional[torch.dtype], save_kwargs: dict) -> None:
    """Write ``state`` (every full tensor) as a transformers checkpoint (the writer only)."""
    from transformers import AutoModelForCausalLM

    from ..load.quantization import config_for_float_weights
    from ..load.source import causal_lm_class

    out_dtype = dtype or next(iter(state.values())).dtype
    config = config_for_float_weights(model.config, out_dtype)  # dequantized on load: no quantization_config
    if getattr(config, "distributed_config", None) is not None:
        # set for Trainer (dtensor_parameters.py); the model built here to write the full tensors is a plain one
        config = copy.deepcopy(config)
        config.distributed_config = None
    cls = causal_lm_class(config, "save_pretrained", trust_remote_code=True)  # (the model was built already)
    with torch.device("meta"):
        hf = cls._from_config(config, dtype=out_dtype) if cls else AutoModelForCausalLM.from_config(
            config, dtype=out_dtype)
    expected = set(hf.state_dict())
    buffers = dict(model.named_buffers())
    for name in expected - set(state):  # persistent buffers (DeepSeek-V3's routing bias): whole on every rank
        if name in buffers:
            state[name] = buffers[name].detach().cpu()
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
                     refusal: Optional[Exception] = None, **save_kwargs) -> Optional[str]:
    """Gather every tensor over ``scope`` and write ``directory`` on its writer (collective).
    ``save_kwargs`` go to transformers' ``save_pretrained`` (max_shard_size, variant, ...); ``refusal``: this
    rank's arguments were refused (raised on every rank after the first exchange, see ``_route``).
    With LoRA adapters attached only the active adapter is written, in PEFT's layout, as transformers does
    (``adapter_export.py``). Returns the directory on the writer, None elsewhere."""
    from .adapter_export import write_adapter

    adapter = model._attached()  # the active LoRA adapter, or None
    if adapter is not None and len(model.active_adapters()) > 1:  # every rank alike: raised before any exchange
        raise ArgumentError(f"save_pretrained: adapters {model.active_adapters()} are active together; as "
                            "transformers, the parallel model saves one active adapter: save each after "
                            "model.set_adapter(name)")
    only = (lambda name: is_adapter_parameter(name, adapter.name)) if adapter is not None else None
    state = _gather_to_writer(model, scope, dtype, refusal, only)
    error = None
    if scope.writer:
        try:
            if adapter is not None:
                write_adapter(adapter.name, adapter.config, state, directory)
            else:
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
