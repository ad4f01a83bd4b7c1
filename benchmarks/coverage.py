"""Regenerate docs/coverage.md: can fxparallel parallelize each causal-LM type transformers registers?

For every type: build a tiny random config (benchmarks/tiny_configs.py), save it as a
safetensors checkpoint, parallelize it over 2 gloo ranks, and compare loss, logits
and every parameter gradient with the single-device transformers model.

    python benchmarks/coverage.py                 # all types (about 10 s each on 2 cores)
    python benchmarks/coverage.py llama gpt2      # some types
    python benchmarks/coverage.py gpt2 opt --merge docs/coverage.json --json docs/coverage.json \
        --tp4 docs/coverage_tp4.json  # update rows (the table keeps its TP=4 column)
    python benchmarks/coverage.py --tp 4 --no-generate --json docs/coverage_tp4.json --out /tmp/tp4.md  # TP=4 rows
    python benchmarks/coverage.py --render docs/coverage.json --tp4 docs/coverage_tp4.json  # the table, TP=4 column
    python benchmarks/coverage.py --layers 5 llama mixtral --out /tmp/deep.md   # deeper models: layers captured once
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, "..", "tests"))

TOL = 1e-5
# a type outside TOL in float32 is checked again in float64: within this, the float32 difference was rounding
# (not 1e-14: transformers' loss casts the logits to float32, so the reference itself keeps float32 rounding)
TOL_FLOAT64 = 1e-6
GENERATED = 6  # new tokens per greedy generation check
TIMEOUT = 240  # seconds per type (--timeout)
MAX_PARAMS = 20_000_000  # larger "tiny" models are skipped (they would not be tiny)


def _dory_in_float64():
    """Dory's norms and logits cast to float32 whatever the model's dtype: kept in the model's dtype."""
    import torch.nn.functional as F
    from transformers.models.dory import modeling_dory

    modeling_dory.DoryL2Norm.forward = lambda self, x: self._norm(x)
    modeling_dory.DoryLMHead.forward = lambda self, h: F.linear(h, self.weight) * (
        self.logit_scale * self.logit_scale_factor)


# types whose own code rounds at float32 in a float64 model: for the float64 check, that code keeps float64
# (in the reference and in the parallel model alike; the float32 check runs their code as it is)
FLOAT64_AS_IS = {"dory": _dory_in_float64}


def _check(rank, tp, model_type, path, dtype_name="float32", generate=True):
    """Runs on every rank: parallelize and compare with the single-device model (in ``dtype_name``), and
    generate (unless ``generate`` is False)."""
    import warnings

    import torch
    import torch.distributed as dist

    warnings.filterwarnings("ignore")
    if dtype_name == "float64" and model_type in FLOAT64_AS_IS:
        FLOAT64_AS_IS[model_type]()
    import fxparallel
    from checks import compare
    from models import reference

    dtype = getattr(torch, dtype_name)
    model = fxparallel.parallelize(path, dist.group.WORLD, dtype=dtype)
    ref = reference(path).to(dtype)
    ref.config.use_cache = False  # scoring needs no cache (and BLT cannot build its own from its config)
    vocab = model.config.get_text_config().vocab_size  # (a multimodal config keeps it in text_config)
    ids = torch.randint(0, vocab, (2, 9), generator=torch.Generator().manual_seed(1))
    errors = compare(model, ref, rank, tp, ids=ids)
    plan = model.plan
    with torch.no_grad():  # the size of what is compared: the tolerance is relative where it exceeds 1
        out = ref(input_ids=ids, labels=ids)
    scales = {"loss": out.loss.abs().item(), "logits": out.logits.abs().max().item(),
              "grad": max(p.grad.abs().max().item() for p in ref.parameters() if p.grad is not None)}
    return {"errors": {k: errors[k] for k in ("loss", "logits", "grad")}, "scales": scales, "plan": plan.to_dict(),
            "generation": _generation(model, ref, ids) if generate else None}


