"""Fetch a checkpoint's safetensors files from the Hugging Face hub (or find them in its cache).

Only ``model.safetensors``, or ``model.safetensors.index.json`` and the files its
weight map names, are fetched: never ``.bin``/``.pt``/``.gguf`` siblings, nor
safetensors files the index does not list. Downloads show one progress bar (bytes,
rate) for all files when ``progress`` is set; huggingface_hub's per-file bars are off.
"""
from __future__ import annotations

import json
import logging
import os

from ..errors import CheckpointError
from .progress import byte_bar

log = logging.getLogger("fxparallel")

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
REFUSED = (".bin", ".pt", ".pth", ".ckpt", ".gguf", ".h5", ".msgpack")


def convert_hint(where: str) -> str:
    return (f"fxparallel loads safetensors only (it never unpickles). Convert once, in a process you trust: "
            f"AutoModelForCausalLM.from_pretrained({where!r}).save_pretrained(out_dir) writes safetensors "
            "(or use the hub's 'convert to safetensors' Space), then pass out_dir")


def is_offline(hub_kwargs: dict) -> bool:
    from huggingface_hub import constants

    return bool(hub_kwargs.get("local_files_only")) or bool(constants.HF_HUB_OFFLINE)


class DownloadProgress:
    """One bar (bytes, rate) for every file of a checkpoint; ``tqdm_class`` is handed to huggingface_hub,
    which makes one per downloaded file: those stay silent and feed the bar. Nothing shows if nothing
    is downloaded."""

    def __init__(self, repo_id: str, show: bool, heartbeat=None):
        from tqdm.auto import tqdm

        self.bar, self.total, self.downloaded = None, 0, 0
        progress = self

        def open_bar():
            if show and progress.bar is None:
                progress.bar = byte_bar(f"download {repo_id}", progress.total or None)
            return progress.bar

        class PerFile(tqdm):
            def __init__(self, *args, **kwargs):
                kwargs.pop("name", None)
                kwargs["disable"] = True
                super().__init__(*args, **kwargs)

            def update(self, n=1):
                progress.downloaded += n or 0
                if heartbeat is not None:
                    heartbeat()
                bar = open_bar()
                if bar is not None and n:
                    if bar.total is not None and bar.n + n > bar.total:
                        bar.total = bar.n + n
                    bar.update(n)
                return super().update(n)

        self.tqdm_class = PerFile

    def expect(self, nbytes: int) -> None:
        self.total += nbytes
        if self.bar is not None and nbytes:
            self.bar.total = self.bar.n + nbytes
            self.bar.refresh()

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def _download(repo_id: str, filename: str, hub_kwargs: dict, tqdm_class):
    """Path of ``filename`` in the cache (downloading it if needed), or None if the repo lacks it."""
    from huggingface_hub import hf_hub_download
    from huggingface_hub.errors import EntryNotFoundError, RepositoryNotFoundError, RevisionNotFoundError

    try:
        return hf_hub_download(repo_id, filename, tqdm_class=tqdm_class, **hub_kwargs)
    except RevisionNotFoundError as err:
        raise CheckpointError(f"hub repo {repo_id!r} has no revision {hub_kwargs.get('revision')!r}: {err}") from err
    except RepositoryNotFoundError as err:
        raise CheckpointError(f"hub repo {repo_id!r} was not found or is not accessible with the given token "
                              f"(gated or private repos need token=): {err}") from err
    except EntryNotFoundError:  # remote: the repo has no such file; local: the cache does not hold it
        return None
    except Exception as err:  # noqa: BLE001 - network and cache errors have many types
        raise CheckpointError(f"cannot fetch {filename} of {repo_id!r}: {type(err).__name__}: {err}") from err


def _repo_files(repo_id: str, hub_kwargs: dict) -> list:
    """Names of the repo's files: from the cached snapshot when offline, else from the hub."""
    from huggingface_hub import HfApi, try_to_load_from_cache

    if is_offline(hub_kwargs):
        config = try_to_load_from_cache(repo_id, "config.json", cache_dir=hub_kwargs.get("cache_dir"),
                                        revision=hub_kwargs.get("revision"))
        if not isinstance(config, str):
            return []
        snapshot = os.path.dirname(config)
        return [os.path.relpath(os.path.join(d, f), snapshot) for d, _, fs in os.walk(snapshot) for f in fs]
    try:
        return HfApi(token=hub_kwargs.get("token")).list_repo_files(repo_id, revision=hub_kwargs.get("revision"))
    except Exception:  # noqa: BLE001 - only used to word the error better
        return []


