"""Mutation check: does the suite catch the faults that matter? Not collected by pytest; run by hand before
resolving an issue that touches one of these paths (about 10 minutes on 2 cores):

    .venv/bin/python tests/mutation_check.py                 # every fault
    .venv/bin/python tests/mutation_check.py --only fp8      # the faults whose name holds "fp8"
    .venv/bin/python tests/mutation_check.py --markdown docs/mutation_check.md

Each fault is one text replacement in one file. For each, the working tree is copied to a scratch folder
(fxparallel/ and tests/), the replacement is applied there (a fault whose text is no longer found is
reported as stale: update it with the code), and the tests that should catch it run against the copy
(PYTHONPATH puts the copy's fxparallel ahead of the editable install; checked). A fault that survives (its
tests pass) is a gap in the evidence.
"""
from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@dataclass(frozen=True)
class Fault:
    name: str
    path: str  # relative to the repository
    old: str
    new: str
    tests: tuple  # pytest arguments


FAULTS = (
    Fault("load_checkpoint restores no optimizer state", "fxparallel/runtime/checkpoint.py",
          "        init_optimizer_state(model, optimizer)\n    state = state_dict_views(model, optimizer, mesh, with_optimizer)",
          "        init_optimizer_state(model, optimizer)\n    state = state_dict_views(model, optimizer, mesh, False)",
          ("tests/test_runtime.py", "-k", "checkpoint_loads or resume_gives")),
    # each reduced-precision case alone must catch it (its bounds are relative to the values)
    Fault("copy_to_tp's backward all-reduce dropped (bfloat16)", "fxparallel/ops/collectives.py",
          '_CopyToTP = _gradient_only(_all_reduce, "_CopyToTP")', '_CopyToTP = _gradient_only(lambda grad, *args: grad, "_CopyToTP")',
          ("tests/test_reduced_precision.py", "-k", "bfloat16")),
    Fault("copy_to_tp's backward all-reduce dropped (float16)", "fxparallel/ops/collectives.py",
          '_CopyToTP = _gradient_only(_all_reduce, "_CopyToTP")', '_CopyToTP = _gradient_only(lambda grad, *args: grad, "_CopyToTP")',
          ("tests/test_reduced_precision.py", "-k", "float16 and not bfloat16")),
    Fault("each rank loads its neighbour's shard", "fxparallel/load/weights.py",
          "    pieces = p.pieces(rank, tp)", "    pieces = p.pieces((rank + 1) % tp, tp)", ("tests/test_loader.py",)),
    Fault("an uneven split off by one", "fxparallel/plan/placement.py",
          "            pieces.append((start, start + sizes[rank]))",
          "            pieces.append((start + bool(split and rank), start + sizes[rank] + bool(split and rank)))",
          ("tests/test_uneven.py",)),
    Fault("a decode step at the wrong position", "fxparallel/generation/loop.py",
          "step_positions = step_positions[:, -1:] + 1", "step_positions = step_positions[:, -1:] + 2",
          ("tests/test_generation.py", "-k", "llama")),
    Fault("fp8 dequantization skips the scale", "fxparallel/load/fp8.py",
          "out[..., start - r0:stop - r0, :].copy_(q.to(s.dtype).mul_(s))",
          "out[..., start - r0:stop - r0, :].copy_(q.to(s.dtype))",
          ("tests/test_fp8_loading.py",)),
    Fault("graph cache accepts files it cannot authenticate", "fxparallel/graph_cache/store.py",
          'if not isinstance(stored, dict) or not isinstance(stored.get("mac"), str) or not hmac.compare_digest(',
          "if not isinstance(stored, dict) or False and not hmac.compare_digest(",
          ("tests/unit/test_security_graph_cache.py",)),
    Fault("rank 0 sends every rank its own graph", "fxparallel/graph_cache/first_rank.py",
          "    planned = decode(entries[group.rank])", "    planned = decode(entries[0])",
          ("tests/test_first_rank_planning.py", "-k", "every_ranks_graph")),
    Fault("model.state_dict() loses its DCP pieces", "fxparallel/module.py",
          "        self.register_state_dict_post_hook(describe_state_dict)", "        pass",
          ("tests/test_dcp_state_dict.py", "-k", "llama")),
    Fault("names from config strings reach generated code", "fxparallel/capture/meta_model.py",
          "    check_model_names(model)\n", "", ("tests/unit/test_security_graph_cache.py", "-k", "config_strings")),
    Fault("an op without a rule runs on its local shards (the fallback gathers nothing)", "fxparallel/plan/solver.py",
          's = Strategy({i: R for i in ins}, R, note="no sharding rule: inputs gathered", name="fallback")',
          's = Strategy(dict(in_pl), in_pl[ins[0]], note="no sharding rule: inputs gathered", name="fallback")',
          ("tests/test_fallback_ops.py",)),
    Fault("a gathered value sliced for shards keeps a partial gradient", "fxparallel/rewrite/redistribute.py",
          "                        sharded_consumers[source].append(step)", "                        pass",
          ("tests/rules/test_rule_writes.py", "-k", "sliced_for_a_row_parallel")),
    Fault("each rank sends k // 2 sampling candidates", "fxparallel/generation/select.py",
          "    values, ids = local.topk(min(k, local.shape[-1]), dim=-1)",
          "    values, ids = local.topk(min(max(1, k // 2), local.shape[-1]), dim=-1)", ("tests/test_sampling.py",)),
    Fault("top-k sampling ignores top_k / top_p / temperature on the candidates", "fxparallel/generation/loop.py",
          "probs = torch.softmax(processors(sequences, scores), dim=-1)", "probs = torch.softmax(scores, dim=-1)",
          ("tests/test_sampling.py", "-k", "top_k_1")),
    Fault("sampling with output_scores skips the logits processors", "fxparallel/generation/loop.py",
          "scores = processors(sequences, full_scores(local, sizes, model.tp_group))",
          "scores = full_scores(local, sizes, model.tp_group)", ("tests/test_sampling.py", "-k", "output_scores")),
)