def _generation(model, ref, ids) -> str:
    """Greedy tokens of ``model.generate`` vs single-device transformers' (left padding included):
    "same", "differs", "transformers: <its error>" or "error: <ours>"."""
    import torch

    mask = torch.ones_like(ids)
    mask[0, :2] = 0  # the first prompt is 2 tokens shorter, padded on the left
    kwargs = dict(input_ids=ids, attention_mask=mask, max_new_tokens=GENERATED, do_sample=False,
                  pad_token_id=0)
    try:
        with torch.no_grad():
            expected = ref.generate(**kwargs)
    except Exception as err:  # noqa: BLE001 - transformers cannot generate with this model
        return f"transformers: {type(err).__name__}: {err}"[:200]
    try:
        tokens = model.generate(**kwargs)
    except Exception as err:  # noqa: BLE001 - report, the row's other checks stand
        return f"error: {type(err).__name__}: {err}"[:300]
    if any(graph.cache_length for graph in model.graphs()):
        return "same" if torch.equal(tokens, expected) else "differs"
    # generated without a cache (a cache the graphs cannot carry, or a config with use_cache=False: each step
    # recomputes the sequence), as transformers' generate(use_cache=False), which gives the tokens of its cached
    # generate where the model's cached steps are right
    if torch.equal(tokens, expected):
        return "same, no cache"
    with torch.no_grad():
        uncached = ref.generate(**kwargs, use_cache=False)
    return "same as use_cache=False" if torch.equal(tokens, uncached) else "differs"


def _per_layer(plan: dict, direction: str, layers: int) -> str:
    in_layers = sum(c["count"] for c in plan["collectives"] if c["direction"] == direction and "*" in c["where"])
    other = sum(c["count"] for c in plan["collectives"] if c["direction"] == direction and "*" not in c["where"])
    return f"{in_layers / max(layers, 1):g}/layer + {other}"


def _tiny_config(model_type: str, layers=None):
    """The sweep's tiny config, or that config with ``layers`` decoder layers (whichever attribute holds them)."""
    from tiny_configs import tiny_config

    config = tiny_config(model_type)
    if layers is None:
        return config
    depth = next((k for k in ("num_hidden_layers", "n_layer", "num_layers") if k in vars(config)), "num_hidden_layers")
    return tiny_config(model_type, **{depth: layers})


def _transformers_error(model_type: str, layers=None, default=False):
    """transformers' own error where its single-device model cannot train on the sweep's input (a training
    step, as the check makes), or cannot be built from ``model_type``'s default config (``default``); else None."""
    import torch
    from transformers import CONFIG_MAPPING, AutoModelForCausalLM

    try:
        if default:
            with torch.device("meta"):
                AutoModelForCausalLM.from_config(CONFIG_MAPPING[model_type]())
            return None
        config = _tiny_config(model_type, layers)
        model = AutoModelForCausalLM.from_config(config).train()
        ids = torch.randint(0, config.get_text_config().vocab_size, (2, 9), generator=torch.Generator().manual_seed(1))
        model(input_ids=ids, labels=ids, use_cache=False).loss.backward()  # as the parallel model is captured
        return None
    except Exception as err:  # noqa: BLE001 - the answer is the error
        return f"{type(err).__name__}: {err}"


