"""Tiny fine-grained FP8 checkpoints in the hub's layout (as DeepSeek-V3/R1 and Qwen3-*-FP8 publish them).

Each quantized linear weight is stored as float8_e4m3fn with ``weight_scale_inv`` (float32) of shape
[ceil(out / 128), ceil(in / 128)]: value = fp8 value x the scale of its 128 x 128 block. Layers in
``modules_to_not_convert`` (lm_head, and one o_proj here) and every other tensor are stored normally (bf16)."""
from __future__ import annotations

import json
import os

import torch

BLOCK = (128, 128)
NOT_CONVERTED = ("lm_head", "model.layers.1.self_attn.o_proj")
# 128-multiples everywhere (transformers' dequantize=True path reads them), cut by the splits: q rows 256 (tp=3:
# 128/64/64 by kv group), k/v rows 128 (tp=2: 64/64), MLP 640 (tp=2: 320/320, tp=3: 214/213/213), hidden 256
ALIGNED = dict(vocab_size=128, hidden_size=256, intermediate_size=640, num_hidden_layers=2, num_attention_heads=8,
               num_key_value_heads=4, head_dim=32, max_position_embeddings=64)
# partial blocks at the end of a dimension: hidden 192 (1.5 blocks), MLP 320 (2.5 blocks), k/v rows 96
UNALIGNED = dict(vocab_size=128, hidden_size=192, intermediate_size=320, num_hidden_layers=2, num_attention_heads=6,
                 num_key_value_heads=3, head_dim=32, max_position_embeddings=64)


def quantize_blocks(w: torch.Tensor, block=BLOCK, generator=None):
    """(float8 weight, float32 weight_scale_inv) of ``w`` in blocks (partial at the ends), each block's absmax
    mapped to 448 as transformers' Fp8Quantize does; every block scaled first by a random factor so a block
    read with a neighbour's scale shows."""
    rows, cols = w.shape
    bm, bn = block
    nr, nc = -(-rows // bm), -(-cols // bn)
    factor = torch.rand(nr, nc, generator=generator) * 7.5 + 0.5
    padded = torch.zeros(nr * bm, nc * bn)
    padded[:rows, :cols] = w.float()
    blocks = padded.reshape(nr, bm, nc, bn) * factor[:, None, :, None]
    scale = (blocks.abs().amax(dim=(1, 3)) / 448.0).clamp(min=1e-12)
    q = (blocks / scale[:, None, :, None]).reshape(nr * bm, nc * bn)[:rows, :cols].to(torch.float8_e4m3fn)
    return q.contiguous(), scale.float()


def fp8_checkpoint(directory: str, config, seed: int = 0, not_converted=NOT_CONVERTED, edit=None) -> str:
    """Save ``config``'s random model, then store its linear weights (except ``not_converted``) as fine-grained
    FP8 and every other tensor as bf16, with the hub's quantization_config. ``edit(tensors)``: a last change."""
    from safetensors.torch import load_file, save_file

    from models import save_checkpoint

    save_checkpoint(config, directory, seed=seed)
    path = os.path.join(directory, "model.safetensors")
    tensors = load_file(path)
    g = torch.Generator().manual_seed(seed + 1)
    for name in sorted(tensors):
        w = tensors[name]
        module = name[:-len(".weight")]
        if name.endswith("proj.weight") and w.dim() == 2 and module not in not_converted:
            tensors[name], tensors[module + ".weight_scale_inv"] = quantize_blocks(w, generator=g)
        else:
            tensors[name] = w.to(torch.bfloat16)
    if edit is not None:
        edit(tensors)
    save_file(tensors, path, metadata={"format": "pt"})
    with open(os.path.join(directory, "config.json")) as f:
        saved = json.load(f)
    saved["dtype"] = "bfloat16"
    saved["quantization_config"] = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                                    "weight_block_size": list(BLOCK), "modules_to_not_convert": list(not_converted)}
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump(saved, f, indent=2)
    return directory


def transformers_dequantized(directory: str, dtype=torch.float32):
    """transformers' own dequantized model: from_pretrained with FineGrainedFP8Config(dequantize=True) (its
    Fp8Dequantize, the path it takes on CPU). It derives the block from the scale grid, so it reads only
    weights whose dimensions are multiples of the block."""
    from transformers import AutoModelForCausalLM, FineGrainedFP8Config

    return AutoModelForCausalLM.from_pretrained(directory, dtype=dtype,
                                                quantization_config=FineGrainedFP8Config(dequantize=True)).eval()


def dequantized_copy(src: str, dst: str) -> str:
    """A float32 copy of the fp8 checkpoint ``src``, each weight dequantized by transformers' FP8Linear
    dequantization (``_dequantize_fp8_weight``: the config's block, partial blocks at the ends, as its FP8 kernels
    read them): the reference where the dimensions are not multiples of the block."""
    from safetensors.torch import load_file, save_file
    from transformers.integrations.finegrained_fp8 import _dequantize_fp8_weight

    os.makedirs(dst, exist_ok=True)
    tensors = load_file(os.path.join(src, "model.safetensors"))
    out = {}
    for name, t in tensors.items():
        if name.endswith("_scale_inv"):
            continue
        scale = tensors.get(name + "_scale_inv")
        out[name] = (_dequantize_fp8_weight(t, scale, list(BLOCK), torch.float32) if scale is not None
                     else t.to(torch.float32))
    save_file(out, os.path.join(dst, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(src, "config.json")) as f:
        config = json.load(f)
    del config["quantization_config"]
    config["dtype"] = "float32"
    with open(os.path.join(dst, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    return dst
