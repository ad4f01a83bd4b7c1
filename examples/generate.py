"""Generate text with a tensor-parallel model: torchrun, one process per rank, text streamed on rank 0.

    torchrun --nproc_per_node=2 examples/generate.py                      # a small model built locally
    torchrun --nproc_per_node=2 examples/generate.py --model DIR_OR_HUB_ID --prompt "Once upon a time"

Without --model it builds a tiny Llama and a small word-level tokenizer here (no hub needed): the
text is random-weight text, but every step is the real one (tokenizer, generate, streamer).
"""
from __future__ import annotations

import argparse
import datetime
import os

import torch
import torch.distributed as dist

import fxparallel

WORDS = ("the a one two cat dog sat ran on under over mat tree and then it was big small red green blue "
         "quick slow day night sun moon").split()


def build_default(path: str) -> str:
    """A tiny random Llama with a word-level tokenizer of the words above, saved as a hub directory."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import AutoModelForCausalLM, LlamaConfig, PreTrainedTokenizerFast

    if os.path.exists(os.path.join(path, "config.json")):
        return path
    vocab = {w: i for i, w in enumerate(["<pad>", "<s>", "</s>", "<unk>"] + WORDS)}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<pad>", bos_token="<s>", eos_token="</s>",
                                        unk_token="<unk>", padding_side="left")
    config = LlamaConfig(vocab_size=len(vocab), hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                         pad_token_id=0, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="hub id or local directory (default: a tiny local model)")
    parser.add_argument("--model-dir", default="checkpoints/tiny-llama-generate")
    parser.add_argument("--prompt", action="append", help="a prompt (repeat for a batch)")
    parser.add_argument("--max-new-tokens", type=int, default=24)
    parser.add_argument("--sample", action="store_true", help="sample (temperature 0.8, top-k 20) instead of greedy")
    args = parser.parse_args()

    use_cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if use_cuda else "gloo", timeout=datetime.timedelta(minutes=10))
    rank = dist.get_rank()
    if use_cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    path = args.model
    if path is None:
        if rank == 0:
            build_default(args.model_dir)
        dist.barrier()
        path = args.model_dir

    from transformers import AutoTokenizer, TextStreamer

    tokenizer = AutoTokenizer.from_pretrained(path)
    tokenizer.padding_side = "left"
    model = fxparallel.parallelize(path, dist.group.WORLD)
    prompts = args.prompt or ["the cat sat on the mat and then"]
    batch = tokenizer(prompts, return_tensors="pt", padding=True)
    streamer = TextStreamer(tokenizer, skip_prompt=False) if rank == 0 and len(prompts) == 1 else None
    sampling = dict(do_sample=True, temperature=0.8, top_k=20) if args.sample else dict(do_sample=False)
    out = model.generate(**batch, max_new_tokens=args.max_new_tokens, streamer=streamer,
                         pad_token_id=tokenizer.pad_token_id, **sampling)
    rows = [torch.empty_like(out) for _ in range(dist.get_world_size())]
    dist.all_gather(rows, out.contiguous())
    same = all(torch.equal(r, rows[0]) for r in rows)
    if rank == 0:
        if streamer is None:
            for text in tokenizer.batch_decode(out, skip_special_tokens=True):
                print(text)
        print(f"[tp={dist.get_world_size()}: {out.shape[1] - batch['input_ids'].shape[1]} new tokens per prompt; "
              f"{'the same tokens on every rank' if same else 'DIFFERENT tokens on the ranks'}]")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