def _no_safetensors(repo_id: str, hub_kwargs: dict) -> CheckpointError:
    files = _repo_files(repo_id, hub_kwargs)
    refused = sorted(f for f in files if f.endswith(REFUSED))
    if refused:
        return CheckpointError(f"hub repo {repo_id!r} has only {', '.join(refused)} weights, no {SINGLE} or {INDEX}. "
                               + convert_hint(repo_id))
    if is_offline(hub_kwargs):
        from huggingface_hub import constants

        cache = hub_kwargs.get("cache_dir") or constants.HF_HUB_CACHE
        return CheckpointError(
            f"hub id {repo_id!r} cannot be resolved offline (HF_HUB_OFFLINE=1 or local_files_only=True): neither "
            f"{SINGLE} nor {INDEX} is in the hub cache {cache}"
            + (f" for revision {hub_kwargs['revision']!r}" if hub_kwargs.get("revision") else "")
            + f". Download it once online (e.g. `hf download {repo_id}`) or pass a local directory"
        )
    return CheckpointError(f"hub repo {repo_id!r} has neither {SINGLE} nor {INDEX}")


def read_index(path: str) -> dict:
    """The weight map (tensor -> file name) of a safetensors index, with a clear error if malformed."""
    try:
        with open(path) as f:
            weight_map = json.load(f)["weight_map"]
        if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
            raise ValueError("weight_map must map tensor names to file names")
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise CheckpointError(f"{path} is not a safetensors index: {type(err).__name__}: {err}") from err
    return weight_map


def check_shard_name(index: str, name: str) -> None:
    """A file name of ``index``'s weight map must stay in the index's folder: relative, no ``..``."""
    parts = name.replace("\\", "/").split("/")
    why = None
    if not name or "\0" in name:
        why = "which is not a file name"
    elif os.path.isabs(name) or name.startswith(("/", "\\")) or (name[:1].isalpha() and name[1:2] == ":"):
        why = "an absolute path"
    elif ".." in parts:
        why = "which leads out of the index's folder ('..')"
    if why is not None:
        raise CheckpointError(f"{index} maps tensors to the shard {name!r}, {why}; refusing to read it. A safetensors "
                              "index names files of its own folder")


def _will_download(repo_id: str, names: list, hub_kwargs: dict) -> int:
    """Bytes that downloading ``names`` will fetch (0 when offline or unknown): the bar's total."""
    from huggingface_hub import hf_hub_download

    if is_offline(hub_kwargs):
        return 0
    total = 0
    for name in names:
        try:
            info = hf_hub_download(repo_id, name, dry_run=True, **hub_kwargs)
        except Exception:  # noqa: BLE001 - the real download reports errors
            continue
        if getattr(info, "will_download", False) and getattr(info, "file_size", None):
            total += info.file_size
    return total


def fetch(repo_id: str, hub_kwargs: dict, progress: bool = False, heartbeat=None) -> str:
    """Fetch what a hub checkpoint needs; returns the cached path of its single file or of its index.

    ``heartbeat``: called as bytes arrive (see ``coordinate.heartbeat``: peers waiting for this download
    wait as long as it progresses)."""
    bar = DownloadProgress(repo_id, progress, heartbeat)
    try:
        if progress:
            bar.expect(_will_download(repo_id, [SINGLE], hub_kwargs))
        single = _download(repo_id, SINGLE, hub_kwargs, bar.tqdm_class)
        if single is not None:
            return single
        index = _download(repo_id, INDEX, hub_kwargs, bar.tqdm_class)
        if index is None:
            raise _no_safetensors(repo_id, hub_kwargs)
        weight_map = read_index(index)
        names = sorted(set(weight_map.values()))
        for name in names:
            check_shard_name(index, name)
        if progress:
            bar.expect(_will_download(repo_id, names, hub_kwargs))
        for name in names:
            if _download(repo_id, name, hub_kwargs, bar.tqdm_class) is None:
                count = sum(1 for v in weight_map.values() if v == name)
                where = "the hub cache (offline)" if is_offline(hub_kwargs) else f"hub repo {repo_id!r}"
                raise CheckpointError(f"{INDEX} of {repo_id!r} maps {count} tensor(s) to {name}, which is absent "
                                      f"from {where}")
        return index
    finally:
        if bar.downloaded:
            log.info("downloaded %.1f MiB of %r", bar.downloaded / 2**20, repo_id)
        bar.close()