def check_type(model_type: str, tp: int, layers=None, generate=True, timeout=TIMEOUT) -> dict:
    from distributed import run_ranks
    from models import save_checkpoint

    row = {"type": model_type, "tp": tp}
    try:
        config = _tiny_config(model_type, layers)
        row["hf_plan"] = bool(getattr(config, "base_model_tp_plan", None))
    except Exception as err:  # noqa: BLE001 - report, do not stop the sweep
        row.update(status="config", why=f"tiny config: {type(err).__name__}: {err}"[:300])
        return row
    try:  # a type whose sizes the tiny config does not reach could be huge: count on the meta device first
        import torch
        from transformers import AutoModelForCausalLM

        with torch.device("meta"):
            numel = sum(p.numel() for p in AutoModelForCausalLM.from_config(config).parameters())
    except Exception as err:  # noqa: BLE001
        failing = _transformers_error(model_type, default=True)
        row.update(status="transformers" if failing else "config",
                   why=(f"transformers cannot build its default config: {failing}" if failing
                        else f"cannot build model: {type(err).__name__}: {err}")[:300])
        return row
    if numel > MAX_PARAMS:
        row.update(status="config", why=f"tiny config still has {numel / 1e6:.0f}M parameters (sizes not reached)")
        return row
    failing = _transformers_error(model_type, layers=layers)
    if failing:
        row.update(status="transformers", why=f"transformers' own model fails: {failing}"[:300])
        return row
    with tempfile.TemporaryDirectory() as tmp:
        try:
            save_checkpoint(config, tmp)
        except Exception as err:  # noqa: BLE001
            row.update(status="config", why=f"cannot build/save model: {type(err).__name__}: {err}"[:300])
            return row
        try:
            results = run_ranks(tp, _check, model_type, tmp, "float32", generate, timeout=timeout)
        except AssertionError as err:
            text = str(err).strip().splitlines()
            last = next((ln for ln in reversed(text) if ln.strip()), "")
            row.update(status="error", why=last[:300])
            return row
        except Exception as err:  # noqa: BLE001 - e.g. no answer within timeout
            row.update(status="error", why=f"{type(err).__name__}: no result within {timeout} s")
            return row
        worst, scales = _worst(results)
        # like torch.allclose(atol=rtol=TOL): fp32 rounding grows with the size of the values compared
        within = all(worst[k] < TOL * max(1.0, scales[k]) for k in worst)
        if not within:  # rounding, or a wrong plan? In float64 rounding shrinks by 1e-9; a wrong plan does not
            try:
                # (greedy tokens again too where float32's differ: near-tied logits, or a wrong plan?)
                again = generate and _agreed(r["generation"] for r in results) == "differs"
                results64 = run_ranks(tp, _check, model_type, tmp, "float64", again, timeout=timeout)
                row["float64_errors"], _ = _worst(results64)
                if again:
                    row["generation_float64"] = _agreed(r["generation"] for r in results64)
            except Exception as err:  # noqa: BLE001
                row["float64_errors"] = f"{type(err).__name__}: {str(err)[-200:]}"
    rounding = isinstance(row.get("float64_errors"), dict) and \
        all(row["float64_errors"][k] < TOL_FLOAT64 * max(1.0, scales[k]) for k in worst)
    plan = results[0]["plan"]
    layers = getattr(config, "num_hidden_layers", 2) or 2
    replicated = sorted({p["name"] for p in plan["params"] if p["placement"] == "R" and len(p["shape"]) >= 2})
    row.update(
        status="ok" if within or rounding else "wrong",
        max_error=max(worst.values()),
        errors=worst,
        scales=scales,
        fwd=_per_layer(plan, "forward", layers),
        bwd=_per_layer(plan, "backward", layers),
        fallbacks=plan["fallbacks"],
        replicated_matrices=len(replicated),
    )
    if generate:
        row["generation"] = _agreed(r["generation"] for r in results)
    return row


def _worst(results) -> tuple:
    """(largest error, largest value compared) of loss, logits and gradients over the ranks."""
    worst = {k: max(r["errors"][k] for r in results) for k in ("loss", "logits", "grad")}
    return worst, {k: max(r["scales"][k] for r in results) for k in worst}


def _agreed(answers) -> str:
    """Every rank's answer, where they agree; rank 0's error where all failed (their messages may name
    Dynamo's symbols in another order); else what each said."""
    answers = list(answers)
    if len(set(answers)) == 1 or all(a.startswith("error:") for a in answers):
        return answers[0]
    return "ranks differ: " + " / ".join(sorted(set(answers)))


# what fxparallel's refusals of generate say (their messages are cut at 300 characters in the rows)
REFUSALS = ("not supported for this model", "generation graphs do not carry", "cannot fill a static cache",
            "takes no KV cache", "no static cache layer")


def _generation_cell(row: dict) -> str:
    gen = row.get("generation")
    if gen is None:
        return ""
    if gen == "differs" and row.get("generation_float64", "").startswith("same"):
        return "same in float64"  # float32 rounding decided a near tie of the logits
    if gen.startswith("error:") and any(text in gen for text in REFUSALS):
        return "refused"  # generate refused by name before any step
    return gen if gen in ("same", "differs") or gen.startswith("same") else gen.split(":")[0]


