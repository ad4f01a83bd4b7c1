"""Train a causal LM with tensor x data x context parallelism (TP -> FSDP2, CP), checkpoints, resume, export.

    TP_SIZE=2 DP_SIZE=2 CP_SIZE=1 torchrun --nproc_per_node=4 examples/train_3d.py --steps 5
    TP_SIZE=1 DP_SIZE=1 CP_SIZE=2 torchrun --nproc_per_node=2 examples/train_3d.py --steps 5
    TP_SIZE=2 DP_SIZE=2 EP_SIZE=2 torchrun --nproc_per_node=4 examples/train_3d.py --steps 5  # a small MoE's
    ... examples/train_3d.py --steps 10 --resume              # continue from this layout's checkpoints
    ... examples/train_3d.py --steps 10 --resume-from out/train_3d/dp2_tp2_cp1/checkpoints  # from another layout
    ... examples/train_3d.py --model DIR --dataset NAME       # your model, a `datasets` dataset
    ... examples/train_3d.py --activation-checkpointing full  # recompute each decoder layer in backward

By default it builds a small Llama locally (checkpoints/tiny-llama-train) and trains on a
synthetic token stream made locally (no hub, no `datasets`). Rank 0 logs the loss (mean over
the global batch's tokens), the gradient norm before clipping and tokens/s of each step.
With CP_SIZE > 1 every sequence is split over the cp ranks (load-balanced causal chunks, exact
attention over the whole sequence); --seq-len must then divide by 2 * CP_SIZE.
With EP_SIZE > 1 (it must divide DP_SIZE) the experts of a mixture-of-experts model are spread over that many
dp ranks, which exchange the rows routed to them by all-to-all; the default model is then a small Qwen3-MoE
(checkpoints/tiny-moe-train); its checkpoints load at any other layout, with or without EP_SIZE.
With DP_SHARD_SIZE below DP_SIZE, FSDP shards within groups of that many dp ranks and replicates across them (HSDP).
Checkpoints go to out/train_3d/dp<DP>_tp<TP>_cp<CP>[_ep<EP>][_shard<N>]/checkpoints by default (one directory per
layout: runs of different layouts never share steps); any layout loads any other's with --resume-from.
"""
from __future__ import annotations

import argparse
import logging
import os
import sys

import torch
import torch.distributed as dist

import fxparallel
from fxparallel.runtime import (StepBatches, apply_data_parallel, dataset_token_stream, export_pretrained,
                                init_mesh, latest_checkpoint, list_checkpoints, load_checkpoint, pack_tokens,
                                save_checkpoint, synthetic_token_stream, train_step)


def build_default_checkpoint(path: str, experts: bool = False) -> str:
    """A small random Llama (``experts``: Qwen3-MoE, 8 experts) saved as safetensors (no hub needed)."""
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen3MoeConfig

    if not os.path.exists(os.path.join(path, "config.json")):
        shape = dict(vocab_size=512, hidden_size=128, num_hidden_layers=4, num_attention_heads=8,
                     num_key_value_heads=4, max_position_embeddings=512)
        config = Qwen3MoeConfig(**shape, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=64,
                                intermediate_size=352, head_dim=16) if experts else \
            LlamaConfig(**shape, intermediate_size=352)
        torch.manual_seed(0)
        AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(path)
    return path


SAVE_ROOT = os.path.join("out", "train_3d")


