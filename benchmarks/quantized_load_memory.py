"""Peak resident memory and bytes read per rank while loading quantized checkpoints dequantized on load:
fxparallel.parallelize next to transformers' from_pretrained(..., quantization_config=<Config>(dequantize=True)),
on a fine-grained FP8 Llama, a compressed-tensors FP8 Llama and an MXFP4 GPT-OSS of a few tens of MB built locally
(tests' builders).

    python benchmarks/quantized_load_memory.py    # TP = 1, 2, 4 in bf16: results/quantized_load_memory.json
    python benchmarks/quantized_load_memory.py --formats compressed-tensors   # one format (the others' rows kept)
    torchrun --nproc_per_node=2 benchmarks/quantized_load_memory.py --rank-run ...   # one TP size (what the above runs)

Measured as benchmarks/load_memory.py does: peak RSS growth is VmHWM (reset through /proc/self/clear_refs) minus the
RSS just before the call; "+touch" after every weight was read once; fxparallel's load stage (``load_from_files``)
alone too. transformers dequantizes the whole model in one process (its dequantized load has no TP here: each rank
would hold it all); its row is measured on rank 0 of the TP=1 run, with ``DistributedConfig(tp_size=N)`` tried on
each rank of the other runs (an error is reported as such).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.join(HERE, os.pardir, "tests")]

from load_memory import MiB, Peak, release_memory, status, touch  # noqa: E402

# fine-grained FP8 Llama: hidden 1024, MLP 2816, 16 heads / 8 kv, vocab 8192, 2 layers: 23.6 MB of float8
# projections, 33.6 MB of bf16 embeddings and lm_head
FP8 = dict(vocab_size=8192, hidden_size=1024, intermediate_size=2816, num_hidden_layers=2, num_attention_heads=16,
           num_key_value_heads=8, head_dim=64, max_position_embeddings=256, tie_word_embeddings=False)
# MXFP4 GPT-OSS: hidden 1024, 8 experts of 1024, 16 heads / 8 kv, vocab 8192, 2 layers: 26.7 MB of MXFP4 experts,
# 46 MB of bf16 attention, router, embeddings and lm_head
MXFP4 = dict(vocab_size=8192, hidden_size=1024, intermediate_size=1024, num_hidden_layers=2, num_attention_heads=16,
             num_key_value_heads=8, head_dim=64, num_local_experts=8, num_experts_per_tok=2,
             max_position_embeddings=256, sliding_window=128, layer_types=["sliding_attention", "full_attention"])


CONFIGS = {"fp8": FP8, "compressed-tensors": FP8, "mxfp4": MXFP4}  # compressed-tensors: the FP8 Llama's shapes


def build(root: str, formats) -> dict:
    """The checkpoints of ``formats`` under ``root`` (built once)."""
    from fp8_checkpoints import fp8_checkpoint
    from models import tiny_config
    from quantized_checkpoints import ct_fp8_checkpoint, gpt_oss_config, mxfp4_checkpoint

    builders = {  # compressed-tensors: llm-compressor's FP8 (attention, per tensor) and FP8_DYNAMIC (MLP, per channel)
        "fp8": lambda path: fp8_checkpoint(path, tiny_config("llama", **FP8), seed=0, not_converted=("lm_head",)),
        "compressed-tensors": lambda path: ct_fp8_checkpoint(path, tiny_config("llama", **FP8), seed=0),
        "mxfp4": lambda path: mxfp4_checkpoint(path, gpt_oss_config(**MXFP4), seed=0)}
    paths = {}
    for method in formats:
        paths[method] = os.path.join(root, method)
        if not os.path.exists(os.path.join(paths[method], "config.json")):
            builders[method](paths[method])
    return paths


def stored_bytes(path: str) -> dict:
    from fxparallel.load.safetensors_io import SafetensorsFile

    tensors = SafetensorsFile(os.path.join(path, "model.safetensors")).tensors
    quantized = sum(i.end - i.start for n, i in tensors.items()
                    if i.dtype.startswith("F8") or n.endswith(("_blocks", "_scales", "_scale_inv", "_scale")))
    return {"file": os.path.getsize(os.path.join(path, "model.safetensors")),
            "tensors": sum(i.end - i.start for i in tensors.values()), "quantized": quantized}


def shard_bytes(model) -> int:
    total = 0
    for q in model.parameters():
        local = q.to_local() if hasattr(q, "to_local") else q
        total += local.numel() * local.element_size()
    return total


def measure_fxparallel(path: str, dtype) -> dict:
    import torch.distributed as dist

    import fxparallel
    import fxparallel.api as api

    stage, original = {}, api.load_from_files

    def measured_load(*args, **kw):
        with Peak() as p:
            n = original(*args, **kw)
        stage.update(load_growth=p.growth)
        return n

    api.load_from_files = measured_load
    try:
        with Peak() as p:
            model = fxparallel.parallelize(path, dist.group.WORLD, dtype=dtype)
            loaded = p.now()
            touch(model)
    finally:
        api.load_from_files = original
    row = dict(system="fxparallel", loaded=loaded, growth=p.growth, bytes_read=model.bytes_read,
               shard=shard_bytes(model), dequantized_from=getattr(model, "dequantized_from", None), **stage)
    del model
    release_memory()
    return row


def measure_transformers(path: str, method: str, dtype, tp: int) -> dict:
    from transformers import AutoModelForCausalLM, CompressedTensorsConfig, FineGrainedFP8Config, Mxfp4Config

    config = {"fp8": FineGrainedFP8Config, "compressed-tensors": CompressedTensorsConfig,
              "mxfp4": Mxfp4Config}[method](dequantize=True)
    kwargs = {}
    label = f"transformers {type(config).__name__}(dequantize=True)"
    if tp > 1:
        from transformers import DistributedConfig

        kwargs = dict(distributed_config=DistributedConfig(tp_size=tp, tp_plan="auto"))
        label += f", DistributedConfig(tp_size={tp})"
    try:
        with Peak() as p:
            model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, quantization_config=config, **kwargs)
            loaded = p.now()
            touch(model)
    except Exception as err:  # noqa: BLE001 - reported, not hidden
        return dict(system=label, error=f"{type(err).__name__}: {str(err)[:2000]}")
    row = dict(system=label, loaded=loaded, growth=p.growth, shard=shard_bytes(model))
    del model
    release_memory()
    return row


def run_rank(args) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, tp = dist.get_rank(), dist.get_world_size()
    dtype = getattr(torch, args.dtype)
    rows = []
    for method, path in json.loads(args.paths).items():
        before = status("VmRSS")
        measured = [measure_fxparallel(path, dtype)]
        if tp == 1 or args.transformers_tp:
            measured.append(measure_transformers(path, method, dtype, tp))
        for row in measured:
            row.update(method=method, rank=rank, tp=tp, dtype=args.dtype, rss_before=before, **stored_bytes(path))
        rows += measured
        dist.barrier()
    everyone = [None] * tp
    dist.all_gather_object(everyone, rows)
    if rank == 0:
        with open(args.json, "a") as f:
            f.write(json.dumps([r for part in everyone for r in part]) + "\n")
    dist.destroy_process_group()


def table(rows: list) -> str:
    head = ("format", "tp", "rank", "system", "file MiB", "quantized MiB", "shard MiB", "read MiB",
            "peak growth (loaded) MiB", "(+touch) MiB", "load stage MiB")
    lines = [" | ".join(head), " | ".join("---" for _ in head)]
    cell = lambda r, k: f"{r[k] / MiB:.1f}" if r.get(k) is not None else "-"  # noqa: E731
    for r in sorted(rows, key=lambda r: (r["method"], r["tp"], r["system"] != "fxparallel", r["rank"])):
        if "error" in r:
            lines.append(f"{r['method']} | {r['tp']} | {r['rank']} | {r['system']} | error: {r['error'][:120]}")
            continue
        lines.append(" | ".join([r["method"], str(r["tp"]), str(r["rank"]), r["system"], cell(r, "file"),
                                 cell(r, "quantized"), cell(r, "shard"), cell(r, "bytes_read"), cell(r, "loaded"),
                                 cell(r, "growth"), cell(r, "load_growth")]))
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--root", default="/tmp/fxparallel-bench/quantized", help="where the checkpoints are built")
    parser.add_argument("--tp", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--formats", nargs="+", default=list(CONFIGS), choices=list(CONFIGS),
                        help="the formats measured; the json keeps the other formats' earlier rows")
    parser.add_argument("--dtype", default="bfloat16", help="the compute dtype the weights are dequantized to")
    parser.add_argument("--transformers-tp", action="store_true",
                        help="also try transformers' DistributedConfig load at TP > 1")
    parser.add_argument("--json", default=os.path.join(HERE, "results", "quantized_load_memory.json"))
    parser.add_argument("--rank-run", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--paths", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rank_run:
        return run_rank(args)
    paths = build(args.root, args.formats)
    raw = args.json + ".jsonl"
    if os.path.exists(raw):
        os.remove(raw)
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_VERBOSITY="error", PYTHONWARNINGS="ignore",
               MALLOC_MMAP_THRESHOLD_="65536")
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    for tp in args.tp:
        cmd = [torchrun, f"--nproc_per_node={tp}", __file__, "--rank-run", "--paths", json.dumps(paths),
               "--json", raw, "--dtype", args.dtype] + (["--transformers-tp"] if args.transformers_tp else [])
        print("$ torchrun --nproc_per_node", tp, flush=True)
        done = subprocess.run(cmd, env=env, capture_output=True, text=True)
        if done.returncode:
            print(done.stdout[-3000:], done.stderr[-6000:])
            raise SystemExit(f"tp={tp} failed")
    rows = [r for line in open(raw) for r in json.loads(line)]
    os.remove(raw)
    checkpoints = {m: dict(stored_bytes(p), config=CONFIGS[m]) for m, p in paths.items()}
    if os.path.exists(args.json):  # the other formats' earlier rows, measured in the same dtype
        with open(args.json) as f:
            earlier = json.load(f)
        if earlier.get("dtype") == args.dtype:
            rows = [r for r in earlier["rows"] if r["method"] not in paths] + rows
            checkpoints = {**{m: c for m, c in earlier["checkpoints"].items() if m not in paths}, **checkpoints}
    with open(args.json, "w") as f:
        json.dump({"dtype": args.dtype, "checkpoints": checkpoints, "rows": rows}, f, indent=1)
    print(table(rows))


if __name__ == "__main__":
    main()
