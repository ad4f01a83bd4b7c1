"""Peak resident memory and bytes read per rank while loading a checkpoint: fxparallel.parallelize
next to transformers' tensor-parallel from_pretrained, on the same locally built Llama checkpoint.

    torchrun --nproc_per_node=2 benchmarks/load_memory.py --size-mb 300   # one TP size
    python benchmarks/load_memory.py --all --size-mb 300                  # TP = 1, 2, 4 in one run

Memory is Linux's VmHWM (peak RSS), reset through /proc/self/clear_refs before each system
loads, minus the RSS just before: "growth". Bytes read: fxparallel's own count, and the
process's `rchar` (/proc/self/io: bytes it got from read calls; reads through a memory map
do not show there, so for transformers, which maps the files, the touched file pages show in
RSS instead). Per rank, one line per system. fxparallel's load stage is also measured alone
(the rest of its growth is the capture of the meta model, a fixed overhead).

Speed: seconds of each system's load (to a model whose every weight was read once), fxparallel's load stage
alone, and the read speed of that stage (bytes read / its seconds) against the reference row, safetensors' own
``get_tensor`` of whole tensors copied into memory of their own and kept until a rank's share of the checkpoint
is held, on every rank at once, run after a first such read that puts the files in the page cache. Any
checkpoint folder works (``--checkpoint DIR``, built only where it is missing), e.g. benchmarks/generate.py's
1B-shaped one.
"""
from __future__ import annotations

import argparse
import ctypes
import gc
import json
import os
import subprocess
import sys
import time

MiB = 2**20


# ---- /proc readings -------------------------------------------------------------------
def status(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    return 0


def rchar() -> int:
    with open("/proc/self/io") as f:
        for line in f:
            if line.startswith("rchar:"):
                return int(line.split()[1])
    return 0


def reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def release_memory() -> None:
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except OSError:
        pass


class Peak:
    """Peak RSS growth and bytes read (rchar) inside a ``with`` block."""

    def __enter__(self):
        release_memory()
        reset_peak()
        self.base, self.read0, self.t0 = status("VmRSS"), rchar(), time.perf_counter()
        return self

    def now(self) -> int:
        return status("VmHWM") - self.base

    def __exit__(self, *exc):
        self.growth = status("VmHWM") - self.base
        self.read = rchar() - self.read0
        self.seconds = time.perf_counter() - self.t0


# ---- the checkpoint ------------------------------------------------------------------------
def llama_config(size_mb: float):
    """A Llama of about ``size_mb`` MB in fp32: hidden 1024, 16 heads (8 kv), vocab 16384, layers to fit."""
    from transformers import LlamaConfig

    hidden, inter, vocab = 1024, 2816, 16384
    per_layer = 4 * (hidden * hidden * 2 + 2 * hidden * hidden // 2 + 3 * hidden * inter + 2 * hidden)
    embeddings = 4 * 2 * vocab * hidden
    layers = max(1, round((size_mb * 1e6 - embeddings) / per_layer))
    return LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
                       num_attention_heads=16, num_key_value_heads=8, max_position_embeddings=256,
                       tie_word_embeddings=False)


def build_checkpoint(path: str, size_mb: float) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    done = os.path.join(path, ".complete")
    if os.path.exists(done) or os.path.exists(os.path.join(path, "config.json")):  # built here, or a given model
        return
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(llama_config(size_mb), dtype=torch.float32)
    model.save_pretrained(path, max_shard_size="100MB")
    open(done, "w").close()
    del model
    release_memory()


def checkpoint_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path) if f.endswith(".safetensors"))


