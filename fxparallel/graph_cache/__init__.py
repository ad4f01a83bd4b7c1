"""Planned graphs reused across calls and launches: capture, solve and rewrite run once per key
(``key.py``: model config and class, dtype, tp/cp rank and size, arguments, example shape, fixed
placements, options, and the versions of python, torch, transformers and fxparallel's source).
``codec.py`` turns a planned graph into JSON data and back, ``store.py`` keeps it on disk, ``first_rank.py`` has
group rank 0 plan every rank's graph and send it as that data (``FXPARALLEL_PLANNING=first``)."""
from __future__ import annotations

import logging
import time
from typing import Optional

from . import store
from .codec import PlannedGraph, Uncacheable, decode, encode
from .key import digest, graph_key

log = logging.getLogger("fxparallel")

__all__ = ["PlannedGraph", "graph_key", "keep", "lookup", "stats"]

stats = {"hits": 0, "misses": 0, "uncacheable": 0, "received": 0}  # this process's lookups (tests and benchmarks
# read it); received: planned on group rank 0 (first_rank.py)


class _Recorder(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.messages = []

    def emit(self, record):
        self.messages.append(record.getMessage())


def build_recording_warnings(build) -> PlannedGraph:
    recorder = _Recorder()
    log.addHandler(recorder)
    try:
        planned = build()
    finally:
        log.removeHandler(recorder)
    planned.warnings = tuple(recorder.messages)
    return planned


def lookup(key: Optional[dict]) -> Optional[PlannedGraph]:
    """The planned graph stored for ``key`` (its warnings logged again), or None: no key, no cache, no entry, or one
    that does not load (rebuilt by the caller)."""
    if key is None or store.cache_dir() is None:
        return None
    t = time.perf_counter()
    name = digest(key)
    entry = store.read(name, key)
    if entry is None:
        return None
    try:
        planned = decode(entry)
    except Exception as err:  # noqa: BLE001 - a bad entry is rebuilt, never trusted
        log.warning("graph cache: entry %s does not load (%s: %s); rebuilding it", name, type(err).__name__, err)
        return None
    planned.timings = {"graph cache": time.perf_counter() - t}
    stats["hits"] += 1
    return said_again(planned)


def said_again(planned: PlannedGraph) -> PlannedGraph:
    """``planned``, its planning's warnings logged again (a graph planned before, or on another rank)."""
    for message in planned.warnings:
        log.warning("%s", message)
    return planned


def keep(key: Optional[dict], planned: PlannedGraph, entry: Optional[dict] = None, counted: str = "misses") -> None:
    """Store ``planned`` (or its ``entry``, already encoded) for ``key``, counted in ``stats[counted]``; one that cannot
    be written as data is counted uncacheable and not stored."""
    if key is None:
        stats["uncacheable"] += 1
        return
    if store.cache_dir() is None:
        stats[counted] += 1
        return
    try:
        entry = entry if entry is not None else encode(planned)
    except Uncacheable as why:
        stats["uncacheable"] += 1
        log.debug("graph cache: not stored: %s", why)
        return
    stats[counted] += 1
    store.write(digest(key), key, entry)
