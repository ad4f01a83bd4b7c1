"""Who downloads, who shows progress, and agreeing on failure, within the tensor-parallel group.

Every function that exchanges values is entered by all ranks of ``group`` (each rank
of the group calls ``parallelize``), so a rank that fails still reaches it with its
error, and all ranks raise instead of one waiting for a peer that left. The parallel model's
own collective methods (``save_pretrained``, ``generate``) agree here before their first
collective, so one called on some ranks only (``if rank == 0: model.generate(...)``, a
single-device habit) is named in an error instead of waiting in a gather forever, or, over
NCCL, pairing with another collective and exchanging the wrong data.

The exchange runs through torch.distributed's key-value store, not a collective, so its
wait is bounded: a rank that does not arrive within ``FXPARALLEL_AGREE_TIMEOUT`` seconds
(default 300) of the others, and reports no progress meanwhile (downloading and reading
report progress, see ``heartbeat``), is named in an error raised on every rank, the late
one included when it arrives, instead of the peers waiting for the process group's
timeout (30 minutes by default). The ranks also check that they agree on the same step
(a rank that retried ``parallelize`` after an error would otherwise pair with the wrong one).

Values cross the store as JSON, never as pickles: the store is a TCP server without
authentication, and whatever can reach its port can write a key (``_decode``).
"""
from __future__ import annotations

import json
import logging
import os
import socket
import time

import torch.distributed as dist

from ..errors import CheckpointError, GroupError, RankTimeoutError

log = logging.getLogger("fxparallel")

TIMEOUT_ENV = "FXPARALLEL_AGREE_TIMEOUT"
DEFAULT_TIMEOUT = 300.0
BEAT_EVERY = 1.0  # seconds between two heartbeats of a rank (and between two looks at them)
_PREFIX = "fxparallel/agree"
_OK = b"ok"
_entered: dict = {}  # global ranks of a group -> agreement points entered (the same sequence on every member)


def default_group(group=None):
    """``group``, or the default group when torch.distributed runs, or None for one process."""
    if group is not None:
        return group
    return dist.group.WORLD if dist.is_available() and dist.is_initialized() else None


def _size(group) -> int:
    return dist.get_world_size(group) if group is not None else 1


def local_rank() -> int:
    """LOCAL_RANK as torchrun sets it; else the global rank (0 without torch.distributed)."""
    value = os.environ.get("LOCAL_RANK")
    if value is not None and value.strip().isdigit():
        return int(value)
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def first_on_node() -> bool:
    """The one process per node that shows progress bars."""
    return local_rank() == 0


def agree_timeout() -> float:
    """Seconds a rank waits at an agreement point for a peer that shows no progress."""
    value = os.environ.get(TIMEOUT_ENV, "").strip()
    if not value:
        return DEFAULT_TIMEOUT
    try:
        seconds = float(value)
    except ValueError:
        seconds = float("nan")
    if not seconds > 0:
        raise GroupError(f"{TIMEOUT_ENV}={value!r} must be a positive number of seconds (default {DEFAULT_TIMEOUT:g})")
    return seconds


def _store():
    try:
        return dist.distributed_c10d._get_default_store()
    except Exception:  # noqa: BLE001 - no store: fall back to a collective
        return None


def _ranks(group) -> tuple:
    return tuple(dist.get_process_group_ranks(group))


def _point_prefix(ranks: tuple, seq: int) -> str:
    return f"{_PREFIX}/{','.join(map(str, ranks))}/{seq}"


def _name(rank: int, ranks: tuple) -> str:
    return f"rank {rank}" + (f" (global rank {ranks[rank]})" if ranks[rank] != rank else "")


def _names(missing: list, ranks: tuple) -> str:
    return ", ".join(_name(r, ranks) for r in missing)


class _Heartbeat:
    """Tells the peers waiting at this rank's next agreement point that it is still making progress."""

    def __init__(self, store, key: str):
        self.store, self.key, self.count, self.last = store, key, 0, 0.0

    def __call__(self, *_):
        now = time.monotonic()
        if now - self.last < BEAT_EVERY:
            return
        self.last, self.count = now, self.count + 1
        try:
            self.store.set(self.key, str(self.count))
        except Exception:  # noqa: BLE001 - a lost store shows at the agreement point
            pass


def heartbeat(group):
    """A callable to call while working towards the next agreement point of ``group`` (cheap, throttled):
    peers waiting there extend their wait while it is called. A no-op without a multi-rank group."""
    group = default_group(group)
    store = _store() if _size(group) > 1 else None
    if store is None:
        return lambda *_: None
    ranks = _ranks(group)
    prefix = _point_prefix(ranks, _entered.get(ranks, 0))
    return _Heartbeat(store, f"{prefix}/beat/{dist.get_rank(group)}")


