"""Expert parallelism against splitting inside the experts, on a model of many small experts.

    OMP_NUM_THREADS=1 torchrun --nproc_per_node=2 benchmarks/expert_parallel.py [--steps 8]
    python benchmarks/expert_parallel.py --render     # the markdown table from the saved JSON

One locally built Qwen3-MoE (fp32; 32 experts 192 wide, top-4, hidden 512, 4 layers: the width ratio of
Qwen3-30B-A3B's 128 experts 768 wide on hidden 2048), parallelized four times in the same processes:
transformers' two experts kernels (grouped_mm, its default off CPU, run on CPU as tests/test_moe.py runs it;
batched_mm, what parallelize picks on CPU), each with every expert split like a dense MLP (``expert_parallel=
False``) and with whole experts per rank (``expert_parallel=True``); and once more per kernel with
``expert_parallel`` left out, to record which of the two the planner chooses and why.

Per run: the matrix products of one expert on one rank (rows x inner x columns, the rows for a balanced
router), the collectives per step from the plan, the training step (forward, backward, AdamW at lr 0, one batch
of --batch x --seq) and greedy decode tokens/s (--new tokens from a --prompt-token prompt, batch --decode-batch;
generate runs batched_mm on CPU, so it is measured for the two batched_mm runs). The runs alternate step by step
so that other load hits them alike; medians over --steps after --warmup, the slowest rank's. The 1-minute load
average is recorded at the start and the end.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import time

import torch
import torch.distributed as dist

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
from ranks import cpu_run_meta, everyone, render_saved, start, synchronize, write_result  # noqa: E402

SHAPE = dict(hidden_size=512, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4, head_dim=64,
             num_experts=32, num_experts_per_tok=4, moe_intermediate_size=192, intermediate_size=1024,
             vocab_size=2048, max_position_embeddings=1024, norm_topk_prob=True, use_cache=True)
KERNELS = ("grouped_mm", "batched_mm")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--checkpoint-dir", default=os.path.join(ROOT, "out", "checkpoints", "ep-qwen3-moe"))
    p.add_argument("--batch", type=int, default=2)  # (batched_mm gathers every routed pair's weights: GBs)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--decode-batch", type=int, default=8)
    p.add_argument("--prompt", type=int, default=16)
    p.add_argument("--new", type=int, default=24)
    p.add_argument("--out", default=os.path.join(HERE, "results", "expert_parallel.json"))
    p.add_argument("--render", action="store_true")
    return p.parse_args(argv)


def build(directory: str) -> str:
    """The checkpoint, and a copy of it whose config asks for transformers' grouped_mm kernel."""
    from transformers import AutoModelForCausalLM, Qwen3MoeConfig

    if not os.path.exists(os.path.join(directory, "config.json")):
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(Qwen3MoeConfig(**SHAPE), dtype=torch.float32)
        model.save_pretrained(directory + ".partial", safe_serialization=True)
        os.replace(directory + ".partial", directory)
    grouped = directory + "-grouped_mm"
    if not os.path.exists(grouped):
        shutil.copytree(directory, grouped)
        with open(os.path.join(grouped, "config.json")) as f:
            config = json.load(f)
        config["experts_implementation"] = "grouped_mm"
        with open(os.path.join(grouped, "config.json"), "w") as f:
            json.dump(config, f)
    return directory


