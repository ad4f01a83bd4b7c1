"""Find a checkpoint's safetensors files, locally or through the Hugging Face hub.

Only the index and the .safetensors files are fetched, never .bin/.pt/.gguf.
Within a process group, the first rank downloads while the others wait, then they
read the cache; a failure on the first rank is sent to all ranks (no one hangs).
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass

import torch.distributed as dist

from ..errors import CheckpointError

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"


@dataclass
class CheckpointFiles:
    weight_map: dict  # tensor name -> absolute file path
    total_bytes: int


def _local(directory: str) -> CheckpointFiles:
    index = os.path.join(directory, INDEX)
    single = os.path.join(directory, SINGLE)
    if os.path.exists(index):
        with open(index) as f:
            try:
                weight_map = json.load(f)["weight_map"]
            except (ValueError, KeyError) as err:
                raise CheckpointError(f"{index} is not a safetensors index: {err}") from err
        files = {}
        for tensor, fname in weight_map.items():
            path = os.path.join(directory, fname)
            if not os.path.exists(path):
                raise CheckpointError(f"{index} maps tensor {tensor!r} to {fname}, which is absent from {directory}")
            files[tensor] = path
        return CheckpointFiles(files, sum(os.path.getsize(p) for p in set(files.values())))
    if os.path.exists(single):
        from .safetensors_io import tensor_names

        return CheckpointFiles({t: single for t in tensor_names(single)}, os.path.getsize(single))
    others = [f for f in os.listdir(directory) if f.endswith((".bin", ".pt", ".pth", ".ckpt", ".gguf"))]
    if others:
        raise CheckpointError(
            f"{directory} has only {', '.join(sorted(others))} weights; fxparallel loads safetensors only (it never "
            "unpickles). Convert once with: AutoModelForCausalLM.from_pretrained(dir).save_pretrained(out_dir)"
        )
    raise CheckpointError(f"{directory} has no {SINGLE} or {INDEX}")


def _download(repo_id: str, hub_kwargs: dict, progress: bool) -> str:
    """Fetch the index and safetensors files of a hub repo; returns the snapshot directory."""
    from huggingface_hub import hf_hub_download
    from huggingface_hub.errors import EntryNotFoundError, LocalEntryNotFoundError

    kwargs = dict(hub_kwargs)
    try:
        index = hf_hub_download(repo_id, INDEX, **kwargs)
    except EntryNotFoundError:
        index = None
    except LocalEntryNotFoundError:
        index = None
    if index is not None:
        with open(index) as f:
            names = sorted(set(json.load(f)["weight_map"].values()))
        for name in names:
            try:
                hf_hub_download(repo_id, name, **kwargs)
            except Exception as err:  # noqa: BLE001 - hub errors have many types
                raise CheckpointError(f"cannot fetch {name} of {repo_id!r} (listed in its {INDEX}): {err}") from err
        return os.path.dirname(index)
    try:
        single = hf_hub_download(repo_id, SINGLE, **kwargs)
    except Exception as err:  # noqa: BLE001
        offline = os.environ.get("HF_HUB_OFFLINE", "0") not in ("0", "", "false", "False") or kwargs.get("local_files_only")
        hint = " (offline mode: the files must already be in the hub cache)" if offline else ""
        raise CheckpointError(f"cannot resolve safetensors weights of {repo_id!r}{hint}: {err}") from err
    return os.path.dirname(single)


def resolve_checkpoint(name: str, hub_kwargs: dict, *, progress: bool = True) -> CheckpointFiles:
    if os.path.isdir(name):
        return _local(name)
    first = not dist.is_initialized() or dist.get_rank() == 0
    directory, error = None, None
    if first:
        try:
            directory = _download(name, hub_kwargs, progress)
        except CheckpointError as err:
            error = str(err)
    if dist.is_initialized() and dist.get_world_size() > 1:
        box = [error]
        dist.broadcast_object_list(box, src=0)
        error = box[0]
    if error is not None:
        raise CheckpointError(error)
    if not first:
        directory = _download(name, {**hub_kwargs, "local_files_only": True}, progress=False)
    return _local(directory)
