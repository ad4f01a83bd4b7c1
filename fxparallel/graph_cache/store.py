"""Planned graphs on disk, one file per key, under the Hugging Face cache home.

Where: ``$FXPARALLEL_GRAPH_CACHE`` when set to a directory (``0`` / ``off``: no cache; ``1`` / ``on``:
the default place, not a directory named ``1``), else ``$HF_HOME/fxparallel/graphs`` (``HF_HOME``
defaults to ``~/.cache/huggingface``), the way ``huggingface_hub`` places its own caches.

A file is JSON: the key it was built for, the entry, and the sha256 of both. It is written to a
temporary name and renamed into place, so concurrent ranks and processes see a whole file or
none (writers of the same key write the same bytes). A file whose digest or key does not match,
or that does not parse, is never used: the graph is rebuilt, the file replaced, and a warning
says why. The cache holds generated Python code that fxparallel runs: it is as trusted as the
directory it lives in (keep it writable by you only, as you would the hub cache)."""
from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile
from typing import Optional

log = logging.getLogger("fxparallel")

ENV = "FXPARALLEL_GRAPH_CACHE"
_OFF = ("0", "off", "false", "no", "")
_ON = ("1", "on", "true", "yes")


def cache_dir() -> Optional[str]:
    """The directory planned graphs are kept in, or None when the cache is off."""
    value = os.environ.get(ENV)
    if value is not None and value.strip().lower() not in _ON:
        return None if value.strip().lower() in _OFF else os.path.expanduser(value)
    from huggingface_hub import constants

    return os.path.join(constants.HF_HOME, "fxparallel", "graphs")


def _path(root: str, name: str) -> str:
    return os.path.join(root, name[:2], name + ".json")


def _checksum(key: dict, entry: dict) -> str:
    return hashlib.sha256(json.dumps([key, entry], sort_keys=True).encode()).hexdigest()


def read(name: str, key: dict) -> Optional[dict]:
    """The entry stored for ``key`` (file ``name``), or None when there is none or it cannot be trusted."""
    root = cache_dir()
    if root is None:
        return None
    path = _path(root, name)
    try:
        with open(path, encoding="utf-8") as f:
            stored = json.load(f)
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as err:
        log.warning("graph cache: %s is unreadable (%s); rebuilding it", path, err)
        return None
    if not isinstance(stored, dict) or stored.get("sha256") != _checksum(stored.get("key"), stored.get("entry")):
        log.warning("graph cache: %s does not match its checksum (damaged or edited); rebuilding it", path)
        return None
    if stored["key"] != key:
        changed = sorted(k for k in set(key) | set(stored["key"]) if key.get(k) != stored["key"].get(k))
        log.warning("graph cache: %s was built for another key (%s differ); rebuilding it", path, ", ".join(changed))
        return None
    return stored["entry"]


def write(name: str, key: dict, entry: dict) -> None:
    """Store ``entry`` for ``key``; a cache that cannot be written is skipped with a warning."""
    root = cache_dir()
    if root is None:
        return
    path = _path(root, name)
    text = json.dumps({"key": key, "entry": entry, "sha256": _checksum(key, entry)}, sort_keys=True)
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), prefix=".tmp-", suffix=".json")
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                f.write(text)
            os.replace(tmp, path)
        except BaseException:
            if os.path.exists(tmp):
                os.unlink(tmp)
            raise
    except OSError as err:
        log.warning("graph cache: cannot write %s (%s); continuing without it", path, err)