def write_markdown(rows: list, path: str, tp: int, total: int = 0, layers=None, tp4=None) -> None:
    """The table of ``rows``; ``tp4``: rows of a TP=4 sweep (type -> row), shown as a column."""
    import torch
    import transformers

    ok = [r for r in rows if r["status"] == "ok"]
    theirs = [r for r in rows if r["status"] == "transformers"]
    ok4 = [r for r in (tp4 or {}).values() if r["status"] == "ok"]
    lines = [
        "# Coverage: causal-LM types of the installed transformers",
        "",
        f"Generated by `python benchmarks/coverage.py --tp {tp}{f' --layers {layers}' if layers else ''}` on "
        f"{platform.processor() or platform.machine()}, "
        f"{os.cpu_count()} cores, torch {torch.__version__}, transformers {transformers.__version__}, "
        f"{time.strftime('%Y-%m-%d')}.",
        "",
        f"Each type: a tiny random config ({layers or 2} layers, hidden 64, 8 heads / 4 kv heads), TP={tp} over gloo "
        "vs the "
        "single-device model: loss, logits and every parameter gradient; passes when each is within 1e-5, "
        "relative to its largest value where that exceeds 1 (fp32 rounding grows with the values: Gemma 4's "
        "gradients reach 1.6 and differ by 1.5e-5). \"max error\" is absolute. A type outside that is checked "
        "again in float64, where rounding shrinks a billionfold and a wrong plan does not: within 1e-6 there "
        "(transformers' loss casts the logits to float32, so the reference keeps float32 rounding), it counts as "
        "ok and \"why\" gives both. Where a model's own code casts to float32 whatever its dtype ("
        + ", ".join(sorted(FLOAT64_AS_IS)) + "'s norms and logits), that code keeps float64 in this check, in the "
        "reference and the parallel model alike (`FLOAT64_AS_IS` in the script).",
        "",
        f"\"generate\": the greedy tokens of `model.generate` ({GENERATED} new tokens, a batch of 2 prompts, one "
        "left-padded) against single-device transformers' `generate`: same (with the sharded cache), same, no "
        "cache (a cache the graphs cannot carry, or none at all: each step recomputes the sequence), same as "
        "use_cache=False (recomputed, equal to transformers' `generate(use_cache=False)` where its own cached "
        "generate gives other tokens), differs (wrong), refused (ours refuses the model by name before any step), "
        "error (ours fails otherwise; both listed below the table) or transformers (transformers' own `generate` "
        "fails on the tiny model). "
        "Where float32's tokens differ, they are generated again in float64 (\"same in float64\": float32 "
        "rounding decided a near tie of the logits). "
        f"{sum(_generation_cell(r).startswith('same') for r in rows)} types generate transformers' tokens: "
        f"{sum(_generation_cell(r) == 'same' for r in rows)} with the sharded cache, "
        f"{sum(_generation_cell(r) == 'same, no cache' for r in rows)} without a cache, "
        f"{sum(_generation_cell(r) == 'same as use_cache=False' for r in rows)} as transformers' "
        "`generate(use_cache=False)`, "
        f"{sum(_generation_cell(r) == 'same in float64' for r in rows)} the same in float64, "
        f"{sum(_generation_cell(r) == 'differs' for r in rows) or 'none'} differ; "
        f"{sum(_generation_cell(r) == 'refused' for r in rows)} are refused, "
        f"{sum(_generation_cell(r) == 'error' for r in rows)} fail otherwise.",
        "",
        *(["\"TP=4\": the same check over 4 gloo ranks (`--tp 4 --no-generate`: no generation, which doubles the "
           "time per type; heads, kv heads and vocabulary then split 4 ways, kv heads 1 per rank). \"not run\": "
           "types that fail at TP=2 for a reason the rank count does not change (transformers' own failures, "
           "data-dependent control flow in the model's code). Types swept at TP=4 with generation too (`--tp 4` "
           "without `--no-generate`) show its result after the status: "
           f"{sum(_generation_cell(r).startswith('same') for r in tp4.values())} of "
           f"{sum(bool(_generation_cell(r)) for r in tp4.values())} generate transformers' tokens at TP=4.", ""]
          if tp4 else []),
        f"**{len(ok)} of {len(rows)} types checked pass at TP={tp}**"
        + (f", **{len(ok4)} of {len(tp4)} at TP=4**" if tp4 else "")
        + f"; {sum(r['status'] == 'wrong' for r in rows) or 'none'} wrong"
        + (f" at TP={tp}, {sum(r['status'] == 'wrong' for r in tp4.values()) or 'none'} at TP=4" if tp4 else "")
        + (f" ({total - len(rows)} of the {total} registered types not run yet)" if total > len(rows) else "")
        + (f"; transformers' own model fails on {len(theirs)} of them (result \"transformers\", with its error: "
           "not a limit of fxparallel, nothing to compare with)" if theirs else "")
        + ". Collectives are all-reduce/all-gather calls per step: per decoder layer + outside the layers "
        "(a norm over a sharded projection, e.g. OLMo-2's q/k norm, adds one 4-byte all-reduce per token each "
        "way; `fxparallel plan` prints the bytes of each).",
        "",
        "| type | result" + (" | TP=4" if tp4 else "") + " | max error | fwd collectives | bwd collectives | replicated matrices | fallbacks | "
        "transformers tp plan | generate | why not |",
        "| --- " * (11 if tp4 else 10) + "|",
    ]
    for r in rows:
        err = f"{r['max_error']:.1e}" if "max_error" in r else ""
        why = r.get("why", "")
        f64 = r.get("float64_errors")
        f64 = ", ".join(f"{k} {v:.1e}" for k, v in f64.items()) if isinstance(f64, dict) else f64
        if r["status"] == "wrong":
            why = "numbers differ from single device: " + ", ".join(f"{k} {v:.1e}" for k, v in r["errors"].items())
            why += f"; in float64: {f64}" if f64 else ""
        elif f64:
            why = f"float32 rounding: float32 errors above 1e-5, in float64 {f64}"
        why = why.replace("|", "/")
        fallbacks = len(r.get("fallbacks", []))
        row4 = (tp4 or {}).get(r["type"], {})
        gen4 = _generation_cell(row4)
        col4 = f" {row4.get('status', 'not run')}{', generate ' + gen4 if gen4 else ''} |" if tp4 else ""
        lines.append(f"| {r['type']} | {r['status']} |{col4} {err} | {r.get('fwd', '')} | {r.get('bwd', '')} | "
                     f"{r.get('replicated_matrices', '')} | {fallbacks if 'fallbacks' in r else ''} | "
                     f"{'yes' if r.get('hf_plan') else 'no'} | {_generation_cell(r)} | {why} |")
    failed = [r for r in rows if _generation_cell(r) and not _generation_cell(r).startswith("same")]
    if failed:
        lines += ["", "Where `generate` is not \"same\":", ""]
        lines += [f"- {r['type']}: {r['generation']}".replace("|", "/") for r in failed]
    failed4 = [r for r in (tp4 or {}).values() if r["status"] not in ("ok", "transformers")]
    if failed4:
        lines += ["", "Where TP=4 is not ok:", ""]
        lines += [f"- {r['type']}: {r['status']}: {r.get('why', '')}".replace("|", "/").replace("\n", " ")
                  for r in sorted(failed4, key=lambda r: r["type"])]
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")