# ---- the two systems -----------------------------------------------------------------------
def measure_fxparallel(path: str, dtype) -> dict:
    import torch.distributed as dist

    import fxparallel
    import fxparallel.api as api

    stage = {}
    original = api.load_from_files

    def measured_load(module, plan, files, rank, tp, **kw):
        with Peak() as p:
            n = original(module, plan, files, rank, tp, **kw)
        stage.update(load_growth=p.growth, load_rchar=p.read, load_seconds=p.seconds)
        return n

    api.load_from_files = measured_load
    try:
        with Peak() as p:
            model = fxparallel.parallelize(path, dist.group.WORLD, dtype=dtype)
            loaded = p.now()
            touch(model)
    finally:
        api.load_from_files = original
    tp, rank = model.tp_group.size, model.tp_group.rank
    pieces = [p_.local_shape(tp, rank) for p_ in model.plan.params]
    result = dict(system="fxparallel", loaded=loaded, growth=p.growth, rchar=p.read, bytes_read=model.bytes_read,
                  seconds=p.seconds,
                  shard=sum(q.numel() * q.element_size() for q in model.parameters()),
                  largest_piece=max(4 * _numel(s) for s in pieces), **stage)  # stored fp32
    del model
    release_memory()
    return result


def touch(model) -> None:
    """Read every weight once, as a first forward would: weights that are still views of a memory map
    (transformers keeps some) become resident only then."""
    import torch

    with torch.no_grad():
        for q in model.parameters():
            local = q.to_local() if hasattr(q, "to_local") else q
            float(local.sum())


def measure_plain_read(path: str, keep_bytes: int) -> dict:
    """The reference read speed: safetensors' own ``get_tensor`` of the checkpoint's tensors copied out of its
    memory map into memory of their own (``clone``) and kept, as a load keeps its shards, until ``keep_bytes``
    (a rank's share of the checkpoint) are held; on every rank at once, as the systems load."""
    from safetensors import safe_open

    kept = []
    read = 0
    with Peak() as p:
        for name in sorted(f for f in os.listdir(path) if f.endswith(".safetensors")):
            with safe_open(os.path.join(path, name), framework="pt") as f:
                for key in f.keys():
                    if read >= keep_bytes:
                        break
                    kept.append(f.get_tensor(key).clone())
                    read += kept[-1].numel() * kept[-1].element_size()
    del kept
    release_memory()
    return dict(system="safetensors get_tensor + clone (kept, a rank's share)", loaded=0, growth=p.growth,
                rchar=p.read, bytes_read=read, shard=read, seconds=p.seconds)


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def measure_transformers(path: str, tp: int, dtype) -> dict:
    from transformers import AutoModelForCausalLM

    try:
        from transformers import DistributedConfig

        kwargs = dict(distributed_config=DistributedConfig(tp_size=tp, tp_plan="auto"))
        label = "transformers DistributedConfig(tp_plan='auto')"
    except ImportError:
        kwargs, label = dict(tp_plan="auto"), "transformers tp_plan='auto'"
    try:
        with Peak() as p:
            model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, **kwargs)
            loaded = p.now()
            touch(model)
    except Exception as err:  # noqa: BLE001 - reported, not hidden
        return dict(system=label, error=f"{type(err).__name__}: {err}")
    shard = 0
    for q in model.parameters():
        local = q.to_local() if hasattr(q, "to_local") else q
        shard += local.numel() * local.element_size()
    result = dict(system=label, loaded=loaded, growth=p.growth, rchar=p.read, shard=shard, seconds=p.seconds)
    del model
    release_memory()
    return result


