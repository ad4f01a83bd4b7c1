"""Planning time of a Llama-3-8B-shaped config on the meta device, vs depth.

    python benchmarks/plan_speed.py [--layers 8 16 32] [--tp 8] [--repeats 3] [--json OUT]

Times ``fxparallel.plan_model(config, tp)`` (capture + plan + rewrite, no weights,
no processes) for each depth: the median of a few runs after one untimed warm-up
(Dynamo's first-use start-up is not planning). Prints wall and CPU seconds and
seconds per layer; the fit's slope is the marginal cost of a layer and its
intercept the fixed cost. CPU seconds (this process, all threads) are what a
busy shared machine distorts least; the load average is printed with them. Target: 32 layers under 20 s on a 2-core machine, linear in depth.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch


def llama3_8b_config(layers: int):
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=layers,
                       num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=8192,
                       rope_theta=500000.0, rms_norm_eps=1e-5, tie_word_embeddings=False, dtype="bfloat16")


def time_plan(layers: int, tp: int, repeats: int) -> list:
    import fxparallel

    wall, cpu = [], []
    for _ in range(repeats):
        t, c = time.perf_counter(), time.process_time()
        fxparallel.plan_model(llama3_8b_config(layers), tp, dtype=torch.bfloat16)
        wall.append(time.perf_counter() - t)
        cpu.append(time.process_time() - c)
    return wall, cpu


def fit_line(xs, ys):
    """Least-squares slope and intercept."""
    mx, my = statistics.mean(xs), statistics.mean(ys)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    return slope, my - slope * mx


def main(argv=None):
    # planning is what is measured: never read a graph planned by an earlier run (fxparallel/graph_cache)
    os.environ.setdefault("FXPARALLEL_GRAPH_CACHE", "off")
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, nargs="+", default=[8, 16, 32])
    p.add_argument("--tp", type=int, default=8)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

    time_plan(2, args.tp, 1)  # warm-up: imports and Dynamo's first-use start-up
    rows = []
    print(f"plan_model(Llama-3-8B shape, tp={args.tp}) on the meta device, median of {args.repeats}, "
          f"{os.cpu_count()} cores, torch {torch.__version__}")
    print(f"{'layers':>6}  {'wall s':>7}  {'s/layer':>7}  {'CPU s':>7}  {'s/layer':>7}  wall runs  (load average)")
    for layers in args.layers:
        wall, cpu = time_plan(layers, args.tp, args.repeats)
        row = {"layers": layers, "seconds": statistics.median(wall), "cpu_seconds": statistics.median(cpu),
               "runs": wall, "cpu_runs": cpu, "load_average": os.getloadavg()[0]}
        rows.append(row)
        print(f"{layers:>6}  {row['seconds']:>7.2f}  {row['seconds'] / layers:>7.3f}  {row['cpu_seconds']:>7.2f}  "
              f"{row['cpu_seconds'] / layers:>7.3f}  {' '.join(f'{t:.2f}' for t in wall)}  "
              f"({row['load_average']:.1f})", flush=True)
    result = {"tp": args.tp, "cores": os.cpu_count(), "rows": rows}
    if len(rows) >= 2:
        for key in ("seconds", "cpu_seconds"):
            slope, intercept = fit_line([r["layers"] for r in rows], [r[key] for r in rows])
            worst = max(abs(r[key] - (intercept + slope * r["layers"])) / r[key] for r in rows)
            result[key + "_fit"] = {"slope": slope, "intercept": intercept, "worst_deviation": worst}
            print(f"linear fit ({key.replace('_', ' ')}): {intercept:.2f} s + {slope:.3f} s/layer "
                  f"(largest deviation {worst:.0%})")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