def main(argv=None):
    from tiny_configs import causal_lm_types

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("types", nargs="*")
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--out", default=os.path.join(HERE, "..", "docs", "coverage.md"))
    parser.add_argument("--json", default=None, help="also write the rows as JSON")
    parser.add_argument("--merge", default=None, help="rows of an earlier run (JSON): rerun only the given "
                        "types and write the table of all of them")
    parser.add_argument("--render", default=None, help="only write the table of the rows in this JSON file")
    parser.add_argument("--no-generate", dest="generate", action="store_false",
                        help="skip the greedy generation check (the TP=4 column: it doubles the time per type)")
    parser.add_argument("--tp4", default=None, help="rows of a TP=4 sweep (JSON), shown as a column")
    parser.add_argument("--layers", type=int, default=None, help="decoder layers of each tiny model (default: "
                        "the tiny config's, mostly 2; 5 or more exercises capture/repeat_layers.py)")
    parser.add_argument("--timeout", type=int, default=TIMEOUT, help="seconds per type before its row is an error")
    args = parser.parse_args(argv)
    tp4 = None
    if args.tp4:
        with open(args.tp4) as f:
            tp4 = {r["type"]: r for r in json.load(f)}
    if args.render:
        with open(args.render) as f:
            rows = json.load(f)
        write_markdown(rows, args.out, args.tp, total=len(causal_lm_types()), layers=args.layers, tp4=tp4)
        return rows
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    types = args.types or causal_lm_types()
    earlier = []
    if args.merge:
        with open(args.merge) as f:
            earlier = [r for r in json.load(f) if r["type"] not in types]
    rows = []
    for t in types:
        start = time.time()
        row = check_type(t, args.tp, args.layers, args.generate, args.timeout)
        rows.append(row)
        print(f"{t:28s} {row['status']:6s} {time.time() - start:5.1f}s {row.get('max_error', '')} "
              f"{row.get('why', '')[:160]}", flush=True)
        # rewrite after every type, so an interrupted sweep still leaves its rows
        every = sorted(earlier + rows, key=lambda r: r["type"])
        if not args.types or args.merge or args.out != os.path.join(HERE, "..", "docs", "coverage.md"):
            write_markdown(every, args.out, args.tp, total=len(earlier) + len(types), layers=args.layers, tp4=tp4)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(every, f, indent=1)
    return rows


if __name__ == "__main__":
    main()
