"""Tiny MXFP4 (GPT-OSS) and compressed-tensors FP8 (llm-compressor) checkpoints in the hub's layout, with
reference dequantizations written in plain torch from the stored tensors.

MXFP4, as openai/gpt-oss-* publish it (quant_method "mxfp4"): each expert weight ``experts.X`` of the model,
``[E, in, out]``, is stored transposed as ``experts.X_blocks`` (uint8 ``[E, out, in / 32, 16]``: 32 e2m1 values
per block, two per byte, the low nibble first) and ``experts.X_scales`` (uint8 ``[E, out, in / 32]``: the block's
e8m0 exponent, biased by 127). Every other tensor is bf16.

compressed-tensors FP8 (llm-compressor's FP8 / FP8_DYNAMIC schemes, format "float-quantized"): each quantized
linear ``X.weight`` is float8_e4m3fn with ``X.weight_scale`` ([1] per tensor, [out, 1] per channel, in the
model's dtype or float32) and, for static activations, ``X.input_scale`` ([1]); ``ignore`` (lm_head) is stored
plain."""
from __future__ import annotations

import json
import os

import torch

FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
MXFP4_EXPERTS = ("gate_up_proj", "down_proj")
MXFP4_NOT_CONVERTED = ["model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]
# hidden 64 = 2 MXFP4 blocks (gate_up's blocked dim); MLP 160 = 5 blocks (down_proj's), split 80/80 at tp=2,
# 40 x 4 at tp=4 and 54/53/53 at tp=3, each cutting a block; 8 heads / 4 kv heads of 16
GPT_OSS = dict(vocab_size=128, hidden_size=64, intermediate_size=160, num_hidden_layers=2, num_attention_heads=8,
               num_key_value_heads=4, head_dim=16, num_local_experts=4, num_experts_per_tok=2,
               max_position_embeddings=64, sliding_window=8, layer_types=["sliding_attention", "full_attention"])


def stored_tensors(path: str) -> dict:
    """Every tensor of a single-file checkpoint directory, as stored."""
    from safetensors.torch import load_file

    return load_file(os.path.join(path, "model.safetensors"))


def gpt_oss_config(**overrides):
    from transformers import GptOssConfig

    return GptOssConfig(**{**GPT_OSS, **overrides})


def _edit_checkpoint(directory: str, config, seed: int, convert, quantization_config: dict) -> str:
    from safetensors.torch import load_file, save_file

    from models import save_checkpoint

    save_checkpoint(config, directory, seed=seed)
    path = os.path.join(directory, "model.safetensors")
    tensors = convert(load_file(path), torch.Generator().manual_seed(seed + 1))
    save_file(tensors, path, metadata={"format": "pt"})
    with open(os.path.join(directory, "config.json")) as f:
        saved = json.load(f)
    saved["dtype"] = "bfloat16"
    saved["quantization_config"] = quantization_config
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump(saved, f, indent=2)
    return directory


# ---- MXFP4 ---------------------------------------------------------------------------------------------------

def mxfp4_checkpoint(directory: str, config=None, seed: int = 0, edit=None) -> str:
    """Save ``config``'s random GPT-OSS (default ``gpt_oss_config()``) with its expert weights as MXFP4: random
    nibbles (all 16 codes, -0 included) and random block exponents 2^-9 .. 2^-4, so a block read with a
    neighbour's scale or nibble shows. Every other tensor is bf16. ``edit(tensors)``: a last change."""
    config = config if config is not None else gpt_oss_config()

    def convert(tensors, g):
        out = {}
        for name, w in tensors.items():
            if name.rsplit(".", 1)[-1] in MXFP4_EXPERTS and ".mlp.experts." in name:
                experts, cols, rows = w.shape  # stored transposed: [E, out, in / 32, 16]
                out[name + "_blocks"] = torch.randint(0, 256, (experts, rows, cols // 32, 16), generator=g,
                                                      dtype=torch.uint8)
                out[name + "_scales"] = torch.randint(118, 124, (experts, rows, cols // 32), generator=g,
                                                      dtype=torch.uint8)
            else:
                out[name] = w.to(torch.bfloat16)
        if edit is not None:
            edit(out)
        return out

    return _edit_checkpoint(directory, config, seed, convert,
                            {"quant_method": "mxfp4", "modules_to_not_convert": MXFP4_NOT_CONVERTED})


def mxfp4_reference(blocks: torch.Tensor, scales: torch.Tensor, dtype=torch.float32) -> torch.Tensor:
    """The model's weight ``[E, in, out]`` from ``X_blocks`` / ``X_scales``, written from the format's definition
    (nibble n of byte k of block g is value 2k + n of the block; value x 2^(scale - 127)), then transposed."""
    lut = torch.tensor(FP4_VALUES, dtype=torch.float32)
    codes = torch.stack([blocks & 0x0F, blocks >> 4], dim=-1).flatten(-2).long()  # [..., G, 32]
    values = lut[codes] * torch.exp2(scales.float() - 127)[..., None]
    return values.flatten(-2).transpose(-1, -2).to(dtype)


def transformers_mxfp4(directory: str, dtype=torch.float32, output_loading_info: bool = False):
    """transformers' own dequantized GPT-OSS: from_pretrained with Mxfp4Config(dequantize=True) (the path it
    also falls back to on CPU without Triton kernels)."""
    from transformers import AutoModelForCausalLM, Mxfp4Config

    return AutoModelForCausalLM.from_pretrained(directory, dtype=dtype, output_loading_info=output_loading_info,
                                                quantization_config=Mxfp4Config(dequantize=True))


# ---- compressed-tensors FP8 ----------------------------------------------------------------------------------

# llm-compressor's FP8 scheme on the attention (a float32 scale per tensor, static input scales) and its
# FP8_DYNAMIC scheme on the MLP (a bf16 scale per output channel, activations quantized per token at run time)
CT_GROUPS = {
    "group_0": dict(targets=[r"re:.*self_attn\..*"], strategy="tensor", dynamic=False, scale_dtype=torch.float32),
    "group_1": dict(targets=[r"re:.*mlp\..*"], strategy="channel", dynamic=True, scale_dtype=torch.bfloat16),
}


def ct_quantization_config(groups=None, fmt: str = "float-quantized", ignore=("lm_head",)) -> dict:
    """The quantization_config llm-compressor writes for FP8 groups (``CT_GROUPS`` by default)."""
    config_groups = {}
    for name, g in (groups or CT_GROUPS).items():
        inputs = ({"num_bits": 8, "type": "float", "strategy": "token", "dynamic": True, "symmetric": True}
                  if g["dynamic"] else {"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False,
                                        "symmetric": True, "observer": "minmax"})
        weights = {"num_bits": 8, "type": "float", "strategy": g["strategy"], "dynamic": False, "symmetric": True,
                   "observer": "minmax", "group_size": None, "block_structure": None}
        config_groups[name] = {"targets": list(g["targets"]), "weights": weights, "input_activations": inputs,
                               "output_activations": None, "format": fmt}
    return {"quant_method": "compressed-tensors", "format": fmt, "quantization_status": "compressed",
            "config_groups": config_groups, "ignore": list(ignore), "kv_cache_scheme": None, "sparsity_config": {},
            "transform_config": {}, "global_compression_ratio": None}


def _group_of(module: str, groups: dict):
    import re

    return next((g for g in groups.values() if any(re.match(t[3:], module) for t in g["targets"])), None)


def ct_fp8_checkpoint(directory: str, config, seed: int = 0, groups=None, ignore=("lm_head",), edit=None) -> str:
    """Save ``config``'s random model with its linear weights as compressed-tensors FP8 by ``groups`` (default
    ``CT_GROUPS``; ``ignore`` stored plain): absmax scales per tensor or per output channel, each row first scaled
    by a random factor so a row read with another's scale shows; ``input_scale`` per tensor where the activations
    are static. Every other tensor is bf16. ``edit(tensors)``: a last change."""
    groups = groups or CT_GROUPS

    def convert(tensors, g):
        out = {}
        for name, w in tensors.items():
            module = name[:-len(".weight")]
            group = _group_of(module, groups) if name.endswith("proj.weight") and module not in ignore else None
            if group is None:
                out[name] = w.to(torch.bfloat16)
                continue
            w = w.float() * (torch.rand(w.shape[0], 1, generator=g) * 7.5 + 0.5)
            absmax = w.abs().amax() if group["strategy"] == "tensor" else w.abs().amax(dim=1, keepdim=True)
            scale = (absmax / 448.0).clamp(min=1e-12).to(group["scale_dtype"])
            out[name] = (w / scale.float()).clamp(-448, 448).to(torch.float8_e4m3fn)
            out[module + ".weight_scale"] = scale.reshape(1) if group["strategy"] == "tensor" else scale
            if not group["dynamic"]:
                out[module + ".input_scale"] = (torch.rand(1, generator=g) * 0.1).to(group["scale_dtype"])
        if edit is not None:
            edit(out)
        return out

    return _edit_checkpoint(directory, config, seed, convert, ct_quantization_config(groups, ignore=ignore))


def ct_fp8_reference(weight: torch.Tensor, scale: torch.Tensor, dtype=torch.float32) -> torch.Tensor:
    """compressed-tensors' dequantization, from its definition: the float8 weight in the scale's dtype, times
    the scale (broadcast over a row, or over the tensor), then cast to ``dtype``."""
    return (weight.to(scale.dtype) * scale).to(dtype)


def transformers_ct(directory: str, dtype=torch.float32, output_loading_info: bool = False):
    """transformers' own decompressed model: from_pretrained with CompressedTensorsConfig(dequantize=True)
    (compressed-tensors' decompression, dense layers, activations unquantized)."""
    import warnings

    from transformers import AutoModelForCausalLM, CompressedTensorsConfig

    with warnings.catch_warnings():  # "the quantization_config from the model will be used", but dequantize=True
        warnings.simplefilter("ignore", UserWarning)
        return AutoModelForCausalLM.from_pretrained(directory, dtype=dtype, output_loading_info=output_loading_info,
                                                    quantization_config=CompressedTensorsConfig(dequantize=True))
