"""Tiny random models and checkpoints built locally (no hub)."""
from __future__ import annotations

import os

import torch

# 8 query heads and 4 kv heads (GQA): splits evenly over tp = 1, 2 and 4
TINY = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=8,
            num_key_value_heads=4, max_position_embeddings=64)


def tiny_config(family: str = "llama", **overrides):
    from transformers import LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config

    cls = {"llama": LlamaConfig, "mistral": MistralConfig, "qwen2": Qwen2Config, "qwen3": Qwen3Config}[family]
    kwargs = dict(TINY)
    if family == "qwen3":
        kwargs["head_dim"] = 16  # q/k norms over a head_dim that differs from hidden / heads
    if family == "mistral":
        kwargs["sliding_window"] = 8
    kwargs.update(overrides)
    return cls(**kwargs)


def save_checkpoint(config, directory: str, seed: int = 0, max_shard_size=None) -> str:
    """Random-init the model with ``seed`` and save it as safetensors; returns the directory."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():  # non-trivial norm weights, so a wrong placement would show
        for name, p in model.named_parameters():
            if p.dim() == 1:
                p.add_(torch.randn_like(p) * 0.1)
    os.makedirs(directory, exist_ok=True)
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(directory, safe_serialization=True, **kwargs)
    return directory


def reference(directory: str):
    """The single-device transformers model (by the class its config names where transformers' Auto mapping
    lacks the config, e.g. Emu3ForCausalLM's text config)."""
    import transformers
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(directory)
    cls = AutoModelForCausalLM
    if type(config) not in AutoModelForCausalLM._model_mapping:
        cls = getattr(transformers, config.architectures[0])
    return cls.from_pretrained(directory, dtype=torch.float32).eval()


def edited_copy(src: str, dst: str, edit) -> str:
    """Copy a single-file checkpoint directory and apply ``edit(tensors)`` to its safetensors file."""
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    path = os.path.join(dst, "model.safetensors")
    tensors = load_file(path)
    edit(tensors)
    save_file(tensors, path, metadata={"format": "pt"})
    return dst


def save_with_tokenizer(directory: str, seed: int = 0) -> str:
    """A tiny random Llama and a byte-level BPE tokenizer trained here on a few words (stop strings need a
    tokenizer whose tokens transformers can map back to text), saved as a hub directory."""
    import random

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, PreTrainedTokenizerFast

    words = "the a one two cat dog sat ran on under over mat tree and then it was big small red green".split()
    rng = random.Random(seed)
    core = Tokenizer(models.BPE())
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    core.train_from_iterator([" ".join(rng.choice(words) for _ in range(12)) for _ in range(200)],
                             trainers.BpeTrainer(vocab_size=120, special_tokens=["<pad>", "<s>", "</s>"],
                                                 initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<pad>", bos_token="<s>", eos_token="</s>",
                                        padding_side="left")
    config = tiny_config("llama", vocab_size=core.get_vocab_size(), pad_token_id=0, bos_token_id=1, eos_token_id=2)
    save_checkpoint(config, directory, seed=seed)
    tokenizer.save_pretrained(directory)
    return directory
