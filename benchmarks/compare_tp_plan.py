"""fxparallel.parallelize vs transformers' own tensor parallelism, side by side in one run.

    torchrun --nproc_per_node=N benchmarks/compare_tp_plan.py [--model DIR_OR_ID] --tp N

Both systems load the same checkpoint in the same processes and run the same
batch: time to a ready model, no-grad forward and forward+backward+AdamW step
(median, slowest rank per step), tokens/s, collectives per step by kind and phase
(one counter for both, ``comm_counter.py``), peak memory per rank, and the
largest difference of logits and loss from the single-device model (loaded on
every rank). Works on CPU/gloo and CUDA/NCCL. Without --model a small Llama
checkpoint is built locally (rank 0, then a barrier). A system that fails is
reported with its error instead of numbers.

Order: each system alone is built, compared, counted over one training step and
warmed up (its memory is measured over this phase: growth, and peak = the process
before any system + growth); then the timed steps of the ready systems alternate
step by step, so other load on the machine hits both alike.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import time
import traceback

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from checkpoints import build_checkpoint  # noqa: E402
from comm_counter import CommCounter  # noqa: E402
from memory import PeakMemory  # noqa: E402
from ranks import synchronize  # noqa: E402
from report import format_table  # noqa: E402
from systems import SYSTEMS  # noqa: E402

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="hub id or local directory (default: a small local Llama)")
    p.add_argument("--tp", type=int, default=None, help="tensor-parallel size (= the number of processes)")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--steps", type=int, default=5, help="timed steps (median reported)")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--systems", default="fxparallel,transformers", help="comma-separated, in run order")
    p.add_argument("--checkpoint-dir", default="checkpoints/bench-llama", help="where the default model is built")
    p.add_argument("--json", default=None, help="rank 0 writes the results here")
    p.add_argument("--timeout", type=float, default=300, help="seconds a collective may wait for a failed rank")
    return p.parse_args(argv)


# ---- helpers ----------------------------------------------------------------
def timed(fn):
    """One call, ranks started together: (wall seconds, CPU seconds of this process)."""
    dist.barrier()
    synchronize()
    t, c = time.perf_counter(), time.process_time()
    fn()
    synchronize()
    return time.perf_counter() - t, time.process_time() - c


def slowest_median(times):
    """Median over steps of the slowest rank's time of each step."""
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, times)
    return statistics.median(max(step) for step in zip(*everyone))


def short_error(err: BaseException) -> str:
    text = f"{type(err).__name__}: {err}".strip().splitlines()
    return text[0][:400] if text else type(err).__name__


def train_step(system, ids, counter=None, after_backward=None):
    c = counter or CommCounter()  # an inactive counter only holds the phase
    system.optimizer.zero_grad(set_to_none=True)
    with c.in_phase("forward"):
        loss = system.loss(ids)
    with c.in_phase("backward"):
        loss.backward()
    if after_backward is not None:
        after_backward()
    with c.in_phase("optimizer"):
        system.optimizer.step()
    loss = loss.detach().float().item()
    system.losses.append(loss)
    return loss


# ---- one system alone: ready time, agreement, collectives, memory ------------
def prepare(system, args, path, ids, reference, device, dtype, base_mib):
    """Build, compare with the single device, count one step, warm up.

    Memory: this phase's growth, and as peak ``base_mib`` (the process before any
    system) + growth, i.e. the peak as if this system were alone in the process.
    """
    tp = dist.get_world_size()
    memory = PeakMemory(device)
    r = {"label": system.label}
    memory.start()
    system.build(path, tp, dtype, device)
    r["ready_s"] = system.timings["ready"]
    r["capture_plan_s"] = system.timings["capture+plan"]

    with torch.no_grad():  # agreement with the single-device model, before any update
        r["loss_diff"] = abs(system.loss(ids).float().item() - reference["loss"])
        try:  # the logits-only forward is another graph: its failure should not hide the training numbers
            r["logits_diff"] = (system.logits(ids).float() - reference["logits"]).abs().max().item()
        except Exception as err:  # noqa: BLE001
            r["logits_diff"], r["logits_error"] = None, short_error(err)

    system.make_optimizer(args.lr)
    system.losses = []
    counter = CommCounter()
    dist.barrier()
    t = time.perf_counter()
    with counter:  # the first step is counted (and is a warm-up: lazy captures happen here)
        train_step(system, ids, counter)
    synchronize()
    r["first_step_s"] = time.perf_counter() - t
    for phase in ("forward", "backward", "optimizer"):
        r[f"{phase}_collectives"] = {k: list(v) for k, v in counter.summary(phase).items()}
    r["step_bytes"] = counter.bytes()
    if hasattr(system, "expected_collectives"):  # the counter checked against the system's own plan
        expected = system.expected_collectives(ids.numel())
        measured = {p: r[f"{p}_collectives"] for p in ("forward", "backward")}
        r["plan_agrees"] = all(measured[p] == expected.get(p, {}) for p in measured)
        r["plan_collectives"] = expected
    for _ in range(args.warmup - 1):
        train_step(system, ids)
    with torch.no_grad():
        for _ in range(args.warmup):
            system.loss(ids)
    _, r["growth_mib"] = memory.stop()
    r["peak_mib"] = base_mib + r["growth_mib"]
    return r


