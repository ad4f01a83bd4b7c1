"""Fill this rank's parameter shards: from safetensors pieces, from an in-memory model, or by init.

Every check (missing tensors, shapes, dtypes, headers, file sizes) runs before any
parameter is written, and the group agrees on the outcome, so a bad checkpoint leaves
nothing half-loaded and no rank waits for a peer that failed.
"""
from __future__ import annotations

import logging
import time
import warnings
from dataclasses import dataclass

import torch

from ..errors import CheckpointError
from .checkpoint import CheckpointFiles
from .coordinate import agree, first_on_node
from .safetensors_io import SafetensorsFile, byte_runs, normalize_index

log = logging.getLogger("fxparallel")


def slice_pieces(p, rank: int, tp: int) -> list:
    """The pieces of the stored tensor ``p`` that this rank keeps: [(source index, destination index)].

    Today every placement is one contiguous slice. A fused parameter (several pieces of
    the stored tensor per rank) returns more than one pair; the reader handles any list.
    """
    local = p.local_shape(tp)
    return [(p.local_slices(rank, tp), tuple(slice(0, s) for s in local))]


@dataclass
class _Read:
    path: str
    tensor: str
    source: tuple  # index into the stored tensor
    param: torch.Tensor
    dest: tuple  # index into this rank's shard
    nbytes: int
    offset: int  # where the piece starts in the file (reads go in file order)


def _names(p) -> tuple:
    return (p.name,) + tuple(p.aliases)


def _plan_reads(module, plan, files: CheckpointFiles, rank: int, tp: int) -> list:
    """Check the checkpoint against the plan (headers only); returns the pieces to read and the files."""
    missing = [p.name for p in plan.params if not any(n in files.weight_map for n in _names(p))]
    if missing:
        where = files.source or "the checkpoint"
        raise CheckpointError(f"{where} has no weights for {len(missing)} parameter(s): {', '.join(missing)}")
    known = {n for p in plan.params for n in _names(p)} | {n for n, _ in module.named_buffers()}
    extra = sorted(set(files.weight_map) - known)
    if extra:
        warnings.warn(f"{files.source or 'checkpoint'} has {len(extra)} tensor(s) the model does not use: "
                      f"{', '.join(extra)}", stacklevel=4)
    headers = {}
    reads, problems = [], []
    for p in plan.params:
        tensor = next(n for n in _names(p) if n in files.weight_map)  # tied: read once, under one name
        path = files.weight_map[tensor]
        if path not in headers:
            headers[path] = SafetensorsFile(path)
        info = headers[path].tensors.get(tensor)
        if info is None:
            problems.append(f"tensor {tensor!r} is listed in the index for {path}, which does not hold it")
            continue
        if info.shape != tuple(p.shape):
            problems.append(f"tensor {tensor!r} in {path} has shape {list(info.shape)} but the config gives "
                            f"{list(p.shape)}")
            continue
        if info.torch_dtype is None:
            problems.append(f"tensor {tensor!r} in {path} has dtype {info.dtype}, which fxparallel cannot read")
            continue
        param = module.get_parameter(p.name)
        for source, dest in slice_pieces(p, rank, tp):
            runs = byte_runs(info.shape, normalize_index(info.shape, source), info.itemsize)
            nbytes = sum(n for _, n in runs)
            reads.append(_Read(path, tensor, source, param, dest, nbytes, info.start + (runs[0][0] if runs else 0)))
    if problems:
        raise CheckpointError("the checkpoint does not match the model:\n  " + "\n  ".join(problems))
    reads.sort(key=lambda r: (r.path, r.offset))
    return reads, headers


def _progress(total: int, rank: int, tp: int):
    from tqdm.auto import tqdm

    return tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024, desc=f"loading rank {rank}/{tp} shards",
                disable=not first_on_node(), leave=False)


def load_from_files(module, plan, files: CheckpointFiles, rank: int, tp: int, *, progress: bool = True) -> int:
    """Read each parameter's rank pieces from the checkpoint into the shards; returns bytes read."""
    group = getattr(getattr(module, "tp_group", None), "process_group", None)
    t0 = time.perf_counter()
    nbytes, error = 0, None
    try:
        reads, headers = _plan_reads(module, plan, files, rank, tp)
        bar = _progress(sum(r.nbytes for r in reads), rank, tp) if progress else None
        with torch.no_grad():
            path, handle = None, None
            try:
                for r in reads:
                    if r.path != path:
                        if handle is not None:
                            handle.__exit__(None, None, None)
                        path, handle = r.path, headers[r.path].__enter__()
                    nbytes += handle.read_into(r.tensor, r.source, r.param.detach()[r.dest])
                    if bar is not None:
                        bar.update(r.nbytes)
            finally:
                if handle is not None:
                    handle.__exit__(None, None, None)
                if bar is not None:
                    bar.close()
    except Exception as err:  # noqa: BLE001 - every rank must learn of it (agree re-raises)
        error = err
    agree(group, error, "loading the checkpoint")
    seconds = time.perf_counter() - t0
    log.info("rank %d read %.1f MiB of a %.1f MiB checkpoint (%.1f%%) in %.2f s", rank, nbytes / 2**20,
             files.total_bytes / 2**20, 100.0 * nbytes / max(files.total_bytes, 1), seconds)
    return nbytes


def load_from_state_dict(module, plan, state: dict, rank: int, tp: int) -> None:
    missing = [p.name for p in plan.params if not any(n in state for n in _names(p))]
    if missing:
        raise CheckpointError(f"the given model has no weights for: {', '.join(missing)}")
    for p in plan.params:
        full = state[next(n for n in _names(p) if n in state)]
        if tuple(full.shape) != tuple(p.shape):
            raise CheckpointError(f"parameter {p.name} has shape {list(full.shape)}, expected {list(p.shape)}")
    with torch.no_grad():
        for p in plan.params:
            full = state[next(n for n in _names(p) if n in state)]
            param = module.get_parameter(p.name)
            for source, dest in slice_pieces(p, rank, tp):
                param[dest].copy_(full[source])


def initialize(module, plan, config, rank: int, tp: int, seed: int, dtype, model_class=None) -> None:
    """No weights given: initialize the full model as transformers would (same seed on every
    rank, so all ranks agree), then keep this rank's slices."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    if model_class is not None:
        full = model_class._from_config(config, dtype=dtype)
    else:
        full = AutoModelForCausalLM.from_config(config, dtype=dtype)
    load_from_state_dict(module, plan, {k: v for k, v in full.state_dict().items()}, rank, tp)
