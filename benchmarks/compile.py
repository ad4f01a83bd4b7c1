"""torch.compile on a training step: fxparallel (per decoder layer and whole model) vs transformers' TP model,
eager and compiled the same way, side by side in one run; and the parallel module's per-call overhead.

    OMP_NUM_THREADS=1 torchrun --nproc_per_node=N benchmarks/compile.py [--model DIR] [--backend inductor]
    torchrun --nproc_per_node=1 benchmarks/compile.py --device cuda    # on a GPU (NCCL; timers wait for it)

Systems (all fp32, train mode, attention dropout 0, AdamW, the same rows): ``fx eager``;
``fx layers`` (``fxparallel.runtime.compile_layers``: each decoder layer's code compiled, FSDP-style
hooks outside); ``fx whole`` (``torch.compile(model)``); ``hf eager`` (transformers
``tp_plan="auto"``, the plain model at TP=1); ``hf whole`` (``torch.compile`` of it). Each system runs
--warmup steps first (compilation happens there, its time is reported separately), then the timed
steps alternate between the systems so load on the machine hits all alike; a step's time is the
slowest rank's, the median over --repeats is reported with its ratio to the same system's eager step.
Losses of the first step are checked against fx eager (1e-4: inductor reorders float sums).

Per-call overhead: a no-grad forward of batch 1 x 8 tokens through ``model(...)`` against the local
graph's generated code called directly (what the module adds: argument checks, the graph lookup,
output wrapping), median of 200 calls, with and without ``check_inputs``.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import traceback

import torch
import torch.distributed as dist

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from checkpoints import build_checkpoint  # noqa: E402
from ranks import everyone, short_error, start, synchronize  # noqa: E402


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="checkpoint directory (default: a small Llama built locally)")
    p.add_argument("--checkpoint-dir", default=os.path.join(HERE, "..", "checkpoints", "bench-compile-llama"))
    p.add_argument("--backend", default="inductor")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--systems", default="fx eager,fx layers,fx whole,hf eager,hf whole")
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    p.add_argument("--out", default=None, help="JSON (default benchmarks/results/compile_tp{N}.json)")
    return p.parse_args(argv)


def build(name: str, path: str, world: int, backend: str, device: str):
    """(model whose step runs, model holding the parameters)."""
    from transformers import AutoModelForCausalLM

    if name.startswith("fx"):
        import fxparallel
        from fxparallel.runtime import compile_layers

        model = fxparallel.parallelize(path, dist.group.WORLD, dtype=torch.float32)
        if name == "fx layers":
            compile_layers(model, backend=backend)
    else:
        kwargs = {"tp_plan": "auto"} if world > 1 else {}
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, **kwargs)
        if model.device.type != device:
            model.to(device)
    model.train()
    return (torch.compile(model, backend=backend) if name.endswith("whole") else model), model


def step(run, params_of, optimizer, ids):
    synchronize()
    dist.barrier()
    start = time.perf_counter()
    optimizer.zero_grad(set_to_none=True)
    loss = run(input_ids=ids, labels=ids).loss
    loss.backward()
    optimizer.step()
    synchronize()
    seconds = time.perf_counter() - start
    return loss.item(), max(everyone(seconds))


def per_call_overhead(path: str, calls: int = 200) -> dict:
    """Median µs of ``model(input_ids=...)`` and of the graph's own code on the same input (on a GPU, each
    call waited for: the same GPU work on both ways)."""
    import fxparallel

    model = fxparallel.parallelize(path, dist.group.WORLD, dtype=torch.float32).eval()
    ids = torch.randint(0, model.config.vocab_size, (1, 8), generator=torch.Generator().manual_seed(0))
    ids = ids.to(model.device)
    out = {}
    with torch.no_grad():
        model(input_ids=ids)
        graph = model._graph_set.last
        ways = {"module": lambda: model(input_ids=ids),
                "module, check_inputs=False": lambda: model(input_ids=ids, check_inputs=False),
                "graph code": lambda: graph.forward(model, input_ids=ids)}
        for name, call in ways.items():
            times = []
            for _ in range(calls):
                t = time.perf_counter()
                call()
                synchronize()
                times.append(time.perf_counter() - t)
            out[name] = statistics.median(times) * 1e6
    return out


def main(argv=None):
    args = parse_args(argv)
    load_start = os.getloadavg()
    rank, world, path = start(args.model, args.checkpoint_dir,
                              lambda directory: build_checkpoint("llama", directory, layers=4), device=args.device)
    from transformers import AutoConfig

    vocab = AutoConfig.from_pretrained(path).vocab_size
    ids = torch.randint(0, vocab, (args.batch, args.seq), generator=torch.Generator().manual_seed(1)).to(args.device)
    systems, errors, first_loss, warmup = {}, {}, {}, {}
    for name in [s.strip() for s in args.systems.split(",") if s.strip()]:
        try:
            run, model = build(name, path, world, args.backend, args.device)
            optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)
            t = time.perf_counter()
            first_loss[name] = step(run, model, optimizer, ids)[0]
            for _ in range(args.warmup - 1):
                step(run, model, optimizer, ids)
            warmup[name] = max(everyone(time.perf_counter() - t))
            systems[name] = (run, model, optimizer)
        except Exception as err:  # noqa: BLE001 - a system that fails is a result
            traceback.print_exc()
            errors[name] = short_error(err)
        if rank == 0:
            print(f"{name}: ready ({errors.get(name, 'ok')})", flush=True)
    times = {name: [] for name in systems}
    for _ in range(args.repeats):
        for name, (run, model, optimizer) in systems.items():
            times[name].append(step(run, model, optimizer, ids)[1])
    overhead = per_call_overhead(path)
    median = {name: statistics.median(t) for name, t in times.items()}
    results = {}
    for name in systems:
        eager = median.get(name.split()[0] + " eager")
        results[name] = {"step_s": median[name], "times": times[name], "warmup_s": warmup[name],
                         "vs_eager": median[name] / eager if eager else None,
                         "first_loss": first_loss[name],
                         "loss_vs_fx_eager": abs(first_loss[name] - first_loss["fx eager"])
                         if "fx eager" in first_loss else None}
    import transformers

    meta = {"model": path, "tp": world, "backend": args.backend,
            "device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu", "batch": args.batch, "seq": args.seq,
            "repeats": args.repeats, "warmup": args.warmup, "cores": os.cpu_count(), "threads": torch.get_num_threads(),
            "torch": torch.__version__, "transformers": transformers.__version__,
            "date": time.strftime("%Y-%m-%d %H:%M %Z"), "load_average_start": load_start,
            "load_average_end": os.getloadavg(), "errors": errors}
    if rank == 0:
        print(f"\nTP={world}, batch {args.batch} x {args.seq}, {args.backend}, median of {args.repeats} "
              f"(load {load_start[0]:.1f} -> {os.getloadavg()[0]:.1f})")
        print(f"{'system':<10} {'step s':>8} {'vs eager':>9} {'warmup s':>9} {'loss diff':>10}")
        for name, r in results.items():
            ratio = f"{r['vs_eager']:.2f}x" if r["vs_eager"] else "-"
            diff = f"{r['loss_vs_fx_eager']:.1e}" if r["loss_vs_fx_eager"] is not None else "-"
            print(f"{name:<10} {r['step_s']:>8.3f} {ratio:>9} {r['warmup_s']:>9.1f} {diff:>10}")
        for name, err in errors.items():
            print(f"error ({name}): {err}")
        print("per-call overhead (batch 1 x 8, no grad, µs): " +
              ", ".join(f"{k} {v:.0f}" for k, v in overhead.items()))
        out = args.out or os.path.join(HERE, "results", f"compile_tp{world}.json")
        os.makedirs(os.path.dirname(out), exist_ok=True)
        with open(out, "w") as f:
            json.dump({"meta": meta, "results": results, "per_call_us": overhead}, f, indent=1)
        print(f"wrote {out}")
    dist.destroy_process_group()
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
