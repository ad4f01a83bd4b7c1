"""Planned graphs reused across calls and launches: capture, solve and rewrite run once per key
(``key.py``: model config and class, dtype, tp/cp rank and size, arguments, example shape, fixed
placements, options, and the versions of python, torch, transformers and fxparallel's source).
``codec.py`` turns a planned graph into JSON data and back, ``store.py`` keeps it on disk."""
from __future__ import annotations

import logging
import time
from typing import Callable

from . import store
from .codec import PlannedGraph, Uncacheable, decode, encode
from .key import digest, graph_key

log = logging.getLogger("fxparallel")

__all__ = ["PlannedGraph", "cached", "graph_key", "stats"]

stats = {"hits": 0, "misses": 0, "uncacheable": 0}  # this process's lookups (tests and benchmarks read it)


class _Recorder(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.messages = []

    def emit(self, record):
        self.messages.append(record.getMessage())


def _build_recording_warnings(build) -> PlannedGraph:
    recorder = _Recorder()
    log.addHandler(recorder)
    try:
        planned = build()
    finally:
        log.removeHandler(recorder)
    planned.warnings = tuple(recorder.messages)
    return planned


def cached(key: dict, build: Callable[[], PlannedGraph]) -> PlannedGraph:
    """The planned graph of ``key`` from the cache, else ``build()`` (and stored). ``key`` None: built."""
    if key is None or store.cache_dir() is None:
        stats["uncacheable" if key is None else "misses"] += 1
        return build()
    t = time.perf_counter()
    name = digest(key)
    entry = store.read(name, key)
    if entry is not None:
        try:
            planned = decode(entry)
        except Exception as err:  # noqa: BLE001 - a bad entry is rebuilt, never trusted
            log.warning("graph cache: entry %s does not load (%s: %s); rebuilding it", name, type(err).__name__, err)
        else:
            planned.timings = {"graph cache": time.perf_counter() - t}
            stats["hits"] += 1
            for message in planned.warnings:
                log.warning("%s", message)
            return planned
    planned = _build_recording_warnings(build)
    try:
        entry = encode(planned)
    except Uncacheable as why:
        stats["uncacheable"] += 1
        log.debug("graph cache: not stored: %s", why)
        return planned
    stats["misses"] += 1
    store.write(name, key, entry)
    return planned
