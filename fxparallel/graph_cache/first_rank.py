"""One rank plans for its tensor-parallel group (``FXPARALLEL_PLANNING=first``; default ``each``: every rank plans
alone, as it always did).

The ranks of a group capture the same graph: their rewritten code differs only where the rank shows (where this
rank's rows of the vocabulary start, an uneven split's local sizes). Capture is most of planning's CPU, so where
ranks share few cores (a CPU job of several ranks on one machine, a test suite) it pays to capture once: group
rank 0 captures, then solves and rewrites the graph for every rank in turn (the graph it would have built itself:
its rank, its device) and sends each rank its graph as the graph cache's data (``codec.py``); the rank decodes it
with the same checks as a cache file and keeps it in its own cache. On a GPU node with a core per rank, planning
on every rank at once is faster: rank 0's solves and rewrites run one after another.

Per graph: one exchange through torch.distributed's store (JSON) in which the ranks compare what they plan (the
graph key without the rank and device index; where keys differ, say other versions or shapes, each rank plans
alone as before) and whether their own cache has it (all: nothing is sent); then rank 0's verdict (its graphs'
size, or the error planning raised, which every rank then raises) through a second exchange, bounded like every
agreement point while rank 0 shows progress; and the graphs as bytes over the group's own connections (a
broadcast), not through the store, which any process that reaches its port can write to.
"""
from __future__ import annotations

import json
import logging
import os
import threading
import time
from typing import Callable, Optional

import torch
import torch.distributed as dist

from ..errors import ArgumentError
from ..load.coordinate import exchange, heartbeat
from . import build_recording_warnings, keep, lookup, said_again
from .codec import PlannedGraph, Uncacheable, decode, encode, plain_name, resolve
from .key import digest

log = logging.getLogger("fxparallel")

ENV = "FXPARALLEL_PLANNING"
_MODES = ("each", "first")


def planning_mode() -> str:
    value = os.environ.get(ENV, "each").strip().lower() or "each"
    if value not in _MODES:
        raise ArgumentError(f"{ENV}={value!r}: expected one of {', '.join(_MODES)} (each rank plans alone, or group "
                            "rank 0 plans for every rank)")
    return value


def planned_for_group(key: Optional[dict], group, device: torch.device,
                      build: Callable[[int, torch.device], PlannedGraph]) -> PlannedGraph:
    """This rank's planned graph of ``key``: from its cache, else built by ``build(rank, device)`` on this rank or,
    under ``FXPARALLEL_PLANNING=first``, on group rank 0 for every rank. Every rank of ``group`` calls it."""
    mine = lookup(key)

    def alone() -> PlannedGraph:
        if mine is not None:
            return mine
        planned = build_recording_warnings(lambda: build(group.rank, device))
        keep(key, planned)
        return planned

    if key is None or group.process_group is None or group.size == 1 or planning_mode() != "first":
        return alone()
    device = torch.device(device)
    same = digest(dict(key, tp=[group.size, group.handle], device=device.type))
    everyone = exchange(group.process_group, {"graph": same, "device": device.index, "cached": mine is not None},
                        "comparing the graphs the ranks plan", step="graph planning")
    if len({e["graph"] for e in everyone}) > 1:  # different graphs (versions, arguments): as before, and the plans'
        return alone()                           # agreement at parallelize's end names any difference
    if all(e["cached"] for e in everyone):
        return mine
    devices = [torch.device(device.type, e["device"]) if e["device"] is not None else torch.device(device.type)
               for e in everyone]
    if group.rank == 0:
        return _plan_for_every_rank(key, group, device, devices, build, mine)
    return _receive(key, group, device, mine, alone)


