"""Fine-tune a LoRA adapter on a tensor-parallel model, save it, and load it with PEFT on one device.

    torchrun --nproc_per_node=2 examples/lora.py            # builds a small Llama locally
    torchrun --nproc_per_node=2 examples/lora.py --model DIR_OR_HUB_ID

Adds a LoRA adapter to the parallel model (``model.add_adapter(LoraConfig(...))``, transformers' name; the
solver places the adapter's matrices), trains it a few AdamW steps on random tokens (the base model frozen),
saves it with ``save_pretrained`` (the adapter only, as PEFT writes it), then rank 0 loads it with
``PeftModel.from_pretrained`` on one device and says whether its logits agree with the parallel model's.
"""
from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist

import fxparallel
from parallelize_tp import start


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="hub id or local directory (default: a small local Llama)")
    parser.add_argument("--checkpoint-dir", default="checkpoints/tiny-llama")
    parser.add_argument("--adapter-dir", default="checkpoints/tiny-llama-lora")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--rank", type=int, default=8, help="LoRA rank r")
    args = parser.parse_args()

    from peft import LoraConfig, PeftModel
    from transformers import AutoModelForCausalLM

    rank, model_path = start(args.model, args.checkpoint_dir)
    model = fxparallel.parallelize(model_path, dist.group.WORLD, dtype=torch.float32)
    model.add_adapter(LoraConfig(r=args.rank, lora_alpha=2 * args.rank, target_modules="all-linear"))
    trainable = [p for p in model.parameters() if p.requires_grad]
    if rank == 0:
        print([f"{p.name}: {p.placement}" for p in model.plan.params if "layers.0." in p.name and ".lora_" in p.name])
        print(f"trainable shard elements on rank 0: {sum(p.numel() for p in trainable):,} of "
              f"{sum(p.numel() for p in model.parameters()):,}")
    optimizer = torch.optim.AdamW(trainable, lr=1e-3)
    generator = torch.Generator().manual_seed(0)
    model.train()
    for step in range(args.steps):
        ids = torch.randint(0, model.config.vocab_size, (2, 32), generator=generator).to(model.device)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        if rank == 0:
            print(f"step {step}: loss {loss.item():.4f}")
    model.eval()
    model.save_pretrained(args.adapter_dir)
    ids = torch.randint(0, model.config.vocab_size, (2, 16), generator=generator).to(model.device)
    with torch.no_grad():
        logits = model(input_ids=ids).logits
    if rank == 0:
        base = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).to(model.device)
        peft = PeftModel.from_pretrained(base, args.adapter_dir).eval()
        with torch.no_grad():
            diff = (peft(input_ids=ids).logits - logits).abs().max().item()
        print(f"saved to {args.adapter_dir}: {sorted(os.listdir(args.adapter_dir))}")
        print(f"PEFT on one device vs the parallel model: max logits difference {diff:.2e}",
              "AGREES" if diff < 1e-4 else "DIFFERS")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