def default_save_dir(layout: dict) -> str:
    """out/train_3d/dp2_tp2_cp1/checkpoints for {"dp": 2, "tp": 2, "cp": 1} (``_ep2`` after it with "ep": 2,
    ``_shard1`` with "dp_shard": 1)."""
    ep = f"_ep{layout['ep']}" if layout.get("ep", 1) > 1 else ""
    shard = f"_shard{layout['dp_shard']}" if "dp_shard" in layout else ""
    return os.path.join(SAVE_ROOT, f"dp{layout['dp']}_tp{layout['tp']}_cp{layout['cp']}{ep}{shard}", "checkpoints")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="hub id or local directory (default: a small local Llama)")
    p.add_argument("--model-dir", default="checkpoints/tiny-llama-train", help="where the default model is built")
    p.add_argument("--tp", type=int, default=None, help="tensor-parallel size (default: TP_SIZE or 1)")
    p.add_argument("--dp", type=int, default=None, help="data-parallel size (default: DP_SIZE or the rest)")
    p.add_argument("--cp", type=int, default=None, help="context-parallel size (default: CP_SIZE or 1)")
    p.add_argument("--ep", type=int, default=None,
                   help="experts over this many dp ranks (default: EP_SIZE or 1; a mixture-of-experts model)")
    p.add_argument("--moe-model-dir", default="checkpoints/tiny-moe-train",
                   help="where the default mixture-of-experts model is built (with --ep > 1)")
    p.add_argument("--steps", type=int, default=20, help="train until this step (counted from the start)")
    p.add_argument("--global-batch", type=int, default=8, help="rows per step over all dp ranks")
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--max-norm", type=float, default=1.0, help="clip the global gradient norm (0: no clipping)")
    p.add_argument("--dp-mode", choices=("shard", "replicate"), default="shard")
    p.add_argument("--mixed-precision", choices=("none", "bf16"), default="none")
    p.add_argument("--activation-checkpointing", choices=("none", "full", "selective"), default="none",
                   help="recompute each decoder layer in backward (selective: keep its matmul outputs)")
    p.add_argument("--save-dir", default=None,
                   help="checkpoint root (default: out/train_3d/dp<DP>_tp<TP>_cp<CP>[_ep<EP>][_shard<N>]/checkpoints, "
                        "one per layout)")
    p.add_argument("--save-every", type=int, default=5, help="checkpoint every N steps (and at the end); 0: never")
    p.add_argument("--keep", type=int, default=2, help="complete checkpoints to keep")
    p.add_argument("--resume", action="store_true", help="continue from the latest checkpoint in --save-dir")
    p.add_argument("--resume-from", default=None,
                   help="continue from this checkpoint (a step directory, or a root: its latest), e.g. one saved "
                        "with another layout; new checkpoints still go to --save-dir")
    p.add_argument("--trust-metadata", action="store_true",
                   help="also load a checkpoint that records no digest of its .metadata (written by an older "
                        "fxparallel); the digest is a damage check: .metadata is always read with a restricted "
                        "unpickler")
    p.add_argument("--export", default=None, help="write a consolidated Hugging Face directory here at the end")
    p.add_argument("--dataset", default=None, help="a `datasets` dataset name (default: synthetic tokens)")
    p.add_argument("--dataset-config", default=None)
    p.add_argument("--text-field", default="text")
    p.add_argument("--tokenizer", default=None, help="tokenizer for --dataset (default: the model's)")
    p.add_argument("--max-tokens", type=int, default=2_000_000, help="tokens to read from --dataset")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def requested_cp(args) -> int:
    if args.cp is not None:
        return args.cp
    return int(os.environ.get("CP_SIZE", "1") or 1)


def load_rows(args, model_path, vocab_size: int) -> torch.Tensor:
    if args.dataset is None:
        rows = max(32 * args.global_batch, 256)
        stream = synthetic_token_stream(vocab_size, rows * args.seq_len, seed=args.seed)
    else:
        from transformers import AutoTokenizer

        source = args.tokenizer or model_path
        try:
            tokenizer = AutoTokenizer.from_pretrained(source)
        except (OSError, ValueError) as err:
            raise SystemExit(f"error: --dataset needs a tokenizer; none loads from {source!r} ({err}); "
                             "pass --tokenizer") from None
        stream = dataset_token_stream(args.dataset, tokenizer, config_name=args.dataset_config,
                                      text_field=args.text_field, max_tokens=args.max_tokens)
    return pack_tokens(stream, args.seq_len)