def _plan_for_every_rank(key, group, device, devices, build, mine) -> PlannedGraph:
    t = time.perf_counter()
    planned, entries, error, raised = None, None, None, None
    done = threading.Event()
    beats = threading.Thread(target=_beat, args=(heartbeat(group.process_group), done), daemon=True)
    beats.start()
    try:
        others = [_quietly(lambda r=r: build(r, devices[r])) for r in range(1, group.size)]
        planned = mine or build_recording_warnings(lambda: build(0, devices[0]))
        entries = [encode(p) for p in [planned, *others]]
        for entry in entries[1:]:
            entry["warnings"] = list(planned.warnings)  # the plan's warnings, said (once) on rank 0
    except Uncacheable as why:  # a graph that cannot be written as data: every rank builds its own
        entries, error = None, {"alone": str(why)}
    except Exception as err:  # noqa: BLE001 - every rank raises it
        error = {"error": _error_record(err)}
        raised = err
    finally:
        done.set()
    payload = json.dumps(entries).encode() if entries is not None else None
    exchange(group.process_group, error or {"bytes": len(payload)}, "receiving the graphs rank 0 planned",
             step="graph planning verdict")
    if raised is not None:
        raise raised
    if entries is not None:
        _broadcast(payload, group, device)
    if mine is None:
        keep(key, planned, entries[0] if entries is not None else None)
    planned.timings = dict(planned.timings, **{"planned for every rank": time.perf_counter() - t})
    return planned


def _receive(key, group, device, mine, alone) -> PlannedGraph:
    t = time.perf_counter()
    verdict = exchange(group.process_group, None, "receiving the graphs rank 0 planned",
                       step="graph planning verdict")[0]
    if "error" in verdict:
        raise _error_from(verdict["error"])
    if "alone" in verdict:
        log.debug("graph planning: rank 0 could not send the graph (%s); planning it on this rank", verdict["alone"])
        return alone()
    entries = json.loads(_broadcast(None, group, device, size=verdict["bytes"]))
    if mine is not None:
        return mine
    planned = decode(entries[group.rank])
    keep(key, planned, entries[group.rank], counted="received")
    planned.timings = {"planned on rank 0": time.perf_counter() - t}
    return said_again(planned)


def _beat(beat, done: threading.Event) -> None:
    """Rank 0 is planning: the peers waiting for its verdict extend their wait (coordinate.heartbeat)."""
    while not done.wait(0.5):
        beat()


def _broadcast(payload: Optional[bytes], group, device, size: int = 0) -> bytes:
    """Rank 0's ``payload`` (not empty) on every rank, over the group's own connections."""
    if payload is not None:
        data = torch.frombuffer(bytearray(payload), dtype=torch.uint8).to(device)
    else:
        data = torch.empty(size, dtype=torch.uint8, device=device)
    dist.broadcast(data, group=group.process_group, group_src=0)
    return payload if payload is not None else bytes(data.cpu().numpy())


class _Silence(logging.Filter):
    def filter(self, record):
        return False


def _quietly(build):
    """``build()`` without logging: another rank's graph, whose warnings are the plan's, said once for rank 0."""
    silence = _Silence()
    log.addFilter(silence)
    try:
        return build()
    finally:
        log.removeFilter(silence)


# ---- an error raised on rank 0, raised again on every rank ----------------------------------
_ERROR_MODULES = ("fxparallel", "builtins")


def _jsonable(value) -> bool:
    """Can ``value`` cross an exchange (coordinate._encode's JSON: no NaN or infinity)?"""
    try:
        json.dumps(value, allow_nan=False)
    except (TypeError, ValueError):
        return False
    return True


def _error_record(err: Exception) -> dict:
    cls = type(err)
    return {"module": cls.__module__, "qualname": cls.__qualname__, "message": str(err),
            "args": list(err.args) if _jsonable(list(err.args)) else None,
            "attributes": {k: v for k, v in vars(err).items() if plain_name(k) and _jsonable(v)}}


def _error_class(module: str, qualname: str):
    """The exception class named, where it is one of fxparallel's or a builtin one (control flow catches them:
    ``CacheNotCarried``, ``PromptLengthFixed``), else None."""
    try:
        obj = resolve(module, qualname, _ERROR_MODULES)
    except (ValueError, ImportError, AttributeError):
        return None
    return obj if isinstance(obj, type) and issubclass(obj, Exception) else None


def _error_from(record: dict) -> Exception:
    cls = _error_class(str(record.get("module")), str(record.get("qualname")))
    message = str(record.get("message"))
    if cls is None or record.get("args") is None:
        err = RuntimeError(f"{record.get('qualname')}: {message}")
    else:
        err = cls.__new__(cls)
        err.args = tuple(record["args"])
        for name, value in (record.get("attributes") or {}).items():
            if plain_name(str(name)):  # (the record crossed the store: plain names only)
                setattr(err, name, value)
    err.add_note("raised on rank 0 of the tensor-parallel group, which plans the graphs of every rank "
                 f"({ENV}=first)")
    return err