def _lost_store(err: Exception, what: str) -> GroupError:
    return GroupError(f"lost torch.distributed's store while agreeing on {what}: {type(err).__name__}: {err}. The "
                      "process hosting it (rank 0, or torchrun's agent) has probably exited")


def _encode(value) -> bytes:
    return json.dumps(value, allow_nan=False).encode("utf-8")


def _decode(raw, key: str, shape: str):
    """A value a rank wrote at ``key`` (JSON; ``shape`` says what it holds, for the message). Anything else
    (a pickle, say) is a GroupError: it is read as data and never run."""
    try:
        return json.loads(bytes(raw).decode("utf-8"))
    except (UnicodeDecodeError, ValueError):
        shown = bytes(raw)[:40]
        raise GroupError(f"torch.distributed's store holds {shown!r}{'...' if len(raw) > 40 else ''} at {key}, not "
                         f"the JSON {shape} fxparallel writes there: another program writes to this store, or a rank "
                         "runs another fxparallel version; it was not used") from None


def _entry(raw, key: str):
    """[step, what, value] as ``exchange`` stores it."""
    entry = _decode(raw, key, "[step, what, value]")
    if not (isinstance(entry, list) and len(entry) == 3 and isinstance(entry[0], str) and isinstance(entry[1], str)):
        raise GroupError(f"torch.distributed's store holds {entry!r:.80} at {key}, not the [step, what, value] "
                         "fxparallel writes there: another program writes to this store")
    return entry


def exchange(group, value, what: str, step=None, timeout=None) -> list:
    """Every rank's ``value`` (JSON: None, bool, int, float, str, lists, dicts with str keys; a tuple comes
    back as a list), in group-rank order; every rank of ``group`` must call it.

    ``what``: the step in words, for messages; ``step``: a name of the step that is the same on every rank
    (default ``what``), checked. Waits at most ``timeout`` seconds (default: ``agree_timeout()``) for a rank
    that has not arrived and reports no progress; then raises RankTimeoutError naming it, on every rank."""
    group = default_group(group)
    step = what if step is None else step
    mine = _encode([step, what, value])  # (a value that is not JSON raises TypeError here, on its own rank)
    if _size(group) == 1:
        return [json.loads(mine)[2]]
    store = _store()
    if store is None:  # pragma: no cover - init_process_group always makes one
        everyone = [None] * _size(group)
        dist.all_gather_object(everyone, mine.decode("utf-8"), group=group)
        return _check_same_step([_entry(e.encode("utf-8"), "all_gather_object") for e in everyone], _ranks(group))
    timeout = agree_timeout() if timeout is None else timeout
    ranks, me = _ranks(group), dist.get_rank(group)
    seq = _entered.get(ranks, 0)
    _entered[ranks] = seq + 1
    prefix = _point_prefix(ranks, seq)
    keys = [f"{prefix}/value/{r}" for r in range(len(ranks))]
    try:
        store.set(keys[me], mine)
        _forget(store, ranks, seq - 2, me)
        verdict = _wait(store, keys, f"{prefix}/verdict", prefix, ranks, me, what, timeout)
        if verdict != _OK:
            message, missing = _verdict(verdict, f"{prefix}/verdict")
            if me in missing:
                message += f" ({_name(me, ranks)} is this process: it arrived after its peers had stopped waiting)"
                others = {r: _entry(store.get(k), k) for r, k in enumerate(keys)
                          if r not in missing and store.check([k])}
                apart = [f"{_name(r, ranks)} at {w}" for r, (s, w, _) in others.items() if s != step]
                if apart:
                    message += (f". The ranks were at different steps ({'; '.join(apart)}; this process at {what}): "
                                "did a rank call parallelize again after an error?")
            raise RankTimeoutError(message)
        everyone = [_entry(store.get(k), k) for k in keys]
    except GroupError:
        raise
    except Exception as err:  # noqa: BLE001 - the store's connection errors have several types
        raise _lost_store(err, what) from err
    return _check_same_step(everyone, ranks)


