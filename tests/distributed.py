"""Run a function on N real gloo ranks (new processes) and collect results or errors.

Ranks are forked from multiprocessing's fork server, which imports torch, transformers, fxparallel and the test
helpers once for the session and captures a tiny model (``PRELOAD``, ``warm_capture.py``): each rank is a new
process, as isolated as a spawned one, without the ~6 s of CPU each spawned interpreter spends on those imports
nor the 1-3 s of Dynamo's first capture. A rank runs with the calling process's environment at the
call. ``fresh=True`` spawns a new interpreter instead, for a call whose libraries must be imported under that
environment (huggingface_hub reads its cache and endpoint variables on import).

A rank that fails reports its traceback; the others are bounded by the process
group timeout, so a test never hangs forever.
"""
from __future__ import annotations

import datetime
import os
import queue as queue_module
import socket
import time
import traceback

import torch.multiprocessing as mp

PRELOAD = ["torch", "torch.distributed", "torch._dynamo", "transformers", "transformers.models.llama.modeling_llama",
           "fxparallel", "fxparallel.module", "checks", "models", "warm_capture"]
mp.get_context("forkserver").set_forkserver_preload(PRELOAD)


def _start_fork_server() -> None:
    """Start the fork server with this folder on its PYTHONPATH: Python 3.11's fork server does not take the
    parent's sys.path (it is passed but not applied before the preload), so the helpers above would not load."""
    from multiprocessing import forkserver

    before = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [os.path.dirname(os.path.abspath(__file__)), before]))
    try:
        forkserver.ensure_running()
    finally:
        if before is None:
            del os.environ["PYTHONPATH"]
        else:
            os.environ["PYTHONPATH"] = before


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank, world_size, port, fn, args, queue, done, group_timeout=120.0, environment=None, backend="gloo"):
    import torch
    import torch.distributed as dist

    if environment is not None:  # the caller's, not the fork server's
        os.environ.clear()
        os.environ.update(environment)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world_size),
                      LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    try:
        dist.init_process_group(backend, rank=rank, world_size=world_size,
                                timeout=datetime.timedelta(seconds=group_timeout))
        result = fn(rank, world_size, *args)
        queue.put((rank, "ok", result))
    except BaseException:  # noqa: BLE001 - report everything to the parent
        queue.put((rank, "error", traceback.format_exc()))
    finally:
        # rank 0 hosts the group's store: no rank leaves before every rank has reported (as under torchrun,
        # whose agent keeps it), or a rank still exchanging through the store would lose it
        done.wait(timeout=group_timeout)
        if dist.is_initialized():
            dist.destroy_process_group()


def run_ranks(world_size: int, fn, *args, timeout: float = 300.0, group_timeout: float = 120.0,
              fresh: bool = False, backend: str = "gloo") -> list:
    """Run ``fn(rank, world_size, *args)`` on every rank; returns the per-rank results in rank order.
    ``timeout``: the wait for every rank's report; ``group_timeout``: the process group's own, after which a
    rank left waiting in a collective fails; ``fresh``: spawn new interpreters (module docstring); ``backend``:
    the group's (``"cuda:gloo"``: ranks sharing one GPU, CUDA tensors only)."""
    ctx = mp.get_context("spawn" if fresh else "forkserver")
    if not fresh:
        _start_fork_server()
    queue, done = ctx.Queue(), ctx.Event()
    port = free_port()
    environment = None if fresh else dict(os.environ)
    procs = [ctx.Process(target=_worker, args=(r, world_size, port, fn, args, queue, done, group_timeout, environment,
                                                      backend))
             for r in range(world_size)]
    for p in procs:
        p.start()
    results, errors = {}, {}
    deadline = time.monotonic() + timeout
    try:
        while len(results) + len(errors) < world_size:
            try:
                rank, status, payload = queue.get(timeout=1.0)
            except queue_module.Empty:
                # a rank that died before reporting (killed, or failed while starting) must not leave us waiting
                silent = [r for r, p in enumerate(procs) if not p.is_alive() and r not in results and r not in errors]
                if silent and queue.empty():
                    time.sleep(1.0)  # its report may still be in flight
                    if queue.empty():
                        codes = {r: procs[r].exitcode for r in silent}
                        raise AssertionError(f"ranks {silent} exited without reporting (exit codes {codes})")
                if time.monotonic() > deadline:
                    raise AssertionError(f"no report from ranks {sorted(set(range(world_size)) - set(results) - set(errors))} "
                                         f"within {timeout:.0f} s")
                continue
            (results if status == "ok" else errors)[rank] = payload
    finally:
        done.set()
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    if errors:
        first = min(errors)
        raise AssertionError(f"rank {first} failed:\n{errors[first]}")
    return [results[r] for r in range(world_size)]