# ---- all ready systems together: step times, interleaved ---------------------
def time_interleaved(systems, results, ids, steps):
    """Alternate the systems step by step, so load from elsewhere on the machine hits them alike."""
    times = {s.name: {"step": [], "step_cpu": [], "fwd_bwd": [], "forward": [], "forward_cpu": []}
             for s in systems}
    for _ in range(steps):
        for s in systems:
            mark = []

            def backward_done():
                synchronize()
                mark.append(time.perf_counter())

            wall, cpu = timed(lambda: (mark.append(time.perf_counter()),
                                       train_step(s, ids, after_backward=backward_done)))
            times[s.name]["step"].append(wall)
            times[s.name]["step_cpu"].append(cpu)
            times[s.name]["fwd_bwd"].append(mark[1] - mark[0])
    with torch.no_grad():
        for _ in range(steps):
            for s in systems:
                wall, cpu = timed(lambda: s.loss(ids))
                times[s.name]["forward"].append(wall)
                times[s.name]["forward_cpu"].append(cpu)
    for s in systems:
        r = results[s.name]
        for key, values in times[s.name].items():
            r[key + "_s"] = slowest_median(values)
        r["tokens_per_s"] = ids.numel() / r["step_s"]
        r["losses"] = list(s.losses)


def gather_ranks(result: dict) -> dict:
    """Per-rank values that differ (memory, errors) collected on every rank."""
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, result)
    merged = dict(everyone[0])
    errors = [(i, r["error"]) for i, r in enumerate(everyone) if r.get("error")]
    if errors:
        return {"label": merged["label"], "error": f"rank {errors[0][0]}: {errors[0][1]}"}
    for key in ("peak_mib", "growth_mib"):
        merged[key + "_per_rank"] = [r[key] for r in everyone]
        merged[key] = max(r[key] for r in everyone)
    for key in ("logits_diff", "loss_diff"):
        values = [r[key] for r in everyone if r[key] is not None]
        merged[key] = max(values) if len(values) == len(everyone) else None
    return merged


def reference_outputs(path, ids, device, dtype):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device).eval()
    with torch.no_grad():
        out = model(input_ids=ids, labels=ids)
    result = {"logits": out.logits.float(), "loss": out.loss.float().item()}
    del model, out
    return result


def main(argv=None):
    # planning is what is measured: never read a graph planned by an earlier run (fxparallel/graph_cache)
    os.environ.setdefault("FXPARALLEL_GRAPH_CACHE", "off")
    args = parse_args(argv)
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    use_cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if use_cuda else "gloo", timeout=datetime.timedelta(seconds=args.timeout))
    rank, world = dist.get_rank(), dist.get_world_size()
    if args.tp is not None and args.tp != world:
        if rank == 0:
            print(f"error: --tp {args.tp} must equal the number of processes ({world}); "
                  f"run with torchrun --nproc_per_node={args.tp}", file=sys.stderr)
        dist.destroy_process_group()
        return 2
    if use_cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    device = torch.device("cuda", torch.cuda.current_device()) if use_cuda else torch.device("cpu")
    dtype = DTYPES[args.dtype]
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()

    path = args.model
    if path is None:
        if rank == 0:
            build_checkpoint("llama", args.checkpoint_dir)
        dist.barrier()
        path = args.checkpoint_dir

    ids = torch.randint(0, 2**31 - 1, (args.batch, args.seq), generator=torch.Generator().manual_seed(1234))
    from transformers import AutoConfig

    ids = (ids % AutoConfig.from_pretrained(path).vocab_size).to(device)
    reference = reference_outputs(path, ids, device, dtype)

    memory_before = PeakMemory(device)
    memory_before.start()  # the process before any system: runtime, transformers, the batch
    results, ready = {}, []
    for name in [s.strip() for s in args.systems.split(",") if s.strip()]:
        system = SYSTEMS[name]()
        try:
            result = prepare(system, args, path, ids, reference, device, dtype, memory_before.baseline)
        except Exception as err:  # noqa: BLE001 - a failing system is a result, not a crash
            if os.environ.get("FXP_BENCH_TRACEBACK"):
                traceback.print_exc()
            result = {"label": system.label, "error": short_error(err)}
            system.close()
        results[name] = gather_ranks(result)
        if "error" in results[name]:
            system.close()
        else:
            ready.append(system)
    if ready:
        time_interleaved(ready, results, ids, args.steps)

    meta = {"model": path, "model_type": AutoConfig.from_pretrained(path).model_type, "tp": world,
            "batch": args.batch, "seq": args.seq, "steps": args.steps, "warmup": args.warmup, "dtype": args.dtype,
            "device": torch.cuda.get_device_name() if use_cuda else "cpu", "backend": dist.get_backend(),
            "memory": PeakMemory(device).kind, "torch": torch.__version__, "threads": torch.get_num_threads(),
            "load_average": os.getloadavg()[0] if hasattr(os, "getloadavg") else None}
    if rank == 0:
        print("\n" + format_table(meta, results))
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"meta": meta, "results": results}, f, indent=2)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
