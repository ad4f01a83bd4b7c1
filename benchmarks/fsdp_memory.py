"""Peak unsharded parameter memory per rank in one training step: root-only FSDP vs per-layer units.

    python benchmarks/fsdp_memory.py [--layers 8] [--dp 2] [--tp 1] [--repeats 5]

What is counted: FSDP2 all-gathers a unit's sharded parameters into full (unsharded) ones
(also ahead of time: backward prefetch) and frees them when it reshards. The benchmark
follows every such transition of every unit's parameter group, from the all-gather to the
reshard, and keeps the largest total of unsharded parameter bytes alive at once during a
training step (forward, backward, optimizer step):
the memory FSDP needs on top of the sharded state. This is exact and deterministic, unlike
RSS on CPU (allocator caching, other processes). Reported per rank, the median over
``--repeats`` steps (identical here; the median guards against a first-step outlier), with
the resident sharded parameter bytes for scale.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, "..", "tests"))

MiB = 2**20


class UnshardedBytes:
    """Tracks the bytes of unsharded FSDP parameters alive at once (patches FSDPParamGroup)."""

    def __init__(self):
        from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup

        self.cls = FSDPParamGroup
        self.alive = {}  # param group -> bytes while unsharded
        self.peak = 0
        self.originals = {n: getattr(FSDPParamGroup, n) for n in ("unshard", "_to_unsharded", "_to_sharded",
                                                                   "_to_sharded_post_forward")}

    @staticmethod
    def _bytes(group) -> int:
        return sum(p._orig_size.numel() * (p.param_dtype or p.orig_dtype).itemsize for p in group.fsdp_params)

    def __enter__(self):
        tracker, originals = self, self.originals

        def alive(group):
            tracker.alive[group] = tracker._bytes(group)
            tracker.peak = max(tracker.peak, sum(tracker.alive.values()))

        def unshard(group, *args, **kwargs):  # the all-gather output exists from here (prefetches too)
            originals["unshard"](group, *args, **kwargs)
            if group._all_gather_result is not None:
                alive(group)

        def to_unsharded(group):
            originals["_to_unsharded"](group)
            alive(group)

        def to_sharded(name):
            def patched(group):
                originals[name](group)
                tracker.alive.pop(group, None)
            return patched

        self.cls.unshard = unshard
        self.cls._to_unsharded = to_unsharded
        self.cls._to_sharded = to_sharded("_to_sharded")
        self.cls._to_sharded_post_forward = to_sharded("_to_sharded_post_forward")
        return self

    def reset(self):
        self.peak = sum(self.alive.values())

    def __exit__(self, *exc):
        for name, fn in self.originals.items():
            setattr(self.cls, name, fn)


def _rank(rank, world, path, tp, dp, repeats):
    import torch

    import fxparallel
    from fxparallel.runtime import (
        StepBatches,
        apply_data_parallel,
        init_mesh,
        pack_tokens,
        synthetic_token_stream,
        train_step,
    )

    mesh = init_mesh(tp=tp, dp=dp, cp=1)
    rows = pack_tokens(synthetic_token_stream(4096, 64 * 128, seed=0), 128)
    data = StepBatches(rows, 4 * dp, mesh.dp_rank, mesh.dp)
    out = {}
    for per_layer in (False, True):
        model = fxparallel.parallelize(path, mesh.tp_mesh, dtype=torch.float32)
        model = apply_data_parallel(model, mesh, per_layer=per_layer)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        sharded = sum(p.to_local().numel() * p.element_size() for p in model.parameters())
        peaks = []
        with UnshardedBytes() as tracker:
            for step in range(repeats):
                tracker.reset()
                train_step(model, opt, data.batch(step), mesh)
                peaks.append(tracker.peak)
        out["layers" if per_layer else "root"] = {"units": model._fxparallel_data_parallel.units,
                                                  "peak": statistics.median(peaks), "sharded": sharded}
    return out


def main(argv=None):
    from checkpoints import build_checkpoint
    from distributed import run_ranks

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--dp", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        path = build_checkpoint("llama", os.path.join(tmp, "llama"), layers=args.layers)
        results = run_ranks(args.tp * args.dp, _rank, path, args.tp, args.dp, args.repeats, timeout=1800)
    print(f"llama hidden 256, {args.layers} layers, vocab 4096, fp32; tp={args.tp} dp={args.dp}; "
          f"median of {args.repeats} training steps")
    print(f"{'rank':>4} {'wrapping':>10} {'units':>5} {'sharded MiB':>11} {'peak unsharded MiB':>18}")
    for rank, r in enumerate(results):
        for key in ("root", "layers"):
            row = r[key]
            print(f"{rank:>4} {key:>10} {row['units']:>5} {row['sharded'] / MiB:>11.2f} {row['peak'] / MiB:>18.2f}")
    r = results[0]
    print(f"per-layer / root-only peak unsharded bytes: {r['layers']['peak'] / r['root']['peak']:.3f}")
    return results


if __name__ == "__main__":
    main()
