"""The whole comparison sweep, written up as docs/benchmarks.md with plots.

    python benchmarks/run_all.py                       # models x TP 1/2/4, then plan_speed
    python benchmarks/run_all.py --render-only         # rewrite the page from the saved JSON

Runs ``compare_tp_plan.py`` under torchrun for every (model, tp), saving each
run's JSON and table under --out, then ``plan_speed.py``, and writes the markdown
page (machine, targets, summary tables, full tables) and PNG plots (matplotlib,
if installed; otherwise the page says the plots were skipped).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
from checkpoints import build_checkpoint  # noqa: E402
from write_docs import write_page  # noqa: E402


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default="llama,qwen3,opt,gpt2", help="families (built locally, benchmarks/checkpoints.py)")
    p.add_argument("--tp", default="1,2,4")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--steps", type=int, default=15, help="timed steps per system (interleaved; median)")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--plan-layers", default="8,16,32")
    p.add_argument("--plan-repeats", type=int, default=3)
    p.add_argument("--out", default=os.path.join(ROOT, "out", "benchmarks"), help="raw results (JSON, tables)")
    p.add_argument("--docs", default=os.path.join(ROOT, "docs"))
    p.add_argument("--timeout", type=int, default=600, help="seconds per run")
    p.add_argument("--render-only", action="store_true", help="only rewrite the page from the saved results")
    p.add_argument("--skip-plan-speed", action="store_true")
    return p.parse_args(argv)


def _run(cmd, timeout, env):
    t = time.perf_counter()
    try:
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
        return proc.returncode, proc.stdout, proc.stderr, time.perf_counter() - t
    except subprocess.TimeoutExpired as err:
        out = err.stdout.decode() if isinstance(err.stdout, bytes) else (err.stdout or "")
        return None, out, f"timed out after {timeout} s", time.perf_counter() - t


def run_compare(family, tp, args, env):
    path = build_checkpoint(family, os.path.join(ROOT, "checkpoints", f"bench-{family}"))
    out_json = os.path.join(args.out, f"compare-{family}-tp{tp}.json")
    if os.path.exists(out_json):
        os.remove(out_json)
    cmd = [os.path.join(os.path.dirname(sys.executable), "torchrun"), f"--nproc_per_node={tp}",
           os.path.join(HERE, "compare_tp_plan.py"), "--model", path, "--tp", str(tp), "--batch", str(args.batch),
           "--seq", str(args.seq), "--steps", str(args.steps), "--warmup", str(args.warmup), "--json", out_json]
    code, stdout, stderr, seconds = _run(cmd, args.timeout, env)
    table = stdout[stdout.find("\n" + family):].strip() if ("\n" + family) in stdout else stdout.strip()
    if code == 0 and os.path.exists(out_json):
        with open(out_json) as f:
            run = json.load(f)
    else:  # the run itself died: both systems get its last error line
        lines = [ln for ln in stderr.splitlines() if ln.strip() and "Warning" not in ln]
        message = (lines[-1] if lines else f"exit code {code}")[:400]
        run = {"meta": {"model_type": family, "tp": tp},
               "results": {"fxparallel": {"label": "fxparallel.parallelize", "error": message},
                           "transformers": {"label": 'transformers tp_plan="auto"', "error": message}}}
    run["table"] = table
    run["wall_s"] = seconds
    with open(out_json, "w") as f:
        json.dump(run, f, indent=2)
    print(f"{family} tp={tp}: {seconds:.0f} s", flush=True)
    print(table, flush=True)
    return run


def run_plan_speed(args, env):
    out_json = os.path.join(args.out, "plan_speed.json")
    cmd = [sys.executable, os.path.join(HERE, "plan_speed.py"), "--layers", *args.plan_layers.split(","),
           "--repeats", str(args.plan_repeats), "--json", out_json]
    code, stdout, stderr, _ = _run(cmd, args.timeout, env)
    print(stdout, flush=True)
    if code != 0:
        print(stderr[-2000:], file=sys.stderr)
        return None
    with open(out_json) as f:
        result = json.load(f)
    result["table"] = stdout.strip()
    return result


def machine() -> dict:
    import torch
    import transformers

    cpu = platform.processor() or "unknown"
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    memory = None
    try:
        memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    except (ValueError, OSError, AttributeError):
        pass
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else None
    return {"cpu": cpu, "cores": os.cpu_count(), "memory_gib": memory, "gpu": gpu, "os": platform.platform(),
            "python": platform.python_version(), "torch": torch.__version__, "transformers": transformers.__version__,
            "date": time.strftime("%Y-%m-%d %H:%M %Z"), "load_average_start": os.getloadavg()[0]}


def main(argv=None):
    args = parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    # one thread per rank at every TP size (torchrun's own default when it starts more than one process)
    env = dict(os.environ, HF_HUB_OFFLINE=os.environ.get("HF_HUB_OFFLINE", "1"), TRANSFORMERS_VERBOSITY="error",
               OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"),
               PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    families = [m for m in args.models.split(",") if m]
    tps = [int(t) for t in args.tp.split(",") if t]
    runs_path = os.path.join(args.out, "sweep.json")
    if args.render_only:
        with open(runs_path) as f:
            sweep = json.load(f)
    else:
        sweep = {"machine": machine(), "runs": [], "plan_speed": None,
                 "settings": {"batch": args.batch, "seq": args.seq, "steps": args.steps, "warmup": args.warmup,
                              "threads_per_rank": env["OMP_NUM_THREADS"]}}
        start = time.perf_counter()
        for family in families:
            for tp in tps:
                sweep["runs"].append(run_compare(family, tp, args, env))
        if not args.skip_plan_speed:
            sweep["plan_speed"] = run_plan_speed(args, env)
        sweep["machine"]["sweep_minutes"] = (time.perf_counter() - start) / 60
        sweep["machine"]["load_average_end"] = os.getloadavg()[0]
        with open(runs_path, "w") as f:
            json.dump(sweep, f, indent=2)
    page = write_page(sweep, args.docs)
    print(f"wrote {page}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
