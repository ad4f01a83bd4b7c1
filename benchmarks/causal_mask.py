"""What causal attention without a mask tensor buys a training step (fxparallel/capture/causal_mask.py).

Two fxparallel models of one checkpoint in the same processes: as it captures now (a forward without
a mask, or with one that holds no padding, gives sdpa ``is_causal=True``), and captured with
transformers' explicit seq x seq mask (what torch 2.13's Dynamo makes transformers build: the
module's patch left out). Per sequence length: bytes autograd saves for the backward pass (unique
storages seen by a saved-tensor hook, per rank), forward + backward time (steps alternating between
the two, median of the slowest rank), and the loss of each (the same up to rounding).

    OMP_NUM_THREADS=1 torchrun --nproc_per_node=1 benchmarks/causal_mask.py   # TP=1; --nproc_per_node=2: TP=2
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)

from checkpoints import build_checkpoint  # noqa: E402
from ranks import everyone, start  # noqa: E402

SHAPE = dict(hidden=256, layers=8, heads=8, kv_heads=4, intermediate=1024, vocab=2048, positions=4096)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="local checkpoint directory (default: an 8-layer Llama built here)")
    p.add_argument("--checkpoint-dir", default=os.path.join(ROOT, "checkpoints", "bench-llama-mask8"))
    p.add_argument("--seqs", default="512,1024,2048")
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--out", default=None, help="JSON (default benchmarks/results/causal_mask_tp{N}.json)")
    return p.parse_args(argv)


def _models(path, world_group):
    """{"no mask": the model as fxparallel captures it, "mask": captured with transformers' explicit mask}."""
    import fxparallel
    from fxparallel.capture import dynamo

    models = {"no mask": fxparallel.parallelize(path, world_group)}
    kept = dynamo.causal_without_mask
    dynamo.causal_without_mask = lambda *args, **kwargs: contextlib.nullcontext()
    try:
        models["mask"] = fxparallel.parallelize(path, world_group)
    finally:
        dynamo.causal_without_mask = kept
    for model in models.values():
        model.train()
    return models


def _saved_mib(model, ids) -> tuple:
    """(MiB autograd saves for the backward pass, loss) of one training step."""
    import torch

    storages = {}

    def pack(t):
        s = t.untyped_storage()
        storages[s.data_ptr()] = s.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    return sum(storages.values()) / 2**20, loss.item()


def main(argv=None):
    import torch
    import torch.distributed as dist

    args = parse_args(argv)
    os.environ["FXPARALLEL_GRAPH_CACHE"] = "off"  # both models are captured, not read back under one key
    rank, world, path = start(args.model, args.checkpoint_dir,
                              lambda d: build_checkpoint("llama", d, overrides=dict(use_cache=False), **SHAPE))
    load_start = os.getloadavg()[0]
    models = _models(path, dist.group.WORLD)
    vocab = models["mask"].config.vocab_size  # (--model: any checkpoint's)
    rows = []
    for seq in (int(s) for s in args.seqs.split(",")):
        ids = torch.randint(0, vocab, (args.batch, seq), generator=torch.Generator().manual_seed(seq))
        saved = {name: _saved_mib(m, ids) for name, m in models.items()}
        times = {name: [] for name in models}
        for _ in range(args.repeats):
            for name, m in models.items():
                m.zero_grad(set_to_none=True)
                t = time.perf_counter()
                m(input_ids=ids, labels=ids).loss.backward()
                times[name].append(max(everyone(time.perf_counter() - t)))
        step = {name: statistics.median(v) * 1e3 for name, v in times.items()}
        mib = {name: max(everyone(saved[name][0])) for name in models}
        rows.append(dict(seq=seq, saved_mib=mib, step_ms=step, loss={k: v[1] for k, v in saved.items()},
                         load=os.getloadavg()[0]))
        if rank == 0:
            print(f"seq {seq}: saved MiB/rank mask {mib['mask']:.1f}, no mask {mib['no mask']:.1f} "
                  f"({mib['no mask'] / mib['mask']:.2f}x); fwd+bwd ms mask {step['mask']:.0f}, no mask "
                  f"{step['no mask']:.0f} ({step['no mask'] / step['mask']:.2f}x); loss difference "
                  f"{abs(saved['mask'][1] - saved['no mask'][1]):.1e}; load {rows[-1]['load']:.1f}", flush=True)
    if rank == 0:
        out = args.out or os.path.join(HERE, "results", f"causal_mask_tp{world}.json")
        meta = dict(shape=SHAPE, batch=args.batch, tp=world, repeats=args.repeats, torch=torch.__version__,
                    date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), load_start=load_start,
                    threads=torch.get_num_threads())
        with open(out, "w") as f:
            json.dump(dict(meta=meta, rows=rows), f, indent=1)
        print(f"wrote {out}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
