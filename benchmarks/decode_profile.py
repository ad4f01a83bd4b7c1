"""Where a decode step's time goes, per rank, in fxparallel's ``generate`` and transformers' TP ``generate``.

    OMP_NUM_THREADS=1 torchrun --nproc_per_node=2 benchmarks/decode_profile.py --shape hidden=1024,layers=8,... \
        --out benchmarks/results/decode_profile_tp2.json

Both systems load the same checkpoint in the same processes (as ``benchmarks/generate.py``, whose systems and
checkpoint it uses). Each is profiled (``torch.profiler``, CPU) over a greedy ``generate`` of --new-tokens tokens and
over one of a single token; the difference, divided by the decode steps, is one decode step: the self time of the
ops by kind (matrix products, attention, the other aten ops), the wall time inside the collectives
(``torch.distributed``'s functions timed around each call: the wait for the other rank included, which the
profiler's own records of the c10d ops leave out) and what is left of the step's wall time (Python: the model's
code, generate's loop, the framework's dispatch). The profiler's own overhead is in every figure it gives (it
records each op, and a system that runs more ops pays more), so each system is also timed without it: the
collectives' wall time and the rest of the step. Rank 0 prints the table and writes the JSON.
"""
from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import sys
import time

import torch
import torch.distributed as dist

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from comm_counter import DIST_FUNCTIONS  # noqa: E402
from generate import (FxParallel, TransformersTP, build_checkpoint, parse_args, parse_shape, prompts,  # noqa: E402
                      shape_directory)
from ranks import cpu_run_meta, everyone, start  # noqa: E402

KINDS = {  # kind: substrings of the op names it takes (the first kind that matches)
    "collective ops": ("allreduce", "all_reduce", "allgather", "all_gather", "c10d", "gloo", "broadcast"),
    "matrix products": ("aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm"),
    "attention": ("scaled_dot_product", "aten::_efficient_attention", "aten::_flash_attention"),
}


def kind_of(op: str) -> str:
    return next((kind for kind, names in KINDS.items() if any(n in op for n in names)), "other ops")


@contextlib.contextmanager
def timed_collectives(spent: list):
    """While active, every torch.distributed collective adds its wall time to ``spent[0]`` and one to ``spent[1]``
    (nested calls once)."""
    saved, depth = {}, [0]

    def wrap(fn):
        @functools.wraps(fn)
        def timed(*args, **kwargs):
            depth[0] += 1
            start_s = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                depth[0] -= 1
                if depth[0] == 0:
                    spent[0] += time.perf_counter() - start_s
                    spent[1] += 1
        return timed

    for name in DIST_FUNCTIONS:
        if hasattr(dist, name):
            saved[name] = getattr(dist, name)
            setattr(dist, name, wrap(saved[name]))
    try:
        yield
    finally:
        for name, fn in saved.items():
            setattr(dist, name, fn)


def profile(system, ids, mask, new_tokens, ops: bool) -> dict:
    """"collectives" and "wall" seconds for one generate call, and with ``ops`` the profiler's self seconds by
    kind (the profiler's overhead then in every figure)."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    dist.barrier()
    spent = [0.0, 0]
    recording = torch_profile(activities=[ProfilerActivity.CPU]) if ops else contextlib.nullcontext()
    with recording as prof, timed_collectives(spent):
        start_s = time.perf_counter()
        system.generate(ids, mask, new_tokens)
        wall = time.perf_counter() - start_s
    out = {}
    if ops:
        out = dict.fromkeys(list(KINDS) + ["other ops"], 0.0)
        for event in prof.key_averages():
            out[kind_of(event.key)] += event.self_cpu_time_total / 1e6
        del out["collective ops"]  # inside the collectives' wall time
    out["collectives"] = spent[0]
    out["collective calls"] = spent[1] / 1e3  # per_step's ms scale turns it back into a count per step
    out["wall"] = wall
    return out


def per_step(long: dict, short: dict, steps: int) -> dict:
    step = {k: (long[k] - short[k]) / steps * 1e3 for k in long}  # ms
    step["python and framework"] = step["wall"] - sum(v for k, v in step.items() if k not in ("wall", "collective calls"))
    return step


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", default="", help="as benchmarks/generate.py's --shape")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--prompt", type=int, default=32)
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    load_start = os.getloadavg()[0]
    shape = parse_shape(args.shape)
    directory = parse_args([]).checkpoint_dir  # generate.py's, one folder per shape
    if args.shape:
        directory = shape_directory(directory, shape)
    rank, world, path = start(None, directory, lambda d: build_checkpoint(d, shape))
    ids, mask = prompts(args.batch, args.prompt, shape["vocab"])
    results = {}
    for system in (FxParallel(), TransformersTP()):
        system.build(path, world, torch.float32, "cpu")
        with torch.no_grad():
            system.generate(ids, mask, args.new_tokens)  # warm-up: capture, caches
            for ops in (False, True):
                long, short = (profile(system, ids, mask, n, ops) for n in (args.new_tokens, 1))
                label = system.name + (" (profiled)" if ops else "")
                results[label] = everyone(per_step(long, short, args.new_tokens - 1))  # every rank's
        system.model = None
    if rank == 0:
        print(f"decode step, ms per rank (batch {args.batch}, TP={world})")
        for name, ranks in results.items():
            for r, steps in enumerate(ranks):
                print(f"{name:26s} rank {r}: " + ", ".join(f"{k} {v:.2f}" for k, v in steps.items()))
        if args.out:
            meta = {"shape": shape, "tp": world, "batch": args.batch, "prompt": args.prompt,
                    "new_tokens": args.new_tokens, **cpu_run_meta(load_start)}
            with open(args.out, "w") as f:
                json.dump({"meta": meta, "results": results}, f, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