# ---- one TP size (under torchrun) -----------------------------------------------------------
def run_rank(args) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, tp = dist.get_rank(), dist.get_world_size()
    if rank == 0:
        build_checkpoint(args.checkpoint, args.size_mb)
    dist.barrier()
    size = checkpoint_bytes(args.checkpoint)
    imported = status("VmRSS")
    dtype = getattr(torch, args.dtype)
    measure_plain_read(args.checkpoint, size // tp)  # the files in the page cache before anyone is measured
    rows = [measure_plain_read(args.checkpoint, size // tp), measure_fxparallel(args.checkpoint, dtype),
            measure_transformers(args.checkpoint, tp, dtype)]
    for row in rows:
        row.update(rank=rank, tp=tp, checkpoint=size, rss_before=imported, dtype=args.dtype)
    everyone = [None] * tp
    dist.all_gather_object(everyone, rows)
    if rank == 0:
        print(json.dumps([r for rows_ in everyone for r in rows_]), flush=True)
        if args.json:
            with open(args.json, "a") as f:
                f.write(json.dumps([r for rows_ in everyone for r in rows_]) + "\n")
    dist.destroy_process_group()


def speed(r: dict) -> str:
    """MB per second of reading: the bytes read over the time of the load stage (fxparallel) or of the whole
    read (the plain read); "-" where the bytes are not counted (transformers maps the files)."""
    seconds = r.get("load_seconds", r.get("seconds")) if "bytes_read" in r else None
    return f"{r['bytes_read'] / 1e6 / seconds:.0f}" if seconds else "-"


def table(rows: list) -> str:
    head = ("tp", "rank", "system", "RSS before MiB", "ckpt MiB", "shard MiB", "read MiB", "rchar MiB", "load rchar MiB",
            "peak growth (loaded) MiB", "peak growth (+touch) MiB", "load-stage growth MiB", "growth - shard MiB",
            "s (+touch)", "load-stage s", "read MB/s")
    lines = [" | ".join(head), " | ".join("---" for _ in head)]
    for r in rows:
        if "error" in r:
            lines.append(f"{r['tp']} | {r['rank']} | {r['system']} | {r['rss_before'] / MiB:.0f} | "
                         f"{r['checkpoint'] / MiB:.0f} | error: {r['error']}")
            continue
        cell = lambda k: f"{r[k] / MiB:.1f}" if k in r else "-"  # noqa: E731
        seconds = lambda k: f"{r[k]:.2f}" if k in r else "-"  # noqa: E731
        lines.append(" | ".join([str(r["tp"]), str(r["rank"]), r["system"], f"{r['rss_before'] / MiB:.0f}",
                                 f"{r['checkpoint'] / MiB:.1f}",
                                 cell("shard"), cell("bytes_read"), cell("rchar"), cell("load_rchar"), cell("loaded"), cell("growth"),
                                 cell("load_growth"), f"{(r['growth'] - r['shard']) / MiB:.1f}",
                                 seconds("seconds"), seconds("load_seconds"), speed(r)]))
    return "\n".join(lines)


def run_all(args) -> None:
    """Run torchrun for each TP size, one after the other, and print one table."""
    results = os.path.abspath(args.json or os.path.join(os.path.dirname(args.checkpoint), "load_memory.jsonl"))
    if os.path.exists(results):
        os.remove(results)
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_VERBOSITY="error", MALLOC_MMAP_THRESHOLD_="65536",
               PYTHONWARNINGS="ignore")
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    for tp in args.tp:
        cmd = [torchrun, f"--nproc_per_node={tp}", __file__, "--size-mb", str(args.size_mb), "--checkpoint",
               args.checkpoint, "--json", results, "--dtype", args.dtype]
        print("$", " ".join(cmd), flush=True)
        done = subprocess.run(cmd, env=env, capture_output=True, text=True)
        if done.returncode:
            print(done.stdout[-3000:], done.stderr[-6000:])
            raise SystemExit(f"tp={tp} failed")
    rows = [r for line in open(results) for r in json.loads(line)]
    print()
    print(table(rows))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size-mb", type=float, default=300)
    parser.add_argument("--checkpoint", default=None, help="where to build it (default /tmp/fxparallel-bench/llama-<size>mb)")
    parser.add_argument("--all", action="store_true", help="run TP = 1, 2, 4 (torchrun each) and print one table")
    parser.add_argument("--tp", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--json", default=None, help="append the per-rank results to this file")
    parser.add_argument("--dtype", default="float32", help="dtype of the loaded shards (the checkpoint is fp32)")
    args = parser.parse_args()
    args.checkpoint = args.checkpoint or f"/tmp/fxparallel-bench/llama-{args.size_mb:g}mb"
    if args.all:
        run_all(args)
    else:
        run_rank(args)


if __name__ == "__main__":
    main()
