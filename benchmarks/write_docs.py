"""docs/benchmarks.md and its plots, from the sweep's saved results (run_all.py)."""
from __future__ import annotations

import os

SYSTEMS = ("fxparallel", "transformers")
LABELS = {"fxparallel": "fxparallel", "transformers": 'transformers tp_plan="auto"'}
PLOTS = {"step": "benchmarks_step_time.png", "bytes": "benchmarks_bytes.png", "memory": "benchmarks_memory.png"}
TARGET_BYTES, TARGET_STEP, TARGET_PLAN_S = 0.6, 0.8, 20.0


def _ok(r) -> bool:
    return r is not None and "error" not in r


def _mib(n) -> str:
    return f"{n / 2**20:.2f}"


def _counts(r) -> str:
    def total(phase, kind):
        return r.get(f"{phase}_collectives", {}).get(kind, [0, 0])[0]

    fwd = f"{total('forward', 'all_reduce')} AR + {total('forward', 'all_gather')} AG"
    bwd = f"{total('backward', 'all_reduce')} AR + {total('backward', 'all_gather')} AG"
    return f"{fwd} / {bwd}"


def _error(r, limit=160) -> str:
    text = r.get("error", "").replace("|", "\\|")
    return "error: " + (text if len(text) <= limit else text[:limit] + " ...")


def _logits(r) -> str:
    if r.get("logits_error"):
        return "forward without labels failed: " + r["logits_error"][:100].replace("|", "\\|")
    return f"{r['logits_diff']:.1e}"


def _by_model(sweep) -> dict:
    models = {}
    for run in sweep["runs"]:
        models.setdefault(run["meta"]["model_type"], []).append(run)
    for runs in models.values():
        runs.sort(key=lambda r: r["meta"]["tp"])
    return models


def _ratio(a, b):
    return f"{a / b:.2f}x" if a is not None and b else "-"


def _label(name, tp) -> str:
    if name == "transformers" and tp == 1:
        return LABELS[name] + " (TP=1: the plain model)"
    return LABELS[name]


