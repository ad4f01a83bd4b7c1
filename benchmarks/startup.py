"""Start-up: from the call to a finished first forward, each launch a fresh torchrun job, fxparallel next
to transformers' tensor-parallel from_pretrained on the same locally built fp32 Llama checkpoint.

    python benchmarks/startup.py                       # TP=2, 8 layers (about 430 MB), 3 rounds
    python benchmarks/startup.py --layers 2 8 32 --repeats 1 --json benchmarks/results/startup_tp2.json
    python benchmarks/startup.py --render benchmarks/results/startup_tp2.json   # the docs' tables

Systems, interleaved round by round so that other load hits all alike:
- ``transformers``: ``from_pretrained(..., distributed_config=DistributedConfig(tp_size=N))``.
- ``fxparallel cold``: ``parallelize`` with an empty graph cache (capture, solve, rewrite, load).
- ``fxparallel cached``: the same call once the cold run filled the cache (fxparallel/graph_cache).
- ``fxparallel saved plan``: ``parallelize(..., plan=path)`` with the cache off (capture and rewrite,
  the solver without search).
- ``fxparallel cold, rank 0 plans``: as cold (its own empty cache), with ``FXPARALLEL_PLANNING=first``: group
  rank 0 captures once and plans every rank's graph (fxparallel/graph_cache/first_rank.py).

``--systems`` runs some of them (e.g. the two cold ones at TP=4 on 2 cores, where ranks outnumber the cores).

Per rank: seconds to ready (the call returns), to the first loss (``model(input_ids, labels)``, batch 2 x 128 tokens) and to the
first logits (``model(input_ids)``, a second graph for fxparallel, cut from the training capture), fxparallel's stages
(``model.timings``), and the peak added resident memory from before the call to after the first
logits (VmHWM minus RSS before, Linux); then two training steps (forward, backward, AdamW) with the peak added memory
through them and the graphs captured during them, and a first call at batch 1. The figure of a run is its slowest rank; the table gives the
median over rounds. The load average is recorded with each launch.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

SYSTEMS = ("transformers", "fxparallel cold", "fxparallel cached", "fxparallel saved plan", "fxparallel cold, rank 0 plans")
FIRST_RANK = "fxparallel cold, rank 0 plans"
STAGES = ("setup", "capture", "solve", "rewrite", "graph cache", "load")
MiB = 2**20


def llama_config(layers: int):
    """hidden 1024, 16 heads (8 kv), MLP 2048, vocabulary 16000: 8 layers are about 430 MB in fp32."""
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=16000, hidden_size=1024, intermediate_size=2048, num_hidden_layers=layers,
                       num_attention_heads=16, num_key_value_heads=8, max_position_embeddings=512,
                       tie_word_embeddings=False)


def build_checkpoint(path: str, layers: int) -> str:
    import torch
    from transformers import AutoModelForCausalLM

    if not os.path.exists(os.path.join(path, ".complete")):
        torch.manual_seed(0)
        AutoModelForCausalLM.from_config(llama_config(layers), dtype=torch.float32).save_pretrained(
            path, max_shard_size="200MB")
        open(os.path.join(path, ".complete"), "w").close()
    return path


# ---- one launch (a torchrun rank) -------------------------------------------------------------
def run_rank(args) -> None:
    from load_memory import release_memory, reset_peak, status
    from ranks import everyone, start

    rank, world, path = start(args.checkpoint, args.checkpoint, None)
    import torch
    import torch.distributed as dist

    t = time.perf_counter()
    if args.system == "transformers":
        from transformers import AutoModelForCausalLM
        from transformers.distributed import DistributedConfig
    else:
        import fxparallel
    imported = time.perf_counter() - t
    ids = torch.randint(0, 16000, (2, 128), generator=torch.Generator().manual_seed(0))
    release_memory()
    reset_peak()
    before = status("VmRSS")
    dist.barrier()
    t0, cpu0 = time.perf_counter(), time.process_time()
    if args.system == "transformers":
        model = AutoModelForCausalLM.from_pretrained(path, distributed_config=DistributedConfig(tp_size=world),
                                                     dtype=torch.float32)
        stages = {}
    else:
        kwargs = {"plan": args.plan} if args.system == "fxparallel saved plan" else {}
        model = fxparallel.parallelize(path, dist.group.WORLD, dtype=torch.float32, **kwargs)
        stages = {k: v for k, v in model.timings.items() if k in STAGES}
    ready = time.perf_counter() - t0
    with torch.no_grad():
        model(input_ids=ids, labels=ids)
        first_loss = time.perf_counter() - t0
        model(input_ids=ids)
        first_logits = time.perf_counter() - t0
    cpu = time.process_time() - cpu0  # this rank's CPU seconds to the first logits
    peak = status("VmHWM") - before
    # then training: two steps of forward + backward + AdamW (the second with the optimizer's states)
    graphs = len(model.graphs()) if args.system != "transformers" else 0
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)
    t = time.perf_counter()
    for _ in range(2):
        model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    train_s = time.perf_counter() - t
    peak_train = status("VmHWM") - before
    captured_in_training = len(model.graphs()) - graphs if args.system != "transformers" else 0
    # a shape outside the training graph's guards (batch 1): fxparallel captures and plans its graph
    model.eval()
    t = time.perf_counter()
    with torch.no_grad():
        model(input_ids=ids[:1])
    batch1_s = time.perf_counter() - t
    if args.system != "transformers" and args.save_plan and rank == 0:
        model.plan.save(args.save_plan)
    row = dict(system=args.system, rank=rank, tp=world, import_s=imported, ready_s=ready, first_loss_s=first_loss,
               first_logits_s=first_logits, cpu_s=cpu, peak_added=peak, train_s=train_s, peak_train_added=peak_train,
               captured_in_training=captured_in_training, batch1_s=batch1_s, stages=stages,
               load=os.getloadavg()[0])
    rows = everyone(row)
    if rank == 0:
        with open(args.out, "w") as f:
            json.dump(rows, f)
    dist.destroy_process_group()


# ---- the orchestrator ----------------------------------------------------------------------------
def launch(args, system: str, checkpoint: str, cache: str, plan: str, save_plan: bool) -> list:
    out = tempfile.mktemp(suffix=".json")
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_VERBOSITY="error", PYTHONWARNINGS="ignore",
               FXPARALLEL_GRAPH_CACHE="off" if system == "fxparallel saved plan" else cache,
               FXPARALLEL_PLANNING="first" if system == FIRST_RANK else "each")
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    cmd = [torchrun, f"--nproc_per_node={args.tp}", os.path.abspath(__file__), "--rank-of", system,
           "--checkpoint", checkpoint, "--out", out, "--plan", plan] + (["--save-plan", plan] if save_plan else [])
    done = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if done.returncode:
        errors = [line for line in done.stderr.splitlines() if "Error" in line or "error:" in line]
        print(done.stdout[-2000:], "\n".join(errors[-20:]) or done.stderr[-4000:])
        raise SystemExit(f"{system} failed")
    with open(out) as f:
        rows = json.load(f)
    os.remove(out)
    return rows


def run_all(args) -> dict:
    results = {"tp": args.tp, "machine": f"{os.cpu_count()} cores", "runs": []}
    for layers in args.layers:
        checkpoint = build_checkpoint(os.path.join(args.root, f"llama-1024x{layers}"), layers)
        size = sum(os.path.getsize(os.path.join(checkpoint, f)) for f in os.listdir(checkpoint)
                   if f.endswith(".safetensors"))
        plan = os.path.join(args.root, f"plan-{layers}-tp{args.tp}.json")
        for round_ in range(args.repeats):
            cache = tempfile.mkdtemp(prefix="fxparallel-graphs-")
            for system in args.systems:
                if system == "fxparallel saved plan" and not os.path.exists(plan):
                    continue  # the cold run of this round writes it
                rows = launch(args, system, checkpoint, tempfile.mkdtemp(prefix="fxparallel-graphs-")
                              if system == FIRST_RANK else cache, plan, save_plan=system == "fxparallel cold")
                results["runs"].append(dict(layers=layers, checkpoint_mb=size / 1e6, round=round_, system=system,
                                            ranks=rows))
                slow = max(rows, key=lambda r: r["first_logits_s"])
                print(f"{layers:>3} layers  round {round_}  {system:<22} ready {slow['ready_s']:6.2f} s  "
                      f"first loss {slow['first_loss_s']:6.2f} s  first logits {slow['first_logits_s']:6.2f} s  "
                      f"peak +{max(r['peak_added'] for r in rows) / MiB:6.0f} MiB  training peak "
                      f"+{max(r['peak_train_added'] for r in rows) / MiB:6.0f} MiB  batch-1 call "
                      f"{max(r['batch1_s'] for r in rows):5.2f} s  load {slow['load']:.1f}",
                      flush=True)
    return results


# ---- the docs' tables ----------------------------------------------------------------------------
def _median(runs, key):
    return statistics.median(max(r[key] for r in run["ranks"]) for run in runs)


def render(results: dict) -> str:
    lines = [f"TP={results['tp']}, fp32 Llama (hidden 1024, 16 heads / 8 kv, MLP 2048, vocabulary 16000), "
             "each launch a fresh torchrun job; slowest rank, median over rounds.", "",
             "| layers | checkpoint MB | system | ready s | first loss s | first logits s | vs transformers "
             "| CPU s, all ranks | peak added MiB/rank | rounds | load avg |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    layers = sorted({r["layers"] for r in results["runs"]})
    for n in layers:
        by_system = {s: [r for r in results["runs"] if r["layers"] == n and r["system"] == s] for s in SYSTEMS}
        base = _median(by_system["transformers"], "first_logits_s") if by_system["transformers"] else None
        for system, runs in by_system.items():
            if not runs:
                continue
            logits = _median(runs, "first_logits_s")
            ratio = f"{logits / base:.2f}x" if base else "-"
            loads = "/".join(f"{max(r['load'] for r in run['ranks']):.1f}" for run in runs)
            cpu = statistics.median(sum(r["cpu_s"] for r in run["ranks"]) for run in runs) \
                if all("cpu_s" in r for run in runs for r in run["ranks"]) else None
            lines.append(f"| {n} | {runs[0]['checkpoint_mb']:.0f} | {system} | {_median(runs, 'ready_s'):.2f} | "
                         f"{_median(runs, 'first_loss_s'):.2f} | {logits:.2f} | {ratio} | "
                         f"{'-' if cpu is None else f'{cpu:.1f}'} | "
                         f"{statistics.median(max(r['peak_added'] for r in run['ranks']) for run in runs) / MiB:.0f} | "
                         f"{len(runs)} | {loads} |")
    lines += ["", "Then training and a new shape, in the same launch: two steps of forward + backward + AdamW "
              "(batch 2 x 128, `model.train()`), the peak added resident memory per rank from before the call to "
              "the end of the second step, graphs captured during those steps, and a first call at batch 1 "
              "(outside the training graph's guards: fxparallel plans its own graph).", "",
              "| layers | system | 2 training steps s | peak added MiB/rank | vs transformers | graphs captured "
              "in training | first batch-1 call s |", "|---|---|---|---|---|---|---|"]
    for n in layers:
        runs_of = {s: [r for r in results["runs"] if r["layers"] == n and r["system"] == s
                       and "peak_train_added" in r["ranks"][0]] for s in SYSTEMS}
        base = (statistics.median(max(r["peak_train_added"] for r in run["ranks"]) for run in runs_of["transformers"])
                if runs_of["transformers"] else None)
        for system, runs in runs_of.items():
            if not runs:
                continue
            peak = statistics.median(max(r["peak_train_added"] for r in run["ranks"]) for run in runs)
            ratio = f"{peak / base:.2f}x" if base else "-"
            captured = max(r["captured_in_training"] for run in runs for r in run["ranks"])
            captured = captured if system != "transformers" else "-"
            lines.append(f"| {n} | {system} | {_median(runs, 'train_s'):.2f} | {peak / MiB:.0f} | {ratio} | "
                         f"{captured} | {_median(runs, 'batch1_s'):.2f} |")
    lines += ["", "Where a cold start goes (fxparallel, slowest rank's stages, median seconds; the first logits "
              "call plans the logits graph, cut from the training capture):", "",
              "| layers | setup | capture | solve | rewrite | load | first loss | first logits | total |",
              "|---|---|---|---|---|---|---|---|---|"]
    for n in layers:
        runs = [r for r in results["runs"] if r["layers"] == n and r["system"] == "fxparallel cold"]
        if not runs:
            continue
        stage = {s: statistics.median(max(r["stages"].get(s, 0.0) for r in run["ranks"]) for run in runs)
                 for s in STAGES}
        ready, loss, logits = (_median(runs, k) for k in ("ready_s", "first_loss_s", "first_logits_s"))
        lines.append(f"| {n} | {stage['setup']:.2f} | {stage['capture']:.2f} | {stage['solve']:.2f} | "
                     f"{stage['rewrite']:.2f} | {stage['load']:.2f} | {loss - ready:.2f} | {logits - loss:.2f} | "
                     f"{logits:.2f} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--layers", type=int, nargs="+", default=[8])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--systems", nargs="+", default=list(SYSTEMS[:4]), choices=SYSTEMS,
                        help=f"which to launch (default: all but {FIRST_RANK!r})")
    parser.add_argument("--root", default="/tmp/fxparallel-bench/startup", help="where checkpoints are built")
    parser.add_argument("--json", default=None, help="write every launch's per-rank results here (runs of other "
                        "depths already there are kept)")
    parser.add_argument("--render", metavar="JSON", default=None, help="print the tables of a results file")
    # one rank of one launch (what run_all starts through torchrun)
    parser.add_argument("--rank-of", dest="system", default=None, choices=SYSTEMS, help=argparse.SUPPRESS)
    parser.add_argument("--checkpoint", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--out", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--plan", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--save-plan", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.render:
        with open(args.render) as f:
            print(render(json.load(f)))
    elif args.system:
        run_rank(args)
    else:
        results = run_all(args)
        if args.json:  # runs of other depths already in the file are kept
            if os.path.exists(args.json):
                with open(args.json) as f:
                    earlier = json.load(f)
                results["runs"] = [r for r in earlier["runs"] if r["layers"] not in args.layers] + results["runs"]
            with open(args.json, "w") as f:
                json.dump(results, f, indent=1)
        print()
        print(render(results))


if __name__ == "__main__":
    main()
