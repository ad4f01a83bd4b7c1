"""What running a prompt token by token costs, against the prompt graph of its own length, on the models whose code
fixes the length of a forward with a cache (docs/generation.md, "Prompts whose code fixes their length").

    OMP_NUM_THREADS=1 python benchmarks/prompt_by_token.py [--models mamba jamba] [--lengths 32 128] [--repeats 9]

One process, a gloo group of one rank (TP=1: the question is the number of forwards, not their collectives), each
model a tiny random-init checkpoint of ``tiny_configs.py``, float32, a batch of 2 prompts (the first padded on the
left by 2 tokens), the graph cache off (first calls include their captures). For each model and prompt length, on a fresh ``parallelize``: the length's ``generate(max_new_tokens=1)``
captures its prompt graph ("own graph, first call"), then --repeats timed calls give its median; a prompt 3 tokens
longer makes the model run prompts token by token from then on (its first call: "by token, first call", the one-token
graphs captured once); then the length is timed again token by token (median of --repeats). The tokens of the two
ways are checked equal. Prints a table and writes JSON to --out (default
benchmarks/results/prompt_by_token.json).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "tests"))


def _prompts(length: int):
    ids = torch.randint(3, 200, (2, length), generator=torch.Generator().manual_seed(length))
    mask = torch.ones_like(ids)
    mask[0, :2] = 0
    return ids * mask, mask


def _timed(model, length: int) -> tuple:
    ids, mask = _prompts(length)
    start = time.perf_counter()
    out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=1, do_sample=False, pad_token_id=0)
    return time.perf_counter() - start, out


def measure(name: str, length: int, repeats: int) -> dict:
    import fxparallel
    from models import save_checkpoint
    from tiny_configs import tiny_config

    path = save_checkpoint(tiny_config(name), os.path.join(tempfile.mkdtemp(), name))
    model = fxparallel.parallelize(path, dist.group.WORLD, dtype=torch.float32)
    first, own_tokens = _timed(model, length)
    own = statistics.median(_timed(model, length)[0] for _ in range(repeats))
    by_token_first = _timed(model, length + 3)[0]  # a length of no graph: prompts go token by token from here on
    if not model._graph_set.prompt_by_token:
        raise SystemExit(f"{name}: a prompt of {length + 3} tokens after {length} did not go token by token")
    by_token = statistics.median(_timed(model, length)[0] for _ in range(repeats))
    return {"model": name, "prompt tokens": length, "own graph, first call (s)": round(first, 2),
            "own graph (ms)": round(own * 1e3, 1), "by token, first call (s)": round(by_token_first, 2),
            "by token (ms)": round(by_token * 1e3, 1), "ratio": round(by_token / own, 2),
            "same tokens": torch.equal(_timed(model, length)[1], own_tokens)}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["mamba", "jamba"])
    parser.add_argument("--lengths", nargs="+", type=int, default=[32, 128])
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--out", default=os.path.join(HERE, "results", "prompt_by_token.json"))
    args = parser.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("FXPARALLEL_GRAPH_CACHE", "off")  # a first call's time includes its captures
    dist.init_process_group("gloo", init_method="tcp://127.0.0.1:29533", rank=0, world_size=1)
    rows = []
    for name in args.models:
        for length in args.lengths:  # a fresh model each: its first length gets a prompt graph of its own
            rows.append(measure(name, length, args.repeats))
            print(json.dumps(rows[-1]), flush=True)
    result = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "threads": torch.get_num_threads(),
              "load average": os.getloadavg(), "rows": rows}
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
