"""Parallelize a causal LM over the ranks of torchrun and check it against one device.

    torchrun --nproc_per_node=2 examples/parallelize_tp.py            # builds a small Llama locally
    torchrun --nproc_per_node=2 examples/parallelize_tp.py --model DIR_OR_HUB_ID

Prints the sharding plan (rank 0), then the largest difference of loss, logits and
every parameter gradient from the single-device transformers model, then generates a few
tokens greedily with the parallel model and with transformers and says whether they match.
"""
from __future__ import annotations

import argparse
import datetime
import os

import torch
import torch.distributed as dist

import fxparallel


def build_default_checkpoint(path: str) -> str:
    """A small random Llama saved as safetensors (no hub needed)."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    if not os.path.exists(os.path.join(path, "config.json")):
        config = LlamaConfig(vocab_size=1024, hidden_size=256, intermediate_size=688, num_hidden_layers=4,
                             num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=256)
        torch.manual_seed(0)
        AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(path)
    return path


def start(model, checkpoint_dir: str) -> tuple:
    """Join torchrun's process group (NCCL on GPUs, each rank on the GPU of its LOCAL_RANK; gloo on CPU); returns
    (rank, the checkpoint to load): ``model``, or the small local Llama rank 0 builds in ``checkpoint_dir``."""
    use_cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if use_cuda else "gloo", timeout=datetime.timedelta(minutes=5))
    if use_cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    if model is None:
        if dist.get_rank() == 0:
            build_default_checkpoint(checkpoint_dir)
        dist.barrier()
    return dist.get_rank(), model or checkpoint_dir


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="hub id or local directory (default: a small local Llama)")
    parser.add_argument("--checkpoint-dir", default="checkpoints/tiny-llama")
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--seq", type=int, default=32)
    args = parser.parse_args()

    rank, model_path = start(args.model, args.checkpoint_dir)
    world = dist.get_world_size()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")

    model = fxparallel.parallelize(model_path, dist.group.WORLD, dtype=torch.float32)
    if rank == 0:
        print(model.plan)
        print("timings (s):", {k: round(v, 2) for k, v in model.timings.items()})

    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    if rank != 0:  # every rank loads the reference; one progress bar is enough
        hf_logging.disable_progress_bar()
    reference = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).to(device).eval()
    generator = torch.Generator().manual_seed(1234)
    ids = torch.randint(0, model.config.vocab_size, (args.batch, args.seq), generator=generator).to(device)

    out = model(input_ids=ids, labels=ids)
    out.loss.backward()
    ref = reference(input_ids=ids, labels=ids)
    ref.loss.backward()
    logits = model(input_ids=ids).logits  # complete logits: gathered when no labels are given

    grad_err = 0.0
    ref_params = dict(reference.named_parameters())
    for name, p in model.named_parameters():
        full_grad = model.plan.param(name).shard_of(ref_params[name].grad, rank, world)
        grad_err = max(grad_err, (p.grad - full_grad).abs().max().item())
    errors = torch.tensor([(out.loss - ref.loss).abs().item(), (logits - ref.logits).abs().max().item(), grad_err],
                          device=device)
    dist.all_reduce(errors, op=dist.ReduceOp.MAX)
    prompt = ids[:, :8]
    with torch.no_grad():
        kwargs = dict(attention_mask=torch.ones_like(prompt), max_new_tokens=16, do_sample=False, pad_token_id=0)
        tokens = model.generate(input_ids=prompt, **kwargs)
        expected = reference.generate(input_ids=prompt, **kwargs)
    same = torch.tensor([float(torch.equal(tokens, expected))], device=device)
    dist.all_reduce(same, op=dist.ReduceOp.MIN)
    if rank == 0:
        print(f"\nTP={world} vs single device: |loss diff| {errors[0]:.2e}, max |logits diff| {errors[1]:.2e}, "
              f"max |grad diff| {errors[2]:.2e} (every parameter)")
        print(f"generate (greedy, 16 new tokens, KV cache sharded by heads): first row {tokens[0, 8:].tolist()}; "
              f"{'the same tokens as' if same.item() else 'DIFFERENT tokens from'} transformers' generate")
        print("AGREES" if errors.max() < 1e-4 and same.item() else "DISAGREES")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
