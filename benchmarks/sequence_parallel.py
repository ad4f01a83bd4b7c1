"""Sequence parallelism vs plain TP: activation memory of a training forward, and step time.

Activation memory is measured exactly on any device: the bytes of the tensors autograd
saves for backward during one forward with labels (``torch.autograd.graph.saved_tensors_hooks``),
counting each storage once and leaving out the parameters. Step time is forward + backward
(median of repeated runs, both systems alternating in the same processes; wall time and
the process's CPU time, the latter less disturbed by other jobs on a shared machine). Communication
is read from the plans (bytes each rank sends per token, ring algorithms).

    python benchmarks/sequence_parallel.py                 # TP 2 and 4, Llama-style, CPU / gloo
    python benchmarks/sequence_parallel.py --tp 2 --seq 1024 --repeats 9
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))


def llama_config(layers: int, hidden: int):
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=512, hidden_size=hidden, intermediate_size=hidden * 11 // 4, num_hidden_layers=layers,
                       num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=4096)


def saved_activation_bytes(model, ids) -> int:
    """Bytes of the distinct non-parameter storages autograd keeps for backward in one forward."""
    import torch

    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    storages = {}

    def pack(t):
        s = t.untyped_storage()
        if s.data_ptr() not in params:
            storages[s.data_ptr()] = s.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    return sum(storages.values())


def step_seconds(model, ids) -> tuple:
    """(wall seconds of forward + backward, this process's CPU seconds in it)."""
    import torch.distributed as dist

    dist.barrier()
    t, c = time.perf_counter(), time.process_time()
    model(input_ids=ids, labels=ids).loss.backward()
    cpu = time.process_time() - c
    dist.barrier()
    return time.perf_counter() - t, cpu


def _rank(rank, tp, args):
    import torch
    import torch.distributed as dist

    import fxparallel

    config = llama_config(args.layers, args.hidden)
    models = {mode: fxparallel.parallelize(config, dist.group.WORLD, dtype=torch.float32,
                                           sequence_parallel=(mode == "TP+SP"))
              for mode in ("TP", "TP+SP")}
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, config.vocab_size, (args.batch, args.seq), generator=g)
    out = {}
    for mode, model in models.items():
        model.zero_grad(set_to_none=True)
        out[mode] = {"activations": saved_activation_bytes(model, ids), "times": [], "cpu": [],
                     "wire": model.plan.wire_bytes_per_token(), "loss": model(input_ids=ids, labels=ids).loss.item()}
        step_seconds(model, ids)  # warm-up
    for _ in range(args.repeats):
        for mode, model in models.items():
            model.zero_grad(set_to_none=True)
            wall, cpu = step_seconds(model, ids)
            out[mode]["times"].append(wall)
            out[mode]["cpu"].append(cpu)
    return out


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tp", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    from distributed import run_ranks

    rows = []
    for tp in args.tp:
        per_rank = run_ranks(tp, _rank, args, timeout=3600)
        base = per_rank[0]["TP"]
        def median(mode, key):  # of the slowest rank per repeat
            return statistics.median(max(x[mode][key][i] for x in per_rank) for i in range(args.repeats))

        for mode in ("TP", "TP+SP"):
            r = per_rank[0][mode]
            t, c = median(mode, "times"), median(mode, "cpu")
            rows.append((tp, mode, r["activations"] / 2**20, r["activations"] / base["activations"], t * 1e3,
                         t / median("TP", "times"), c * 1e3, c / median("TP", "cpu"), r["wire"],
                         abs(r["loss"] - base["loss"])))
    print(f"Llama-style, {args.layers} layers, hidden {args.hidden}, batch {args.batch} x seq {args.seq}, fp32, "
          f"{args.repeats} repeats (median; step = forward + backward, slowest rank)")
    print("| tp | mode | saved activations (MiB/rank) | ratio | step wall (ms) | ratio | step CPU (ms) | ratio "
          "| sent (B/token/rank) | loss diff |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for tp, mode, mib, mr, ms, tr, cms, cr, wire, diff in rows:
        print(f"| {tp} | {mode} | {mib:.1f} | {mr:.2f} | {ms:.0f} | {tr:.2f} | {cms:.0f} | {cr:.2f} | {wire:.0f} "
              f"| {diff:.1e} |")


if __name__ == "__main__":
    main()
