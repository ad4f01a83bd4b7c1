"""Fine-tune the tensor-parallel model with transformers.Trainer, then save it as a Hugging Face checkpoint.

    torchrun --nproc_per_node=2 examples/train_trainer.py                      # a tiny Llama built here
    torchrun --nproc_per_node=2 examples/train_trainer.py --model DIR_OR_HUB_ID --steps 20
    torchrun --nproc_per_node=4 examples/train_trainer.py --dp 2                # dp 2 x tp 2
    torchrun --nproc_per_node=4 examples/train_trainer.py --cp 2                # tp 2 x context parallelism 2

The job is a (dp, tp) mesh (``fxparallel.runtime.init_mesh``; --dp 1: one tensor-parallel group) and the model is
parallelized over its tp sub-mesh. Trainer reads ``model.tp_size`` and the dp size from
``model.config.distributed_config``, takes transformers' tensor-parallel path (no DistributedDataParallel, the
same batch on the ranks of a tp group, the data split over dp) and sees the parameters as DTensors over the mesh,
so its gradient clipping uses the true global norm; gradients are averaged over dp once per step; ``num_items_in_batch``,
gradient accumulation and gradient checkpointing are the model's own. Checkpoints every --steps / 2 steps
resume exactly (``save_only_model=True`` with ``fxparallel.TrainerCheckpoints()``; ``--resume`` continues from the
last one). ``save_model`` gathers the shards and writes a checkpoint ``from_pretrained`` loads. With --cp the mesh
is accelerate's (dp, cp, tp), the model is parallelized with ``cp_group=mesh["cp"]``, and Trainer gets
``ParallelismConfig(dp_shard_size=dp, cp_size=cp, tp_size=tp)``: it cuts each row into the cp ranks' chunks. accelerate allows that path on GPUs only: on a CPU job
the example calls ``fxparallel.accelerate_cpu.allow_tensor_parallel_on_cpu()`` first.

By default it builds a tiny Llama with a word-level tokenizer (checkpoints/tiny-llama-generate, as
examples/generate.py) and trains on random sentences made here (no hub, no datasets).
"""
from __future__ import annotations

import argparse
import os
import random

import torch
import torch.distributed as dist

import fxparallel
from fxparallel.accelerate_cpu import allow_tensor_parallel_on_cpu
from fxparallel.runtime import init_mesh
from generate import WORDS, build_default


def sentences(tokenizer, count: int, length: int, seed: int = 0) -> list:
    """Random sentences of the tokenizer's words, as Trainer rows (labels = input ids; the loss shifts them)."""
    rng = random.Random(seed)
    rows = []
    for _ in range(count):
        ids = tokenizer(" ".join(rng.choice(WORDS) for _ in range(length)))["input_ids"][:length]
        rows.append({"input_ids": ids, "labels": list(ids)})
    return rows


def main():
    from transformers import AutoTokenizer, Trainer, TrainingArguments

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=None, help="hub id or directory (default: a tiny Llama built here)")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--out", default="out/train_trainer")
    parser.add_argument("--resume", action="store_true", help="continue from the last checkpoint in --out")
    parser.add_argument("--dp", type=int, default=1, help="data-parallel size (tp = world / (dp * cp))")
    parser.add_argument("--cp", type=int, default=1, help="context-parallel size (rows of 16 tokens: 2, 4 or 8)")
    args = parser.parse_args()

    device = "cuda" if torch.cuda.is_available() else "cpu"
    dist.init_process_group("nccl" if device == "cuda" else "gloo")
    rank = dist.get_rank()
    path = args.model
    if path is None:
        path = "checkpoints/tiny-llama-generate"
        if rank == 0:
            build_default(path)
        dist.barrier()
    if device == "cpu":
        allow_tensor_parallel_on_cpu()  # accelerate's one GPU-only check on this path (see the docstring)

    tp = dist.get_world_size() // (args.dp * args.cp)
    context_parallel = {}
    if args.cp > 1:  # accelerate's layout: tp innermost, then cp, then dp
        from accelerate import ParallelismConfig
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh(device, (args.dp, args.cp, tp), mesh_dim_names=("dp", "cp", "tp"))
        model = fxparallel.parallelize(path, mesh["tp"], cp_group=mesh["cp"], dtype=torch.float32)
        context_parallel["parallelism_config"] = ParallelismConfig(dp_shard_size=args.dp, cp_size=args.cp, tp_size=tp)
    else:
        model = fxparallel.parallelize(path, init_mesh(dp=args.dp, tp=tp).tp_mesh, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(path)
    training = TrainingArguments(
        output_dir=args.out, max_steps=args.steps, per_device_train_batch_size=4, gradient_accumulation_steps=2,
        learning_rate=1e-3, lr_scheduler_type="cosine", warmup_steps=1, max_grad_norm=1.0,
        gradient_checkpointing=True, logging_steps=1, report_to=[], use_cpu=device == "cpu", disable_tqdm=rank != 0,
        # checkpoints that resume exactly (train(resume_from_checkpoint=True)): Trainer saves the model (it refuses
        # optimizer states for models sharded at load), fxparallel.TrainerCheckpoints the optimizer, schedule, RNG
        save_strategy="steps", save_steps=max(1, args.steps // 2), save_only_model=True, **context_parallel)
    trainer = Trainer(model=model, args=training, train_dataset=sentences(tokenizer, 64, 16),
                      processing_class=tokenizer, callbacks=[fxparallel.TrainerCheckpoints()])
    trainer.train(resume_from_checkpoint=True if args.resume else None)
    saved = os.path.join(args.out, "final")
    trainer.save_model(saved)  # every rank: the shards are gathered; rank 0 writes
    if rank == 0:
        from transformers import AutoModelForCausalLM

        reloaded = AutoModelForCausalLM.from_pretrained(saved, dtype=torch.float32)
        print(f"saved {saved}: {reloaded.num_parameters()} parameters, loads with from_pretrained")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