def summary_table(runs) -> list:
    head = ("| TP | system | fwd+bwd ms | fwd+bwd+AdamW ms | forward ms | tokens/s | collectives fwd / bwd "
            "| bytes/step MiB | peak MiB/rank | max logits diff | ready s (capture+plan s) |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for run in runs:
        tp = run["meta"]["tp"]
        res = run["results"]
        for name in SYSTEMS:
            r = res.get(name)
            if r is None:
                continue
            if not _ok(r):
                lines.append(f"| {tp} | {_label(name, tp)} | {_error(r)} |" + " |" * 9)
                continue
            plan = "" if r.get("capture_plan_s") is None else f" ({r['capture_plan_s']:.1f})"
            lines.append(f"| {tp} | {_label(name, tp)} | {r['fwd_bwd_s'] * 1e3:.1f} | {r['step_s'] * 1e3:.1f} | "
                         f"{r['forward_s'] * 1e3:.1f} | {r['tokens_per_s']:.0f} | {_counts(r)} | "
                         f"{_mib(r['step_bytes'])} | {r['peak_mib']:.0f} | {_logits(r)} | {r['ready_s']:.1f}{plan} |")
        a, b = res.get("fxparallel"), res.get("transformers")
        if _ok(a) and _ok(b):
            lines.append(f"| {tp} | **ratio fxparallel / transformers** | **{_ratio(a['fwd_bwd_s'], b['fwd_bwd_s'])}** "
                         f"| {_ratio(a['step_s'], b['step_s'])} | {_ratio(a['forward_s'], b['forward_s'])} | "
                         f"{_ratio(a['tokens_per_s'], b['tokens_per_s'])} | | "
                         f"**{_ratio(a['step_bytes'], b['step_bytes'])}** | {_ratio(a['peak_mib'], b['peak_mib'])} "
                         f"| | {_ratio(a['ready_s'], b['ready_s'])} |")
    return lines


def targets(sweep) -> list:
    lines = ["| target | measured | met |", "|---|---|---|"]
    llama = [r for r in sweep["runs"] if r["meta"]["model_type"] == "llama" and r["meta"]["tp"] > 1]
    for run in llama:
        a, b = run["results"].get("fxparallel"), run["results"].get("transformers")
        tp = run["meta"]["tp"]
        if _ok(a) and _ok(b):
            br = a["step_bytes"] / b["step_bytes"]
            sr = a["fwd_bwd_s"] / b["fwd_bwd_s"]
            lines.append(f"| Llama TP={tp}: bytes per training step <= {TARGET_BYTES}x transformers | {br:.2f}x "
                         f"({_mib(a['step_bytes'])} vs {_mib(b['step_bytes'])} MiB) | "
                         f"{'yes' if br <= TARGET_BYTES else 'NO'} |")
            lines.append(f"| Llama TP={tp}: forward+backward time <= {TARGET_STEP}x transformers | {sr:.2f}x "
                         f"({a['fwd_bwd_s'] * 1e3:.0f} vs {b['fwd_bwd_s'] * 1e3:.0f} ms; with AdamW "
                         f"{a['step_s'] / b['step_s']:.2f}x; CPU time of the step {a['step_cpu_s'] / b['step_cpu_s']:.2f}x)"
                         f" | {'yes' if sr <= TARGET_STEP else 'NO'} |")
        else:
            lines.append(f"| Llama TP={tp} | a system failed | NO |")
    ps = sweep.get("plan_speed")
    if ps:
        rows = {r["layers"]: r for r in ps["rows"]}
        if 32 in rows:
            r = rows[32]
            lines.append(f"| plan a 32-layer Llama-3-8B config (meta, tp={ps['tp']}) in < {TARGET_PLAN_S:.0f} s on "
                         f"{ps.get('cores', '?')} cores | {r['seconds']:.1f} s wall (load average "
                         f"{r['load_average']:.1f}), {r['cpu_seconds']:.1f} s CPU | "
                         f"{'yes' if r['seconds'] < TARGET_PLAN_S else 'NO'} |")
        fit = ps.get("cpu_seconds_fit")
        if fit:
            lines.append(f"| planning time linear in depth | CPU s = {fit['intercept']:.2f} + {fit['slope']:.3f} x "
                         f"layers, largest deviation from the line {fit['worst_deviation']:.0%} | "
                         f"{'yes' if fit['worst_deviation'] <= 0.15 else 'NO'} |")
    return lines


def plan_speed_table(ps) -> list:
    if not ps:
        return ["(plan_speed was not run)"]
    lines = ["| layers | wall s (median) | wall s/layer | CPU s (median) | CPU s/layer | runs (wall s) | load average |",
             "|---|---|---|---|---|---|---|"]
    for r in ps["rows"]:
        lines.append(f"| {r['layers']} | {r['seconds']:.2f} | {r['seconds'] / r['layers']:.3f} | "
                     f"{r['cpu_seconds']:.2f} | {r['cpu_seconds'] / r['layers']:.3f} | "
                     f"{' '.join(f'{t:.1f}' for t in r['runs'])} | {r['load_average']:.1f} |")
    for key, name in (("seconds_fit", "wall"), ("cpu_seconds_fit", "CPU")):
        fit = ps.get(key)
        if fit:
            lines.append("")
            lines.append(f"Linear fit ({name}): {fit['intercept']:.2f} s + {fit['slope']:.3f} s/layer, largest "
                         f"deviation {fit['worst_deviation']:.0%}.")
    return lines


def make_plots(sweep, docs_dir):
    """Three figures, one panel per model. Returns the file names, or None without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    models = _by_model(sweep)
    metrics = {"step": ("fwd+bwd+AdamW step (ms)", lambda r: r["step_s"] * 1e3),
               "bytes": ("bytes communicated per training step (MiB)", lambda r: r["step_bytes"] / 2**20),
               "memory": ("peak memory per rank (MiB)", lambda r: r["peak_mib"])}
    for key, (ylabel, value) in metrics.items():
        fig, axes = plt.subplots(1, len(models), figsize=(4 * len(models), 3.4), squeeze=False)
        for ax, (model, runs) in zip(axes[0], models.items()):
            for name, marker in zip(SYSTEMS, ("o", "s")):
                points = [(run["meta"]["tp"], value(run["results"][name])) for run in runs
                          if _ok(run["results"].get(name))]
                if points:
                    ax.plot(*zip(*points), marker=marker, label=LABELS[name])
            ax.set_title(model)
            ax.set_xlabel("TP size")
            ax.set_xticks(sorted({run["meta"]["tp"] for run in runs}))
            if not ax.lines:
                ax.text(0.5, 0.5, "no system ran", ha="center", va="center", transform=ax.transAxes)
        axes[0][0].set_ylabel(ylabel)
        axes[0][0].legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(os.path.join(docs_dir, PLOTS[key]), dpi=110)
        plt.close(fig)
    return PLOTS


NOTES = """## How to read these numbers

- **Collectives** are counted, not computed: both systems run under the same wrappers of the
  `torch.distributed` functions and of the functional collectives DTensor uses
  (`benchmarks/comm_counter.py`), over one training step split into forward, backward and optimizer.
  For fxparallel the count is also checked against its own plan (`plan.collectives`) in every run.
  Expected for an L-layer Llama: fxparallel 2L+1 all-reduces forward plus one all-gather of the loss
  statistics (2 floats per token per rank), 2L+1 backward; transformers 2L+1 forward plus an
  all-gather of the complete logits (batch x sequence x vocabulary), 5L+1 backward (one per
  column-parallel linear's input gradient). Qwen3's per-head q/k norms add 2L small parameter-gradient
  all-reduces to both systems.
- **Step times** are the median over steps of the slowest rank, the two systems' steps alternating
  so that other load on the machine hits both alike. "fwd+bwd" stops the clock after `backward()`;
  "fwd+bwd+AdamW" includes the optimizer step; "forward" is a no-grad forward with labels (loss, no
  logits gather for fxparallel; transformers gathers the logits). CPU time is that of the rank's
  process and is the figure a busy machine distorts least.
- **Ready** is `parallelize(...)` for fxparallel (Dynamo capture on the meta device, solve, rewrite,
  load this rank's slices; the first capture in a process also pays Dynamo's start-up) and
  `from_pretrained(..., distributed_config=DistributedConfig(tp_size=N))` for transformers (a
  hand-written plan: nothing to capture). Both run after the single-device reference was loaded in
  the same process.
- **Peak memory** per rank is the process before any system plus the system's own growth while it was
  built, checked and warmed up (RSS high-water mark on CPU, reset between systems; max allocated on
  CUDA), so each system is measured as if alone. On these small models it is dominated by the
  runtime; fxparallel's extra is the capture machinery (Dynamo, fake tensors), which does not grow
  with the weights.
- **TP=1** has no communication: it measures each system's own overhead (for transformers the plain
  model). **TP=4** runs four single-threaded ranks on two cores, so its times mostly show
  oversubscription; the byte counts do not depend on the machine.
- A failing system is reported with its error message; the other system's numbers still stand.
""".splitlines()


FULL_TABLES = "## Full tables of every run"


def written_by_hand(path: str) -> list:
    """The sections of the page that other benchmarks' results were written into by hand (those after the
    planning-speed section and before the full tables), kept when the sweep rewrites the page."""
    if not os.path.exists(path):
        return []
    with open(path) as f:
        text = f.read()
    planning = text.find("## Planning speed")
    start, end = text.find("\n## ", planning + 1), text.find(FULL_TABLES)
    kept = text[start + 1:end].rstrip() if planning >= 0 and 0 <= start < end else ""
    return kept.splitlines() + [""] if kept else []


def write_page(sweep, docs_dir) -> str:
    os.makedirs(docs_dir, exist_ok=True)
    m = sweep["machine"]
    s = sweep["settings"]
    plots = make_plots(sweep, docs_dir)
    out = ["# Benchmarks: fxparallel vs transformers' tensor parallelism", ""]
    out += ["Generated by `python benchmarks/run_all.py` (each cell one run of "
            "`torchrun --nproc_per_node=N benchmarks/compare_tp_plan.py --model DIR --tp N`; "
            "planning speed by `benchmarks/plan_speed.py`). Numbers below are from one sweep on the machine described; "
            "rerun the script to reproduce them on yours.", ""]
    out += ["## Machine", "",
            f"- CPU: {m['cpu']}, {m['cores']} cores" + (f", {m['memory_gib']:.0f} GiB" if m.get("memory_gib") else ""),
            f"- GPU: {m['gpu'] or 'none (CPU, gloo)'}",
            f"- {m['os']}, Python {m['python']}, torch {m['torch']}, transformers {m['transformers']}",
            f"- date {m['date']}; the sweep took {m.get('sweep_minutes', 0):.1f} min; load average "
            f"{m['load_average_start']:.1f} at the start, {m.get('load_average_end', float('nan')):.1f} at the end "
            "(the machine was shared with other jobs: wall times are noisy, which is why the systems' steps are "
            "interleaved and CPU times are given too)",
            f"- every run: batch {s['batch']} x sequence {s['seq']}, fp32, AdamW, {s.get('threads_per_rank', '?')} "
            f"thread(s) per rank (TP=4 runs 4 ranks on {m['cores']} cores), median of {s['steps']} steps "
            f"after {s['warmup']} warm-up; models random-initialized locally (`benchmarks/checkpoints.py`: hidden 256, "
            "4 layers, 8 heads, 4 kv heads, MLP 1024, vocabulary 4096)", ""]
    out += ["## Targets", ""] + targets(sweep) + [""]
    out += ["## Results by model", "",
            "Collectives: AR = all-reduce, AG = all-gather, per training step (forward / backward), counted by the "
            "same wrapper of `torch.distributed` and the functional collectives for both systems "
            "(`benchmarks/comm_counter.py`); bytes are the full tensor of each call. Peak memory: RSS "
            "high-water mark of the process before any system plus the growth while the system was built, "
            "checked and warmed up (CUDA: max allocated). \"ready\" = load + capture + plan + rewrite.", ""]
    for model, runs in _by_model(sweep).items():
        out += [f"### {model}", ""] + summary_table(runs) + [""]
    out += NOTES + [""]
    out += ["## Plots", ""]
    if plots:
        out += [f"![step time vs TP]({PLOTS['step']})", "", f"![bytes communicated vs TP]({PLOTS['bytes']})", "",
                f"![memory per rank vs TP]({PLOTS['memory']})", ""]
    else:
        out += ["Plots skipped: matplotlib is not installed (`pip install matplotlib` into the venv and rerun with "
                "`--render-only`).", ""]
    path = os.path.join(docs_dir, "benchmarks.md")
    out += ["## Planning speed (Llama-3-8B shape on the meta device)", ""] + plan_speed_table(sweep.get("plan_speed"))
    out += [""] + written_by_hand(path) + [FULL_TABLES, ""]
    for run in sweep["runs"]:
        out += [f"<details><summary>{run['meta']['model_type']}, TP={run['meta']['tp']}</summary>", "", "```",
                run.get("table", "").strip(), "```", "", "</details>", ""]
    with open(path, "w") as f:
        f.write("\n".join(out).rstrip() + "\n")
    return path
