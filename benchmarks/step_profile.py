"""Where one step's time goes, per rank, in fxparallel and transformers' TP: a decode step or a training step.

    OMP_NUM_THREADS=1 torchrun --nproc_per_node=2 benchmarks/step_profile.py --step decode \
        --shape hidden=1024,layers=8,... --out benchmarks/results/decode_profile_tp2_h1024.json
    OMP_NUM_THREADS=1 torchrun --nproc_per_node=2 benchmarks/step_profile.py --step train --batch 4 --seq 256 \
        --shape hidden=1024,layers=8,... --out benchmarks/results/train_profile_tp2_h1024.json

Both systems load the same checkpoint (``benchmarks/generate.py``'s, one folder per shape) in the same processes.
Each is profiled (``torch.profiler``, CPU) and then timed without the profiler (its overhead is in every figure
it gives: it records each op, and a system that runs more ops pays more):

- ``decode``: a greedy ``generate`` of --new-tokens tokens and one of a single token (``benchmarks/generate.py``'s
  systems, batch --batch, prompt --prompt); the difference, divided by the decode steps, is one decode step.
- ``train``: --steps training steps (forward with labels, backward, AdamW: ``compare_tp_plan.train_step`` on
  ``benchmarks/systems.py``'s systems) on a --batch x --seq batch after two warm-up steps, divided by the steps.

A step is split into the self time of the ops by kind (matrix products, attention, the other aten ops), the
wall time inside the collectives (``comm_counter.CommCounter``'s calls: for ``torch.distributed``'s functions the
wait for the other rank included, which the profiler's records of the c10d ops leave out; a functional
collective's issue only) and what is left of the step's wall time (Python: the model's code, the loop, the
framework's dispatch). Rank 0 prints the table and writes the JSON;

    python benchmarks/step_profile.py --plot DECODE.json TRAIN.json --png docs/benchmarks_step_profile.png

draws them (matplotlib).

``--device cuda`` (one process per GPU, NCCL; ``--dtype``, ``--systems`` any of ``benchmarks/generate.py``'s for a
decode step, e.g. its CUDA-graph ones) profiles the GPU too: a step's kernel time by kind (matrix products,
attention, the other kernels), the time the GPU has no kernel or copy running ("GPU idle": the host's share of the
step), and the CUDA runtime calls the host made (kernel launches, graph launches, synchronizing calls).
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time

import torch
import torch.distributed as dist

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import generate  # noqa: E402
import systems  # noqa: E402
from comm_counter import CommCounter  # noqa: E402
from compare_tp_plan import train_step  # noqa: E402
from ranks import cpu_run_meta, everyone, start  # noqa: E402

KINDS = {  # kind: substrings of the op names it takes (the first kind that matches)
    # fxparallel's collectives are autograd Functions (ops/collectives.py: _AllReduce, _CopyToTPBackward, ...)
    # whose self time holds the wait; they, as the c10d ops, are inside the collectives' wall time
    "collective ops": ("allreduce", "all_reduce", "allgather", "all_gather", "c10d", "gloo", "broadcast",
                       "_AllReduce", "_AllGather", "_CopyToTP", "_PartialGrad", "_SumGradRows", "Seq"),
    "matrix products": ("aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm"),
    "attention": ("scaled_dot_product", "aten::_efficient_attention", "aten::_flash_attention"),
}
GPU_KINDS = {  # kind: substrings of the kernel names it takes (cuBLAS / CUTLASS products, fused attention)
    "GPU matrix products": ("gemm", "gemv", "cutlass", "nvjet", "sm90_xmma", "splitKreduce"),
    "GPU attention": ("flash", "fmha", "attention", "attn"),
}
RUNTIME_CALLS = {  # what the host asked of the CUDA runtime: count per step of the calls named
    "kernel launches": ("cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel", "cuLaunchKernelEx"),
    "graph launches": ("cudaGraphLaunch",),
    "synchronizing calls": ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize",
                            "cudaMemcpy", "cudaStreamWaitEvent"),
}


TOP_OTHER_OPS = 8  # "other ops" also listed by name: this many of the largest


def kind_of(op: str) -> str:
    return next((kind for kind, names in KINDS.items() if any(n in op for n in names)), "other ops")


def gpu_profile(prof) -> dict:
    """From a profile with CUDA activity: kernel seconds by ``GPU_KINDS``, "GPU busy" (the union of the kernels'
    and copies' intervals) and the runtime calls by ``RUNTIME_CALLS`` (counts / 1e3, as "collective calls")."""
    from torch.autograd import DeviceType

    out = dict.fromkeys(list(GPU_KINDS) + ["GPU other kernels"], 0.0)
    intervals = []
    for event in prof.events():
        if event.device_type != DeviceType.CUDA:
            continue
        intervals.append((event.time_range.start, event.time_range.end))
        kind = next((k for k, names in GPU_KINDS.items() if any(n in event.name for n in names)),
                    "GPU other kernels")
        out[kind] += event.time_range.elapsed_us() / 1e6
    busy, end = 0.0, float("-inf")
    for a, b in sorted(intervals):
        busy += max(0.0, b - max(a, end))
        end = max(end, b)
    out["GPU busy"] = busy / 1e6
    counts = {e.key: e.count for e in prof.key_averages()}
    for kind, names in RUNTIME_CALLS.items():
        out[kind] = sum(counts.get(n, 0) for n in names) / 1e3
    return out


def profile(run, ops: bool, cuda: bool = False) -> dict:
    """"collectives" and "wall" seconds of ``run()``, and with ``ops`` the profiler's self seconds by kind (the
    profiler's overhead then in every figure); with ``cuda`` too, the GPU's (``gpu_profile``)."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    dist.barrier()
    counter = CommCounter()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    recording = torch_profile(activities=activities) if ops else contextlib.nullcontext()
    with recording as prof, counter:
        start_s = time.perf_counter()
        run()
        if cuda:
            torch.cuda.synchronize()
        wall = time.perf_counter() - start_s
    out = {}
    if ops:
        out = dict.fromkeys(list(KINDS) + ["other ops"], 0.0)
        for event in prof.key_averages():
            kind = kind_of(event.key)
            out[kind] += event.self_cpu_time_total / 1e6
            if kind == "other ops":
                out["op " + event.key] = event.self_cpu_time_total / 1e6
        del out["collective ops"]  # inside the collectives' wall time
        if cuda:
            out.update(gpu_profile(prof))
    out["collectives"] = counter.seconds()
    out["collective calls"] = counter.count() / 1e3  # per_step's ms scale turns it back into a count per step
    out["wall"] = wall
    return out


def per_step(long: dict, short: dict | None, steps: int) -> dict:
    """ms per step: ``long`` minus ``short`` (None: nothing) over ``steps``."""
    step = {k: (long[k] - (short or {}).get(k, 0.0)) / steps * 1e3 for k in long}
    kinds = [k for k in step if k in list(KINDS) + ["other ops", "collectives"]]
    step["python and framework"] = step["wall"] - sum(step[k] for k in kinds)
    if "GPU busy" in step:
        step["GPU idle"] = step["wall"] - step["GPU busy"]
    other = sorted((k for k in step if k.startswith("op ")), key=step.get, reverse=True)
    for name in other[TOP_OTHER_OPS:]:  # the other ops: the largest by name
        del step[name]
    return step


def decode_steps(system, args, shape):
    """One decode step's profile, measured and profiled: generate(new_tokens) - generate(1)."""
    ids, mask = (t.to(args.device) for t in generate.prompts(args.batch, args.prompt, shape["vocab"]))
    with torch.no_grad():
        for n in (args.new_tokens, 1):  # warm-up: capture, caches (and compilation, CUDA graphs)
            system.generate(ids, mask, n)
        for ops in (False, True):
            long, short = (profile(lambda n=n: system.generate(ids, mask, n), ops, args.device == "cuda")
                           for n in (args.new_tokens, 1))
            yield ops, per_step(long, short, args.new_tokens - 1)


def train_steps(system, args, shape):
    """One training step's profile (forward with labels, backward, AdamW), measured and profiled."""
    ids = torch.randint(0, shape["vocab"], (args.batch, args.seq), generator=torch.Generator().manual_seed(1234))
    system.make_optimizer(1e-5)
    system.losses = []  # compare_tp_plan.train_step records each step's loss
    for _ in range(2):  # warm-up: captures, optimizer state
        train_step(system, ids)
    for ops in (False, True):
        yield ops, per_step(profile(lambda: [train_step(system, ids) for _ in range(args.steps)], ops), None,
                            args.steps)


STEPS = {"decode": (decode_steps, (generate.FxParallel, generate.TransformersTP)),
         "train": (train_steps, (systems.FxParallel, systems.TransformersTP))}


PLOTTED = ("matrix products", "attention", "other ops", "collectives", "python and framework")


def plot(paths: list, png: str) -> None:
    """One panel per results file: each system's profiled step (its first rank) as a stacked bar of the kinds,
    its unprofiled wall time marked beside it."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(paths), figsize=(5.5 * len(paths), 4.2), squeeze=False)
    for ax, path in zip(axes[0], paths):
        with open(path) as f:
            data = json.load(f)
        meta, results = data["meta"], data["results"]
        names = [n for n in results if not n.endswith("(profiled)")]
        for i, name in enumerate(names):
            step, bottom = results[name + " (profiled)"][0], 0.0
            for j, kind in enumerate(PLOTTED):
                value = max(step.get(kind, 0.0), 0.0)  # "python" may come out below 0: the profiler's overlap
                ax.bar(i, value, bottom=bottom, color=f"C{j}", label=kind if i == 0 else None)
                bottom += value
            ax.plot([i - 0.45, i + 0.45], [results[name][0]["wall"]] * 2, "k--",
                    label="step without the profiler" if i == 0 else None)
        ax.set_xticks(range(len(names)), names)
        ax.set_ylabel("ms per step (rank 0)")
        size = f"batch {meta['batch']}" if meta["step"] == "decode" else f"{meta['batch']} x {meta['seq']} tokens"
        ax.set_title(f"{meta['step']} step, TP={meta['tp']}, hidden {meta['shape']['hidden']}, "
                     f"{meta['shape']['layers']} layers, {size}", fontsize=9)
    axes[0][0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(png, dpi=110)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--plot", nargs="+", metavar="JSON", help="only draw these results files into --png")
    p.add_argument("--png", default=os.path.join(HERE, "..", "docs", "benchmarks_step_profile.png"))
    p.add_argument("--step", choices=sorted(STEPS), default="decode")
    p.add_argument("--shape", default="", help="as benchmarks/generate.py's --shape")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--prompt", type=int, default=32, help="decode: prompt length")
    p.add_argument("--new-tokens", type=int, default=32, help="decode: tokens generated")
    p.add_argument("--seq", type=int, default=256, help="train: sequence length")
    p.add_argument("--steps", type=int, default=3, help="train: steps measured")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--systems", default="", help="decode: benchmarks/generate.py's names, comma-separated "
                   "(default: fxparallel,transformers)")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    if args.plot:
        return plot(args.plot, args.png)
    load_start = os.getloadavg()[0]
    shape = generate.parse_shape(args.shape)
    directory = generate.parse_args([]).checkpoint_dir  # generate.py's, one folder per shape
    if args.shape:
        directory = generate.shape_directory(directory, shape)
    rank, world, path = start(None, directory, lambda d: generate.build_checkpoint(d, shape), device=args.device)
    steps, system_classes = STEPS[args.step]
    if args.step != "decode" and (args.systems or args.device == "cuda"):
        raise SystemExit("--systems, --device cuda: a decode step's only (the training step is profiled on CPU)")
    if args.systems:
        system_classes = [generate.SYSTEMS[name.strip()] for name in args.systems.split(",")]
    results = {}
    for system in (cls() for cls in system_classes):
        system.build(path, world, getattr(torch, args.dtype), args.device)
        for ops, step in steps(system, args, shape):
            results[system.name + (" (profiled)" if ops else "")] = everyone(step)  # every rank's
        system.model = system.optimizer = None
    if rank == 0:
        size = f"batch {args.batch}" if args.step == "decode" else f"{args.batch} x {args.seq} tokens"
        print(f"{args.step} step, ms per rank ({size}, TP={world})")
        for name, ranks in results.items():
            for r, step in enumerate(ranks):
                kinds = ", ".join(f"{k} {v:.2f}" for k, v in step.items() if not k.startswith("op "))
                print(f"{name:26s} rank {r}: {kinds}")
                if r == 0 and any(k.startswith("op ") for k in step):
                    named = sorted((k for k in step if k.startswith("op ")), key=step.get, reverse=True)
                    print(" " * 34 + "of the other ops: " + ", ".join(f"{k[3:]} {step[k]:.1f}" for k in named))
        if args.out:
            sizes = ({"prompt": args.prompt, "new_tokens": args.new_tokens} if args.step == "decode" else
                     {"seq": args.seq, "steps": args.steps})
            meta = {"step": args.step, "shape": shape, "tp": world, "batch": args.batch, **sizes,
                    **cpu_run_meta(load_start), "dtype": args.dtype}
            if args.device == "cuda":
                meta["device"] = torch.cuda.get_device_name()
            with open(args.out, "w") as f:
                json.dump({"meta": meta, "results": results}, f, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