def _scratch() -> str:
    folder = tempfile.mkdtemp(prefix="fxparallel-mutation-")
    for name in ("fxparallel", "tests", "pyproject.toml", "examples", "benchmarks"):
        src = os.path.join(ROOT, name)
        if os.path.isdir(src):
            shutil.copytree(src, os.path.join(folder, name), ignore=shutil.ignore_patterns("__pycache__"))
        elif os.path.exists(src):
            shutil.copy(src, folder)
    return folder


def _env(folder: str) -> dict:
    env = dict(os.environ, PYTHONPATH=folder + os.pathsep + os.environ.get("PYTHONPATH", ""))
    probe = subprocess.run([sys.executable, "-c", "import fxparallel; print(fxparallel.__file__)"], cwd=folder, env=env,
                           capture_output=True, text=True)
    if probe.returncode != 0 or not probe.stdout.strip().startswith(folder):
        raise SystemExit(f"the scratch copy's fxparallel is not the one imported ({probe.stdout.strip()}"
                         f"{probe.stderr[-2000:]}); cannot check faults")
    return env


def check(fault: Fault) -> tuple:
    """(verdict, seconds): "caught", "SURVIVED" or "stale" (the fault's text is not in the file)."""
    folder = _scratch()
    try:
        path = os.path.join(folder, fault.path)
        with open(path) as f:
            text = f.read()
        if text.count(fault.old) != 1:
            return "stale", 0.0
        env = _env(folder)  # before the fault: the copy imports, and is the one imported
        with open(path, "w") as f:
            f.write(text.replace(fault.old, fault.new))
        start = time.monotonic()
        run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", *fault.tests],
                             cwd=folder, env=env, capture_output=True, text=True)
        return ("caught" if run.returncode != 0 else "SURVIVED"), time.monotonic() - start
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", default="", help="check only the faults whose name holds this text")
    parser.add_argument("--markdown", default=None, help="also write the report as a markdown table here")
    args = parser.parse_args(argv)
    rows = []
    for fault in (f for f in FAULTS if args.only in f.name):
        verdict, seconds = check(fault)
        rows.append((fault, verdict, seconds))
        print(f"{verdict:9s} {seconds:6.1f} s  {fault.name}  ({fault.path}; {' '.join(fault.tests)})", flush=True)
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write("| fault | file | tests that should catch it | verdict | seconds |\n|---|---|---|---|---|\n")
            for fault, verdict, seconds in rows:
                f.write(f"| {fault.name} | `{fault.path}` | `{' '.join(fault.tests)}` | {verdict} | {seconds:.0f} |\n")
    return 1 if any(v != "caught" for _, v, _ in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