def _wait(store, keys, verdict_key, prefix, ranks, me, what, timeout) -> bytes:
    """Poll until every rank arrived or one is late; the first rank to decide writes the verdict, which
    every rank then obeys (the store's compare_set makes the decision atomic)."""
    start = time.monotonic()
    deadline = start + timeout
    beats, next_look, told, pause = {}, start + BEAT_EVERY, False, 0.0005
    while True:
        if store.check([verdict_key]):
            return store.get(verdict_key)
        if store.check(keys):
            return store.compare_set(verdict_key, "", _OK)
        now = time.monotonic()
        if now >= next_look:  # a rank still downloading or reading extends the wait
            next_look = now + BEAT_EVERY
            for r in range(len(keys)):
                beat_key = f"{prefix}/beat/{r}"
                if r != me and store.check([beat_key]):
                    beat = store.get(beat_key)
                    if beats.get(r) != beat:
                        beats[r] = beat
                        deadline = max(deadline, now + timeout)
            if not told and now - start > min(10.0, timeout / 2):
                told = True
                missing = [r for r, k in enumerate(keys) if not store.check([k])]
                log.info("waiting for %s at %s (at most %g s without progress, %s)", _names(missing, ranks), what,
                         timeout, TIMEOUT_ENV)
        if now >= deadline:
            missing = [r for r, k in enumerate(keys) if not store.check([k])]
            if missing:
                message = (f"{_name(me, ranks)} waited {now - start:.0f} s for {_names(missing, ranks)} of the "
                           f"tensor-parallel group (ranks {list(ranks)}) at {what}: "
                           f"{'it' if len(missing) == 1 else 'they'} did not arrive within {timeout:g} s "
                           f"({TIMEOUT_ENV}) and reported no progress: stuck, exited, not making this call (one "
                           "called on some ranks only, `if rank == 0: ...`, never completes), or retrying after an "
                           "error (see that rank's own output)")
                return store.compare_set(verdict_key, "", _encode([message, missing]))
            continue
        time.sleep(pause)
        pause = min(pause * 2, 0.2)


def _verdict(raw, key: str) -> tuple:
    """(message, late ranks) of a timeout verdict."""
    verdict = _decode(raw, key, "[message, late ranks]")
    if not (isinstance(verdict, list) and len(verdict) == 2 and isinstance(verdict[0], str)
            and isinstance(verdict[1], list) and all(isinstance(r, int) for r in verdict[1])):
        raise GroupError(f"torch.distributed's store holds {verdict!r:.80} at {key}, not the [message, late ranks] "
                         "fxparallel writes there: another program writes to this store")
    return verdict[0], verdict[1]


def _forget(store, ranks: tuple, seq: int, me: int) -> None:
    """Delete this rank's keys of an agreement point every rank has left (two points ago)."""
    if seq < 0:
        return
    prefix = _point_prefix(ranks, seq)
    for key in [f"{prefix}/value/{me}", f"{prefix}/beat/{me}"] + ([f"{prefix}/verdict"] if me == 0 else []):
        try:
            store.delete_key(key)
        except Exception:  # noqa: BLE001 - stores without delete keep a few bytes
            pass


def _check_same_step(everyone: list, ranks: tuple) -> list:
    """The values of ``everyone`` ([(step, what, value)] by rank), after checking all ranks are at one step."""
    if len({step for step, _, _ in everyone}) > 1:
        listing = "; ".join(f"{_name(r, ranks)} at {what}" for r, (_, what, _) in enumerate(everyone))
        raise GroupError(f"the ranks of the tensor-parallel group are at different steps: {listing}. Every rank "
                         "must take the same steps: pass the same model to parallelize on every rank (a directory "
                         "must exist on every node), call the model's collective methods (save_pretrained, generate) "
                         "on every rank, not `if rank == 0:`, and let an error end every rank rather than calling "
                         "parallelize again on one")
    return [value for _, _, value in everyone]


def is_node_downloader(group) -> bool:
    """True on one member of ``group`` per host: the one with the lowest local rank.

    Other groups on the same host may have their own downloader; the hub cache's
    file locks make the later one find the file instead of fetching it again.
    """
    if _size(group) == 1:
        return True
    me = [socket.gethostname(), local_rank(), dist.get_rank()]  # a list: exchange's values come back as lists
    everyone = exchange(group, me, "choosing one downloader per node", step="downloader")
    return min(m for m in everyone if m[0] == me[0]) == me


def agree(group, error, what: str, step=None) -> None:
    """Raise on every rank if ``error`` is set on any rank of ``group`` (else return).

    ``step``: a name of this agreement point that is the same on every rank (default ``what``)."""
    mine = None if error is None else f"{type(error).__name__}: {error}"
    everyone = exchange(group, mine, what, step=step) if _size(group) > 1 else [mine]
    failed = [(r, m) for r, m in enumerate(everyone) if m is not None]
    if error is not None:
        raise error
    if failed:
        rank, message = failed[0]
        raise CheckpointError(f"{what} failed on rank {rank} of the tensor-parallel group: {message}")
