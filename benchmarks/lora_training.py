"""LoRA training against full fine-tuning of the same parallel model: trainable memory and step time per rank.

    OMP_NUM_THREADS=1 torchrun --nproc_per_node=2 benchmarks/lora_training.py [--steps 10] [--r 16] [--sequence-parallel]
    python benchmarks/lora_training.py --render [--sequence-parallel]     # the markdown table from the saved JSON

One locally built 8-layer Llama (fp32; the shape of ``activation_checkpointing.py``), parallelized over every
rank twice in the same processes: fully trainable, and with a new LoRA adapter (``model.add_adapter``, rank
--r, ``target_modules="all-linear"``), each trained by AdamW (lr 0: every step starts from the same weights).

Per rank, counted exactly from the tensors (not RSS): the parameters that take gradients, their gradients
after a step and AdamW's two states after a step (``optimizer.state``); the frozen base weights, which both
runs hold, for scale; the activations one forward saves for backward (``sequence_parallel.py``'s count). Step time: forward, backward and optimizer step of one batch (--batch x --seq), the two
runs alternating step by step so that other load on the machine hits both alike, the median over --steps
after --warmup (the slowest rank's). The 1-minute load average is recorded at the start and end.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
from checkpoints import build_checkpoint as build_default  # noqa: E402
from ranks import cpu_run_meta, everyone, render_saved, start, synchronize, write_result  # noqa: E402
from sequence_parallel import saved_activation_bytes  # noqa: E402

SHAPE = dict(hidden=256, layers=8, heads=8, kv_heads=4, intermediate=1024, vocab=2048, positions=1024)
MiB = 2**20


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="a checkpoint directory (default: the locally built Llama)")
    p.add_argument("--checkpoint-dir", default=os.path.join(ROOT, "out", "checkpoints", "lora-llama"))
    p.add_argument("--r", type=int, default=16, help="LoRA rank")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--sequence-parallel", action="store_true", help="both runs with sequence_parallel=True")
    p.add_argument("--out", default=None, help="default: results/lora_training[_sp].json")
    p.add_argument("--render", action="store_true")
    args = p.parse_args(argv)
    suffix = "_sp" if args.sequence_parallel else ""
    args.out = args.out or os.path.join(HERE, "results", f"lora_training{suffix}.json")
    return args


def _bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


class Run:
    """One way of training the parallel model: its optimizer over what takes gradients, and a timed step."""

    def __init__(self, name: str, model):
        self.name, self.model, self.times = name, model.train(), []
        self.trainable = [p for p in model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(self.trainable, lr=0.0)

    def step(self, ids) -> float:
        synchronize()
        t = time.perf_counter()
        self.optimizer.zero_grad(set_to_none=True)
        self.model(input_ids=ids, labels=ids).loss.backward()
        self.optimizer.step()
        synchronize()
        return time.perf_counter() - t

    def memory(self) -> dict:
        states = [v for s in self.optimizer.state.values() for v in s.values() if torch.is_tensor(v) and v.dim()]
        frozen = [p for p in self.model.parameters() if not p.requires_grad]
        return {"trainable_params": sum(p.numel() for p in self.trainable),
                "trainable_MiB": _bytes(self.trainable) / MiB, "grads_MiB": _bytes(p.grad for p in self.trainable) / MiB,
                "optimizer_MiB": _bytes(states) / MiB, "frozen_MiB": _bytes(frozen) / MiB}


def measure(path: str, args) -> dict:
    import fxparallel
    from peft import LoraConfig

    options = dict(dtype=torch.float32, sequence_parallel=args.sequence_parallel)
    full = Run("full fine-tuning", fxparallel.parallelize(path, dist.group.WORLD, **options))
    adapted = fxparallel.parallelize(path, dist.group.WORLD, **options)
    adapted.add_adapter(LoraConfig(r=args.r, lora_alpha=2 * args.r, target_modules="all-linear"))
    lora = Run(f"LoRA r={args.r}", adapted)
    ids = torch.randint(0, SHAPE["vocab"], (args.batch, args.seq), generator=torch.Generator().manual_seed(0))
    for i in range(args.warmup + args.steps):
        for run in (full, lora):
            seconds = max(everyone(run.step(ids)))  # the slowest rank's
            if i >= args.warmup:
                run.times.append(seconds)
    out = {}
    for run in (full, lora):
        memory = run.memory()  # after a step, before the count's backward adds to the gradients
        per_rank = everyone(dict(memory, saved_activations_MiB=saved_activation_bytes(run.model, ids) / MiB))
        out[run.name] = {"median_step_s": statistics.median(run.times), "steps_s": run.times,
                         "calls": sum(c.count for c in run.model.plan.collectives),
                         **{k: max(m[k] for m in per_rank) for k in per_rank[0]}}
    return out


def markdown_table(result: dict) -> str:
    meta, runs = result["meta"], result["runs"]
    full, lora = runs["full fine-tuning"], runs[f"LoRA r={meta['r']}"]
    mode = " with sequence parallelism" if meta.get("sequence_parallel") else ""
    lines = [f"Llama {meta['shape']['layers']} layers, hidden {meta['shape']['hidden']}, fp32, TP={meta['tp']}{mode} on "
             f"{meta['device']} ({meta['cores']} cores, {meta['threads']} thread(s) per rank), batch {meta['batch']} x "
             f"{meta['seq']}; AdamW; median of {meta['steps']} alternating steps after {meta['warmup']} warm-up "
             f"(slowest rank); bytes per rank (max over ranks); load average {meta['load_average_start']:.1f} at the "
             f"start, {meta['load_average_end']:.1f} at the end; {meta['date']}.", "",
             "| per rank | full fine-tuning | LoRA | LoRA / full |", "|---|---:|---:|---:|"]
    rows = (("parameters taking gradients", "trainable_params", "{:,.0f}"),
            ("their bytes (MiB)", "trainable_MiB", "{:.2f}"), ("gradients (MiB)", "grads_MiB", "{:.2f}"),
            ("AdamW states (MiB)", "optimizer_MiB", "{:.2f}"), ("frozen weights (MiB)", "frozen_MiB", "{:.2f}"),
            ("activations saved for backward (MiB)", "saved_activations_MiB", "{:.1f}"),
            ("step time (s, median)", "median_step_s", "{:.3f}"), ("collective calls per step", "calls", "{:.0f}"))
    for label, key, fmt in rows:
        if key not in full:  # a result saved before the row was measured
            continue
        ratio = f"{lora[key] / full[key]:.3f}" if full[key] else "-"
        lines.append(f"| {label} | {fmt.format(full[key])} | {fmt.format(lora[key])} | {ratio} |")
    return "\n".join(lines)


def main(argv=None):
    args = parse_args(argv)
    if args.render:
        return render_saved(args.out, markdown_table)
    load_start = os.getloadavg()[0]
    rank, world, path = start(args.model, args.checkpoint_dir, lambda d: build_default(
        "llama", d, overrides=dict(use_cache=False, attention_dropout=0.0), **SHAPE))
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    runs = measure(path, args)
    meta = {"tp": world, "shape": SHAPE, "r": args.r, "batch": args.batch, "seq": args.seq, "steps": args.steps,
            "warmup": args.warmup, "sequence_parallel": args.sequence_parallel, **cpu_run_meta(load_start)}
    write_result(args.out, {"meta": meta, "runs": runs}, markdown_table)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
