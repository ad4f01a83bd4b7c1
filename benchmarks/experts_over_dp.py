"""Experts over data-parallel ranks (ep=dp) against FSDP alone over the same ranks, interleaved step by step in
the same processes, and the load each expert and each ep rank takes.

    python benchmarks/experts_over_dp.py [--dp 2] [--experts 16] [--hidden 256] [--expert-width 128] [--steps 7]

A Qwen3-MoE of random weights (top-2 of ``--experts`` experts per layer, 2 layers, vocabulary 4096), transformers'
grouped_mm experts kernel in both (run on CPU as tests/test_moe.py runs it), trained with
``fxparallel.runtime.train_step`` at tp=1 over dp ranks: with ``ep_group`` (each rank a run of the experts, rows
exchanged by all-to-all; ``fxparallel/ops/expert_exchange.py``) and without (FSDP2 shards and all-gathers the
experts as any weight). Reports the median step of each (slowest rank) and their ratio, the seconds of the
forward's row exchanges within the ep step, the bytes they send against the expert bytes FSDP gathers, and, from
``output_tokens_per_expert``, each layer's tokens per expert (max / mean) and the rows each ep rank computes; the
load average; writes benchmarks/results/experts_over_dp.json."""
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
    import fxparallel.api as api
    from fxparallel.ops import expert_exchange
    from fxparallel.runtime import StepBatches, apply_data_parallel, init_mesh, pack_tokens, synthetic_token_stream
    from fxparallel.runtime import train_step

    torch.set_num_threads(1)
    api._for_device = lambda config, device: config  # grouped_mm in both (the ep one keeps it anyway)
    exchange_seconds = [0.0]
    plain_exchange = expert_exchange._exchange

    def timed_exchange(*a, **k):
        t = time.perf_counter()
        out = plain_exchange(*a, **k)
        exchange_seconds[0] += time.perf_counter() - t
        return out

    expert_exchange._exchange = timed_exchange
    rows = pack_tokens(synthetic_token_stream(4096, 64 * args.tokens, seed=1), args.tokens)
    runs = {}
    for name, ep in (("ep", world), ("fsdp", 1)):
        mesh = init_mesh(tp=1, dp=world, ep=ep)
        model = apply_data_parallel(fxparallel.parallelize(path, mesh.tp_mesh, dtype=torch.float32,
                                                           ep_group=mesh.ep_mesh), mesh)
        runs[name] = (mesh, model, torch.optim.AdamW(model.parameters(), lr=1e-4))
    data = StepBatches(rows, args.batch * world, runs["ep"][0].dp_rank, world)
    times = {name: [] for name in runs}
    exchanged = []
    for step in range(2 * args.steps + 2):
        name = list(runs)[step % 2]
        mesh, model, opt = runs[name]
        exchange_seconds[0] = 0.0
        dist.barrier()
        t = time.perf_counter()
        train_step(model, opt, data.batch(step // 2), mesh, max_norm=1.0)
        if step >= 2:  # (the first of each: warm-up)
            times[name].append(time.perf_counter() - t)
            if name == "ep":
                exchanged.append(exchange_seconds[0])
    mesh, model, _ = runs["ep"]
    handle = model.ep_group.handle
    expert_exchange.bytes_sent[handle] = 0
    with torch.no_grad():
        counts = model(input_ids=data.batch(0)["input_ids"], output_tokens_per_expert=True).tokens_per_expert
    forward_bytes = expert_exchange.bytes_sent[handle]
    everyone = [None] * world
    dist.all_gather_object(everyone, counts.tolist())
    experts = sum(p.numel() * p.element_size() for p in model.parameters() if getattr(p, "_fxparallel_expert_run", 0))
    return {"times": times, "exchange": exchanged, "counts": everyone, "forward bytes sent": forward_bytes,
            "expert bytes per rank": experts}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--dp", type=int, default=2)
    parser.add_argument("--experts", type=int, default=16)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--expert-width", type=int, default=128)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--batch", type=int, default=4, help="rows per dp rank")
    parser.add_argument("--steps", type=int, default=7)
    args = parser.parse_args()
    from distributed import run_ranks
    from fxparallel.ops.expert_exchange import expert_runs
    from models import save_checkpoint
    from tiny_configs import tiny_config

    load = os.getloadavg()
    with tempfile.TemporaryDirectory() as tmp:
        config = tiny_config("qwen3_moe", vocab_size=4096, hidden_size=args.hidden, num_experts=args.experts,
                             num_experts_per_tok=2, moe_intermediate_size=args.expert_width, num_hidden_layers=2,
                             num_attention_heads=8, num_key_value_heads=8, head_dim=args.hidden // 8)
        path = save_checkpoint(config, os.path.join(tmp, "model"))
        results = run_ranks(args.dp, _run, path, args, timeout=1800)
    medians = {name: statistics.median(max(r["times"][name][i] for r in results) for i in range(args.steps))
               for name in results[0]["times"]}
    counts = results[0]["counts"]  # [rank][layer][expert]: this rank's tokens routed to each expert
    total = [[sum(rank[layer][e] for rank in counts) for e in range(args.experts)] for layer in range(2)]
    per_rank = [[sum(total[layer][first:first + n]) for first, n in expert_runs(args.experts, args.dp)]
                for layer in range(2)]
    expert_bytes = results[0]["expert bytes per rank"] * args.dp
    out = {"args": vars(args), "load average before": load, "load average after": os.getloadavg(),
           "median step (s), slowest rank": medians, "ratio ep / fsdp": medians["ep"] / medians["fsdp"],
           "forward row exchanges (s), median, slowest rank":
               statistics.median(max(r["exchange"][i] for r in results) for i in range(args.steps)),
           "bytes the forward's exchanges send, all ranks": sum(r["forward bytes sent"] for r in results),
           "expert bytes FSDP all-gathers per rank and gather": expert_bytes * (args.dp - 1) // args.dp,
           "tokens per expert, per layer (all ranks)": total,
           "max / mean tokens per expert, per layer": [max(t) / (sum(t) / len(t)) for t in total],
           "rows each ep rank computes, per layer": per_rank}
    print(json.dumps(out, indent=1))
    with open(os.path.join(HERE, "results", "experts_over_dp.json"), "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
