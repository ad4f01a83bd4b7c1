"""The data-parallel gradient average under Trainer's path (world = dp x tp): bucketed and overlapped with the
backward, against one bucket started at the backward's end, interleaved step by step in the same processes.

    python benchmarks/dp_overlap.py [--dp 2] [--hidden 512] [--layers 4] [--tokens 256] [--batch 4] [--steps 9]

A Llama of random weights (vocabulary 8192) parallelized at tp=1 over the tp sub-mesh of a (dp, tp) mesh, its
parameters the DTensor views Trainer trains (``model.tp_size`` read), so each backward averages the gradients over
dp (``fxparallel/trainer_data_parallel.py``). Each step: forward and backward of ``batch`` x ``tokens`` (the average
waited for at the backward's end), timed after a barrier; the layouts alternate, so the machine's drift falls on
both. Reports the median step of each (of the slowest rank) and their ratio, the time of one all-reduce of every
gradient alone (the most the overlap can hide), and the load average; writes benchmarks/results/dp_overlap.json."""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, "..", "tests"))


def _run(rank, world, path, args):
    import time

    import torch
    import torch.distributed as dist

    import fxparallel
    from fxparallel.dtensor_parameters import use_dtensor_parameters
    from fxparallel.runtime import init_mesh

    torch.set_num_threads(1)
    mesh = init_mesh(tp=1, dp=world)
    model = fxparallel.parallelize(path, mesh.tp_mesh, dtype=torch.float32)
    use_dtensor_parameters(model)  # the DTensor views and the dp average, as Trainer's read of tp_size starts them
    dp = model.__dict__["_dtensor_data_parallel"]
    layouts = {"bucketed": dp.buckets, "one bucket at the end": [list(reversed(dp.views))]}
    ids = torch.randint(0, 8192, (args.batch, args.tokens), generator=torch.Generator().manual_seed(rank))
    times = {name: [] for name in layouts}
    for step in range(2 * args.steps + 2):
        name = list(layouts)[step % 2]
        dp.buckets = layouts[name]
        dp.bucket_of = {id(v): i for i, bucket in enumerate(dp.buckets) for v in bucket}
        dp._start()
        for p in model.parameters():
            p.grad = None
        dist.barrier()
        t = time.perf_counter()
        model(input_ids=ids, labels=ids).loss.backward()
        if step >= 2:  # (the first of each: warm-up)
            times[name].append(time.perf_counter() - t)
    flat = torch.cat([v._local_tensor.reshape(-1) for v in dp.views])  # the average alone, for scale
    alone = []
    for _ in range(5):
        dist.barrier()
        t = time.perf_counter()
        dist.all_reduce(flat)
        alone.append(time.perf_counter() - t)
    return {"buckets": len(layouts["bucketed"]), "times": times, "all-reduce alone": statistics.median(alone),
            "gradient MiB": sum(v._local_tensor.numel() * 4 for v in dp.views) / 2**20}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--dp", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--steps", type=int, default=9)
    args = parser.parse_args()
    from distributed import run_ranks
    from models import save_checkpoint, tiny_config

    load = os.getloadavg()
    with tempfile.TemporaryDirectory() as tmp:
        config = tiny_config("llama", vocab_size=8192, hidden_size=args.hidden, intermediate_size=args.hidden * 11 // 4,
                             num_hidden_layers=args.layers, num_attention_heads=8, num_key_value_heads=8,
                             head_dim=args.hidden // 8)
        path = save_checkpoint(config, os.path.join(tmp, "model"))
        results = run_ranks(args.dp, _run, path, args, timeout=1800)
    medians = {name: statistics.median(max(r["times"][name][i] for r in results)
                                       for i in range(args.steps)) for name in results[0]["times"]}
    out = {"args": vars(args), "load average before": load, "load average after": os.getloadavg(),
           "buckets": results[0]["buckets"], "gradient MiB per rank": results[0]["gradient MiB"],
           "median step (s), slowest rank": medians,
           "all-reduce of every gradient alone (s), median": max(r["all-reduce alone"] for r in results),
           "ratio bucketed / one bucket": medians["bucketed"] / medians["one bucket at the end"]}
    print(json.dumps(out, indent=1))
    with open(os.path.join(HERE, "results", "dp_overlap.json"), "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
