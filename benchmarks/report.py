"""The comparison as a text table: one row per metric, one column per system, plus the ratio."""
from __future__ import annotations


def _collectives(d: dict) -> str:
    if not d:
        return "none"
    return ", ".join(f"{calls} {kind}" for kind, (calls, _) in d.items())


def _bytes(n) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return str(n)


def phase_bytes(r: dict, phase: str) -> int:
    return sum(b for _, b in r.get(f"{phase}_collectives", {}).values())


def _num(x, fmt):
    return "n/a" if x is None else format(x, fmt)


ROWS = [
    # (label, value -> text, value used for the ratio or None)
    ("ready model: load+capture+plan+rewrite (s)", lambda r: _num(r["ready_s"], ".2f"), lambda r: r["ready_s"]),
    ("  of which capture+plan+rewrite (s)", lambda r: _num(r["capture_plan_s"], ".2f"), None),
    ("first training step (s)", lambda r: f"{r['first_step_s']:.3f}", lambda r: r["first_step_s"]),
    ("forward, no grad (ms, median)", lambda r: f"{r['forward_s'] * 1e3:.1f}", lambda r: r["forward_s"]),
    ("  CPU time of the forward (ms, median)", lambda r: f"{r['forward_cpu_s'] * 1e3:.1f}",
     lambda r: r["forward_cpu_s"]),
    ("fwd+bwd (ms, median)", lambda r: f"{r['fwd_bwd_s'] * 1e3:.1f}", lambda r: r["fwd_bwd_s"]),
    ("fwd+bwd+AdamW step (ms, median)", lambda r: f"{r['step_s'] * 1e3:.1f}", lambda r: r["step_s"]),
    ("  CPU time of the step (ms, median)", lambda r: f"{r['step_cpu_s'] * 1e3:.1f}", lambda r: r["step_cpu_s"]),
    ("training tokens/s", lambda r: f"{r['tokens_per_s']:.0f}", lambda r: r["tokens_per_s"]),
    ("forward collectives / step", lambda r: _collectives(r["forward_collectives"]), None),
    ("forward bytes / step", lambda r: _bytes(phase_bytes(r, "forward")), lambda r: phase_bytes(r, "forward")),
    ("backward collectives / step", lambda r: _collectives(r["backward_collectives"]), None),
    ("backward bytes / step", lambda r: _bytes(phase_bytes(r, "backward")), lambda r: phase_bytes(r, "backward")),
    ("optimizer collectives / step", lambda r: _collectives(r["optimizer_collectives"]), None),
    ("bytes communicated / training step", lambda r: _bytes(r["step_bytes"]), lambda r: r["step_bytes"]),
    ("peak memory per rank (MiB, max over ranks)", lambda r: f"{r['peak_mib']:.0f}", lambda r: r["peak_mib"]),
    ("  growth during the run (MiB, per rank)", lambda r: " ".join(f"{x:.0f}" for x in r["growth_mib_per_rank"]),
     None),
    ("max |logits - single device|",
     lambda r: "error (below)" if r.get("logits_error") else f"{r['logits_diff']:.2e}", None),
    ("|loss - single device|", lambda r: f"{r['loss_diff']:.2e}", None),
]


def format_table(meta: dict, results: dict) -> str:
    names = list(results)
    ok = {n: "error" not in results[n] for n in names}
    header = ["metric"] + [results[n]["label"] for n in names]
    ratio = len(names) == 2 and all(ok.values())
    if ratio:
        header.append(f"{names[0]}/{names[1]}")
    rows = []
    for label, text, value in ROWS:
        row = [label] + [text(results[n]) if ok[n] else "-" for n in names]
        if ratio:
            a, b = (value(results[n]) if value else None for n in names)
            row.append(f"{a / b:.2f}x" if a is not None and b else "")
        rows.append(row)
    widths = [max(len(r[i]) for r in rows + [header]) for i in range(len(header))]
    lines = [
        f"{meta['model_type']} ({meta['model']}), tp={meta['tp']}, batch {meta['batch']} x seq {meta['seq']}, "
        f"{meta['dtype']}, {meta['device']}/{meta['backend']}, {meta.get('threads', '?')} thread(s)/rank, median of {meta['steps']} interleaved steps after "
        f"{meta['warmup']} warm-up; memory = {meta['memory']}; load average {_num(meta.get('load_average'), '.1f')}",
        "  ".join(h.ljust(w) for h, w in zip(header, widths)).rstrip(),
        "  ".join("-" * w for w in widths),
    ]
    lines += ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
    for n in names:
        if ok[n] and "plan_agrees" in results[n]:
            r = results[n]
            verdict = "agree" if r["plan_agrees"] else "DISAGREE"
            lines.append(f"{r['label']}: collectives counted and its plan's prediction {verdict}"
                         + ("" if r["plan_agrees"] else
                            f" (plan: {r['plan_collectives']}; counted: forward {r['forward_collectives']}, "
                            f"backward {r['backward_collectives']})"))
        if not ok[n]:
            lines.append(f"{results[n]['label']} failed: {results[n]['error']}")
        elif results[n].get("logits_error"):
            lines.append(f"{results[n]['label']}: forward without labels (complete logits) failed: "
                         f"{results[n]['logits_error']}")
    if all(ok.values()) and len(names) == 2:
        a, b = (results[n]["losses"] for n in names)
        gap = max(abs(x - y) for x, y in zip(a, b))
        lines.append(f"loss after each of {len(a)} identical AdamW steps: max |{names[0]} - {names[1]}| = {gap:.2e}")
    return "\n".join(lines)