def other_layouts_hint(args, save_dir: str) -> str:
    """With the default --save-dir: where other layouts' checkpoints are (--resume-from loads them)."""
    if args.save_dir is not None or not os.path.isdir(SAVE_ROOT):
        return ""
    dirs = (os.path.join(SAVE_ROOT, d, "checkpoints") for d in sorted(os.listdir(SAVE_ROOT)))
    others = [d for d in dirs if d != save_dir and list_checkpoints(d)]
    return f" (other layouts' checkpoints: {', '.join(others)}; --resume-from DIR loads one)" if others else ""


def main(argv=None):
    args = parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    cp = requested_cp(args)
    if args.seq_len % (2 * cp):  # before starting anything
        if os.environ.get("RANK", "0") == "0":
            print(f"error: --seq-len {args.seq_len} must divide by 2 * CP_SIZE = {2 * cp} (each context-parallel rank "
                  "takes two equal chunks of every sequence)", file=sys.stderr)
        sys.exit(2)
    owns_group = not dist.is_initialized()
    mesh = init_mesh(args.tp, args.dp, args.cp, ep=args.ep)
    first = mesh.rank == 0
    model_path = args.model
    if model_path is None:
        model_path = args.moe_model_dir if mesh.ep > 1 else args.model_dir
        if first:
            build_default_checkpoint(model_path, experts=mesh.ep > 1)
        dist.barrier()

    mixed = None if args.mixed_precision == "none" else args.mixed_precision
    model = fxparallel.parallelize(model_path, mesh.tp_mesh, dtype=torch.bfloat16 if mixed else torch.float32,
                                   cp_group=mesh.cp_mesh, ep_group=mesh.ep_mesh)  # size 1 / None: none
    model.train()  # parallelize returns eval mode (as from_pretrained); training applies the model's dropout
    if args.activation_checkpointing != "none":
        model.gradient_checkpointing_enable(mode=args.activation_checkpointing)
    model = apply_data_parallel(model, mesh, mode=args.dp_mode, mixed_precision=mixed)  # TP first, then FSDP
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=args.weight_decay)
    data = StepBatches(load_rows(args, model_path, model.config.vocab_size), args.global_batch, mesh.dp_rank,
                       mesh.dp, seed=args.seed)
    if first:
        n = sum(torch.Size(p.shape).numel() for p in model.plan.params)
        print(f"{mesh}: {model.plan.model_type}, {n / 1e6:.2f}M parameters, global batch {args.global_batch} x "
              f"{args.seq_len} tokens, {data.rows.shape[0]} rows, FSDP mode {args.dp_mode}, "
              f"mixed precision {args.mixed_precision}, activation checkpointing {args.activation_checkpointing}",
              flush=True)

    save_dir = args.save_dir or default_save_dir(mesh.layout())
    start = 0
    if args.resume or args.resume_from:
        found = args.resume_from or latest_checkpoint(save_dir)
        if found is None:
            if first:
                print(f"--resume: no checkpoint in {save_dir}, starting from step 0"
                      f"{other_layouts_hint(args, save_dir)}", flush=True)
        else:
            meta = load_checkpoint(found, model, optimizer, mesh, trust_metadata=args.trust_metadata)
            start = meta["step"]
            if first:
                print(f"resumed from {found} (step {start}, saved with layout {meta['layout']})", flush=True)

    history = []
    for step in range(start, args.steps):
        metrics = train_step(model, optimizer, data.batch(step), mesh, max_norm=args.max_norm)
        history.append(metrics)
        done = step + 1
        if first:
            print(f"step {done:5d} | loss {metrics.loss:.4f} | grad norm {metrics.grad_norm:.4f} | "
                  f"{metrics.tokens_per_s:,.0f} tokens/s", flush=True)
        if args.save_every and (done % args.save_every == 0 or done == args.steps):
            path = save_checkpoint(save_dir, model, optimizer, mesh, done, keep=args.keep)
            if first:
                print(f"saved {path}", flush=True)

    if args.export:
        export_pretrained(model, mesh, args.export)
        if first:
            print(f"exported a Hugging Face checkpoint to {args.export}", flush=True)
    if owns_group:
        dist.destroy_process_group()
    return history


if __name__ == "__main__":
    main()
