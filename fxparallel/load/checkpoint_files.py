"""Find a checkpoint's safetensors files: a local directory, or a hub id through ``huggingface_hub``.

For a hub id, one member of the tensor-parallel group per node downloads (the
others wait), then every rank reads the cache with ``local_files_only``. The group
agrees on success after each step, so a failure on the downloader becomes the
same clear error on every rank instead of a hang.
"""
from __future__ import annotations

import os
import stat
from dataclasses import dataclass

from ..errors import CheckpointError
from .coordinate import agree, default_group, first_on_node, heartbeat, is_node_downloader
from .hub import INDEX, REFUSED, SINGLE, check_shard_name, convert_hint, fetch, read_index


@dataclass
class CheckpointFiles:
    weight_map: dict  # tensor name -> absolute file path
    total_bytes: int  # size of the safetensors files the weight map names
    source: str = ""  # the index or single file, for messages


def from_file(path: str) -> CheckpointFiles:
    """CheckpointFiles of a single ``.safetensors`` file or of a safetensors index."""
    _require_regular(path, path)
    if path.endswith(".json"):
        directory = os.path.dirname(path)
        root = _confinement_root(directory)
        files, shards, absent = {}, {}, {}  # tensor -> path, file name -> path, file name -> tensors
        for tensor, name in read_index(path).items():
            check_shard_name(path, name)
            full = os.path.join(directory, name)
            if os.path.exists(full):
                files[tensor] = full
                shards[name] = full
            else:
                absent.setdefault(name, []).append(tensor)
        if absent:
            listing = "; ".join(f"{name} (holding {len(ts)} tensor(s), e.g. {ts[0]!r})" for name, ts in absent.items())
            raise CheckpointError(f"{path} points to file(s) absent from {directory}: {listing}")
        for name, full in sorted(shards.items()):
            _check_shard(path, name, full, root)
        return CheckpointFiles(files, sum(os.path.getsize(p) for p in set(files.values())), path)
    from .safetensors_io import tensor_names

    return CheckpointFiles({t: path for t in tensor_names(path)}, os.path.getsize(path), path)


def _confinement_root(directory: str) -> str:
    """The folder an index's shards must resolve into: its own; in a hub cache snapshot
    (``<repo>/snapshots/<commit>/``, whose files are symlinks into ``<repo>/blobs/``) the repo folder."""
    path = os.path.abspath(directory)
    while True:
        parent = os.path.dirname(path)
        if parent == path:
            return directory
        if os.path.basename(parent) == "snapshots" and os.path.isdir(os.path.join(os.path.dirname(parent), "blobs")):
            return os.path.dirname(parent)
        path = parent


def _check_shard(index: str, name: str, full: str, root: str) -> None:
    """The shard ``name`` of ``index`` (at ``full``) resolves to a regular file inside ``root``."""
    real, real_root = os.path.realpath(full), os.path.realpath(root)
    if os.path.commonpath([real, real_root]) != real_root:
        raise CheckpointError(f"{index} maps tensors to the shard {name!r}, which resolves to {real}, outside "
                              f"{real_root}; refusing to read it. Copy the file into the checkpoint's folder")
    _require_regular(full, f"the shard {name!r} of {index}")


def _require_regular(path: str, what: str) -> None:
    """Refuse a FIFO, device or directory before opening it (opening a FIFO waits forever)."""
    try:
        mode = os.stat(path).st_mode
    except OSError as err:
        raise CheckpointError(f"cannot read {what} ({type(err).__name__}: {err})") from None
    if not stat.S_ISREG(mode):
        kind = "a directory" if stat.S_ISDIR(mode) else "a FIFO" if stat.S_ISFIFO(mode) else "not a regular file"
        raise CheckpointError(f"{what} is {kind}, not a regular file; refusing to read it")


def local_checkpoint(directory: str) -> CheckpointFiles:
    """A directory with model.safetensors (preferred, as transformers does) or model.safetensors.index.json."""
    for name in (SINGLE, INDEX):
        path = os.path.join(directory, name)
        if os.path.exists(path):
            return from_file(path)
    refused = sorted(f for f in os.listdir(directory) if f.endswith(REFUSED))
    if refused:
        raise CheckpointError(f"{directory} has only {', '.join(refused)} weights, no {SINGLE} or {INDEX}. "
                              + convert_hint(directory))
    raise CheckpointError(f"{directory} has no {SINGLE} or {INDEX}")


def resolve_checkpoint(name: str, hub_kwargs: dict, *, progress: bool = True, group=None) -> CheckpointFiles:
    """The safetensors files of ``name`` (a directory or a hub id), the same on every rank of ``group``.

    ``group``: the tensor-parallel process group (default: the default group, or none
    without torch.distributed). Every rank of it must call this.
    """
    group = default_group(group)
    files, error = None, None
    if os.path.isdir(name):
        try:
            files = local_checkpoint(name)
        except Exception as err:  # noqa: BLE001 - shared with the group by agree
            error = err
        agree(group, error, f"reading the checkpoint in {name}", step="read checkpoint")
        return files
    downloader = is_node_downloader(group)
    path = None
    if downloader:
        try:
            path = fetch(name, hub_kwargs, progress=progress and first_on_node(), heartbeat=heartbeat(group))
        except Exception as err:  # noqa: BLE001
            error = err
    agree(group, error, f"downloading {name!r}", step="download checkpoint")
    try:
        if not downloader:  # the files are in this node's cache now
            path = fetch(name, {**hub_kwargs, "local_files_only": True})
        files = from_file(path)
    except Exception as err:  # noqa: BLE001
        error = err
    agree(group, error, f"reading the cached checkpoint of {name!r}", step="read cached checkpoint")
    return files
