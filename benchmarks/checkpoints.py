"""Small random checkpoints built locally (no hub): the benchmark's default models."""
from __future__ import annotations

import os

import torch

# hidden 256, 4 layers: small enough for a 2-core machine, wide enough that TP 1/2/4 splits evenly
SHAPE = dict(hidden=256, layers=4, heads=8, kv_heads=4, intermediate=1024, vocab=4096, positions=512)


def make_config(family: str, hidden=None, layers=None, heads=None, kv_heads=None, intermediate=None, vocab=None,
                positions=None):
    """A transformers config of ``family`` (llama, qwen3, mistral, opt, gpt2, or the hybrid qwen3_5_text: three
    gated-delta-net layers to one attention layer, the linear layers' heads as the attention's) with the benchmark
    shape."""
    from transformers import GPT2Config, LlamaConfig, MistralConfig, OPTConfig, Qwen3_5TextConfig, Qwen3Config

    s = dict(SHAPE)
    s.update({k: v for k, v in dict(hidden=hidden, layers=layers, heads=heads, kv_heads=kv_heads,
                                    intermediate=intermediate, vocab=vocab, positions=positions).items()
              if v is not None})
    common = dict(vocab_size=s["vocab"], hidden_size=s["hidden"], num_hidden_layers=s["layers"],
                  num_attention_heads=s["heads"], max_position_embeddings=s["positions"])
    if family in ("llama", "mistral", "qwen3"):
        cls = {"llama": LlamaConfig, "mistral": MistralConfig, "qwen3": Qwen3Config}[family]
        return cls(intermediate_size=s["intermediate"], num_key_value_heads=s["kv_heads"], **common)
    if family == "qwen3_5_text":
        head = s["hidden"] // s["heads"]
        return Qwen3_5TextConfig(intermediate_size=s["intermediate"], num_key_value_heads=s["kv_heads"], head_dim=head,
                                 linear_num_key_heads=s["kv_heads"], linear_num_value_heads=s["heads"],
                                 linear_key_head_dim=head, linear_value_head_dim=head,
                                 layer_types=[("full_attention" if (i + 1) % 4 == 0 else "linear_attention")
                                              for i in range(s["layers"])], **common)
    if family == "opt":
        return OPTConfig(ffn_dim=s["intermediate"], word_embed_proj_dim=s["hidden"], dropout=0.0,
                         attention_dropout=0.0, **common)
    if family == "gpt2":
        return GPT2Config(vocab_size=s["vocab"], n_embd=s["hidden"], n_layer=s["layers"], n_head=s["heads"],
                          n_inner=s["intermediate"], n_positions=s["positions"], resid_pdrop=0.0, embd_pdrop=0.0,
                          attn_pdrop=0.0)
    raise ValueError(f"unknown family {family!r}: choose llama, qwen3, mistral, opt, gpt2 or qwen3_5_text")


def build_checkpoint(family: str, directory: str, seed: int = 0, overrides: dict = None, **shape) -> str:
    """Random-init and save as safetensors unless ``directory`` already holds a checkpoint. ``overrides``:
    config attributes to set (token ids among them go to the generation config too)."""
    from transformers import AutoModelForCausalLM

    if os.path.exists(os.path.join(directory, "config.json")):
        return directory
    config = make_config(family, **shape)
    for key, value in (overrides or {}).items():
        setattr(config, key, value)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    for key, value in (overrides or {}).items():
        if key.endswith("_token_id"):
            setattr(model.generation_config, key, value)
    with torch.no_grad():  # non-trivial norm weights, so a wrong placement would show in the logits
        for p in model.parameters():
            if p.dim() == 1:
                p.add_(torch.randn_like(p) * 0.1)
    tmp = directory + ".partial"
    model.save_pretrained(tmp, safe_serialization=True)
    os.replace(tmp, directory)  # never leave a half-written checkpoint behind
    return directory