def expert_products(model, rows: int) -> dict:
    """The matrix products of one expert on this rank: (rows, inner, columns) of gate_up and of down, for a
    balanced router (``rows`` routed pairs over the experts this rank computes them for)."""
    config, tp = model.config, model.plan.tp
    experts, width, hidden = config.num_experts, config.moe_intermediate_size, config.hidden_size
    p = model.plan.param("model.layers.0.mlp.experts.gate_up_proj")
    local = p.local_shape(tp, rank=dist.get_rank())
    if str(p.placement) == "S(0)":  # whole experts: each its own rows, full width
        return {"experts_per_rank": local[0], "gate_up": [rows // experts, hidden, 2 * width],
                "down": [rows // experts, width, hidden]}
    return {"experts_per_rank": experts, "gate_up": [rows // experts, hidden, 2 * width // tp],
            "down": [rows // experts, width // tp, hidden]}


class Run:
    def __init__(self, name: str, model, rows: int):
        self.name, self.model, self.times, self.decode = name, model.train(), [], []
        self.chosen, self.why = False, ""  # the planner's choice (set by measure)
        self.optimizer = torch.optim.AdamW(model.parameters(), lr=0.0)
        plan = model.plan
        self.facts = {"products": expert_products(model, rows),
                      "forward_calls": sum(c.count for c in plan.collectives if c.direction == "forward"),
                      "backward_calls": sum(c.count for c in plan.collectives if c.direction == "backward"),
                      "forward_bytes_per_token": plan.bytes_per_token("forward"),
                      "backward_bytes_per_token": plan.bytes_per_token("backward")}

    def step(self, ids) -> float:
        synchronize()
        t = time.perf_counter()
        self.optimizer.zero_grad(set_to_none=True)
        self.model(input_ids=ids, labels=ids).loss.backward()
        self.optimizer.step()
        synchronize()
        return time.perf_counter() - t

    def generate(self, prompt, new: int) -> float:
        synchronize()
        t = time.perf_counter()
        with torch.no_grad():
            out = self.model.eval().generate(input_ids=prompt, max_new_tokens=new, min_new_tokens=new, do_sample=False)
        synchronize()
        self.model.train()
        self.tokens = out
        return prompt.shape[0] * new / (time.perf_counter() - t)


def measure(path: str, args) -> dict:
    import fxparallel
    import fxparallel.api as api

    histc, for_device = torch.histc, api._for_device
    torch.histc = lambda x, *a, **k: histc(x.float(), *a, **k)  # grouped_mm's integer histogram, on CPU
    runs = []
    for kernel in KERNELS:
        if kernel == "grouped_mm":
            api._for_device = lambda config, device: config  # keep the checkpoint's kernel on CPU
        for ep in (False, True):
            model = fxparallel.parallelize(path + ("-grouped_mm" if kernel == "grouped_mm" else ""),
                                           dist.group.WORLD, dtype=torch.float32, expert_parallel=ep)
            name = f"{kernel}, {'whole experts per rank' if ep else 'experts split inside'}"
            runs.append(Run(name, model, args.batch * args.seq * SHAPE["num_experts_per_tok"]))
        # the planner's choice, from parallelize itself with expert_parallel left out (its graphs: one of the above)
        chosen = fxparallel.parallelize(path + ("-grouped_mm" if kernel == "grouped_mm" else ""), dist.group.WORLD,
                                        dtype=torch.float32).plan.experts
        for run in runs[-2:]:
            run.chosen = chosen.startswith("whole") == run.name.endswith("whole experts per rank")
            run.why = chosen
        api._for_device = for_device
    ids = torch.randint(0, SHAPE["vocab_size"], (args.batch, args.seq), generator=torch.Generator().manual_seed(0))
    for i in range(args.warmup + args.steps):
        for run in runs:
            seconds = max(everyone(run.step(ids)))
            if i >= args.warmup:
                run.times.append(seconds)
    prompt = torch.randint(0, SHAPE["vocab_size"], (args.decode_batch, args.prompt),
                           generator=torch.Generator().manual_seed(1))
    decoding = [r for r in runs if r.name.startswith("batched_mm")]
    for i in range(1 + max(3, args.steps // 2)):
        for run in decoding:
            rate = min(everyone(run.generate(prompt, args.new)))
            if i:
                run.decode.append(rate)
    same_tokens = torch.equal(decoding[0].tokens, decoding[1].tokens)
    return {"runs": {r.name: {**r.facts, "chosen": r.chosen, "why": r.why,
                              "median_step_s": statistics.median(r.times), "steps_s": r.times,
                              **({"decode_tokens_per_s": statistics.median(r.decode)} if r.decode else {})}
                     for r in runs}, "same_generated_tokens": same_tokens}


def markdown_table(result: dict) -> str:
    meta, runs = result["meta"], result["runs"]
    lines = [f"Qwen3-MoE {meta['shape']['num_hidden_layers']} layers, hidden {meta['shape']['hidden_size']}, "
             f"{meta['shape']['num_experts']} experts {meta['shape']['moe_intermediate_size']} wide, top-"
             f"{meta['shape']['num_experts_per_tok']}, fp32, TP={meta['tp']} on {meta['device']} ({meta['cores']} cores, "
             f"{meta['threads']} thread(s) per rank); training step on {meta['batch']} x {meta['seq']} tokens (AdamW), "
             f"median of {meta['steps']} alternating steps after {meta['warmup']} warm-up (slowest rank); decode "
             f"batch {meta['decode_batch']}, {meta['new']} new tokens; load average {meta['load_average_start']:.1f} "
             f"at the start, {meta['load_average_end']:.1f} at the end; {meta['date']}.", "",
             "| kernel, experts | experts per rank | one expert's gate_up / down product (rows x inner x cols) "
             "| collectives fwd / bwd per step | bytes per token fwd / bwd | step (s) | decode tokens/s "
             "| the planner's choice (`expert_parallel` left out) |",
             "|---|---:|---|---:|---:|---:|---:|---|"]
    for name, r in runs.items():
        p = r["products"]
        decode = f"{r['decode_tokens_per_s']:.1f}" if "decode_tokens_per_s" in r else "-"
        lines.append(f"| {name} | {p['experts_per_rank']} | {'x'.join(map(str, p['gate_up']))} / "
                     f"{'x'.join(map(str, p['down']))} | {r['forward_calls']} / {r['backward_calls']} | "
                     f"{r['forward_bytes_per_token']:.0f} / {r['backward_bytes_per_token']:.0f} | "
                     f"{r['median_step_s']:.3f} | {decode} | {'**chosen**' if r.get('chosen') else ''} |")
    lines.append("")
    lines.append(f"Greedy tokens of the two batched_mm runs equal: {result['same_generated_tokens']}.")
    for kernel in KERNELS:
        why = next((r["why"] for name, r in runs.items() if name.startswith(kernel) and "why" in r), None)
        if why:
            lines.append(f"\nThe plan's reason with {kernel}: `{why}`.")
    return "\n".join(lines)


def main(argv=None):
    args = parse_args(argv)
    if args.render:
        return render_saved(args.out, markdown_table)
    load_start = os.getloadavg()[0]
    _, world, path = start(None, args.checkpoint_dir, build)  # (rank 0 builds both checkpoints)
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    measured = measure(path, args)
    meta = {"tp": world, "shape": SHAPE, "batch": args.batch, "seq": args.seq, "steps": args.steps,
            "warmup": args.warmup, "decode_batch": args.decode_batch, "new": args.new, **cpu_run_meta(load_start)}
    write_result(args.out, {"meta": meta, **measured}, markdown_table)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
