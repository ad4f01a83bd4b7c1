"""Fill this rank's parameter shards: from safetensors slices, from an in-memory model, or by init.

Every check (missing tensors, shapes) runs before any parameter is written, so a
bad checkpoint leaves nothing half-loaded.
"""
from __future__ import annotations

import logging
import warnings
from collections import defaultdict

import torch

from ..errors import CheckpointError
from .checkpoint import CheckpointFiles
from .safetensors_io import open_file, read_slice

log = logging.getLogger("fxparallel")


def _source_name(p, available) -> str:
    for name in (p.name,) + tuple(p.aliases):
        if name in available:
            return name
    return None


def load_from_files(module, plan, files: CheckpointFiles, rank: int, tp: int) -> int:
    """Read each parameter's rank slice from the checkpoint; returns bytes read."""
    params = dict(module.named_parameters())
    sources = {}
    missing = []
    for p in plan.params:
        src = _source_name(p, files.weight_map)
        if src is None:
            missing.append(p.name)
        else:
            sources[p.name] = src
    if missing:
        raise CheckpointError(f"checkpoint has no weights for {len(missing)} parameter(s): {', '.join(missing)}")
    used = set(sources.values())
    extra = sorted(set(files.weight_map) - used)
    if extra:
        warnings.warn(f"checkpoint tensors not used by the model: {', '.join(extra)}", stacklevel=3)
    by_file = defaultdict(list)
    for p in plan.params:
        by_file[files.weight_map[sources[p.name]]].append(p)
    # first pass: shapes (header only), so nothing is written on a bad checkpoint
    handles = {path: open_file(path) for path in by_file}
    for path, members in by_file.items():
        h = handles[path]
        for p in members:
            shape = tuple(h.get_slice(sources[p.name]).get_shape())
            if shape != tuple(p.shape):
                raise CheckpointError(
                    f"tensor {sources[p.name]!r} in {path} has shape {list(shape)} but the config gives {list(p.shape)}"
                )
    nbytes = 0
    with torch.no_grad():
        for path, members in by_file.items():
            h = handles[path]
            for p in members:
                part = read_slice(h, path, sources[p.name], p.shape, p.local_slices(rank, tp))
                nbytes += part.numel() * part.element_size()
                params[p.name].copy_(part)
    log.info("rank %d read %.1f MiB of a %.1f MiB checkpoint", rank, nbytes / 2**20, files.total_bytes / 2**20)
    return nbytes


def load_from_state_dict(module, plan, state: dict, rank: int, tp: int) -> None:
    params = dict(module.named_parameters())
    missing = [p.name for p in plan.params if _source_name(p, state) is None]
    if missing:
        raise CheckpointError(f"the given model has no weights for: {', '.join(missing)}")
    with torch.no_grad():
        for p in plan.params:
            full = state[_source_name(p, state)]
            if tuple(full.shape) != tuple(p.shape):
                raise CheckpointError(f"parameter {p.name} has shape {list(full.shape)}, expected {list(p.shape)}")
            params[p.name].copy_(full[p.local_slices(rank, tp)])


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
