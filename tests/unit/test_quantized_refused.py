"""Quantized checkpoints are loaded exactly or refused by name before anything is captured or read: fine-grained
FP8 (float8 weights with weight_scale_inv block scales, a 2-D weight_block_size) is dequantized on load
(tests/test_fp8_loading.py checks its numbers); FP8 without block scales or with scales fxparallel does not read,
every other quant_method transformers knows, and a transformers model whose weights are still quantized are
refused. A dequantized model is accepted."""
from __future__ import annotations

import json
import os

import pytest


def _fp8_checkpoint(directory: str) -> str:
    """The tiny Llama with its linear weights as DeepSeek-V3 / Qwen3-FP8 publish them: float8_e4m3fn weights
    and float32 weight_scale_inv of shape [ceil(out/128), ceil(in/128)], quant_method "fp8"."""
    import torch
    from safetensors.torch import load_file, save_file

    from models import save_checkpoint, tiny_config

    save_checkpoint(tiny_config("llama"), directory)
    path = os.path.join(directory, "model.safetensors")
    tensors = load_file(path)
    for name in [n for n in tensors if n.endswith("proj.weight")]:
        w = tensors[name]
        scale = w.abs().max() / 448.0
        tensors[name] = (w / scale).to(torch.float8_e4m3fn)
        tensors[name[:-len("weight")] + "weight_scale_inv"] = torch.full(
            (-(-w.shape[0] // 128), -(-w.shape[1] // 128)), float(scale))
    save_file(tensors, path, metadata={"format": "pt"})
    with open(os.path.join(directory, "config.json")) as f:
        config = json.load(f)
    config["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3",
                                     "weight_block_size": [128, 128]}
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump(config, f)
    return directory


def test_fp8_checkpoint_is_planned_and_fp8_without_blocks_refused_by_name(tmp_path):
    import fxparallel
    from fxparallel.errors import CheckpointError

    path = _fp8_checkpoint(str(tmp_path / "fp8"))
    assert fxparallel.plan_model(path, 2) is not None  # fine-grained FP8: dequantized on load
    with open(os.path.join(path, "config.json")) as f:
        config = json.load(f)
    config["quantization_config"]["weight_block_size"] = None  # per-tensor scales
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f)
    with pytest.raises(CheckpointError, match=r"is quantized \(quantization_config.quant_method='fp8'\) \(it has no "
                                              r"weight_block_size .*\); fxparallel does not load these quantized "
                                              r"weights .*dequantize=True"):
        fxparallel.plan_model(path, 2)


@pytest.mark.parametrize("field, value", [("weight_block_size", [128]), ("scale_fmt", "ue8m0"),
                                          ("activation_scheme", "static"), ("expert_dtype", "fp4"),
                                          ("modules_to_convert", ["model.embed_tokens"])])
def test_fp8_variants_fxparallel_does_not_read_are_refused_by_name(field, value):
    import fxparallel
    from fxparallel.errors import CheckpointError
    from models import tiny_config

    config = tiny_config("llama")
    config.quantization_config = {"quant_method": "fp8", "weight_block_size": [128, 128], field: value}
    with pytest.raises(CheckpointError, match=rf"quant_method='fp8'\) \(it.*{field}"):
        fxparallel.plan_model(config, 2)


@pytest.mark.parametrize("method", sorted(__import__(
    "transformers.quantizers.auto", fromlist=["AUTO_QUANTIZATION_CONFIG_MAPPING"]).AUTO_QUANTIZATION_CONFIG_MAPPING))
def test_every_quant_method_is_refused(method):
    import fxparallel
    from fxparallel.errors import CheckpointError
    from models import tiny_config

    config = tiny_config("llama")
    config.quantization_config = {"quant_method": method}
    with pytest.raises(CheckpointError, match=f"quant_method='{method}'"):
        fxparallel.plan_model(config, 2)


def test_quantized_transformers_model_is_refused_and_a_float_one_accepted():
    import torch
    from transformers import AutoModelForCausalLM

    import fxparallel
    from fxparallel.errors import CheckpointError
    from models import tiny_config

    model = AutoModelForCausalLM.from_config(tiny_config("llama"))
    assert fxparallel.plan_model(model, 2)[0] is not None
    with torch.no_grad():
        model.model.layers[0].mlp.up_proj.weight.data = model.model.layers[0].mlp.up_proj.weight.to(torch.float8_e4m3fn)
    with pytest.raises(CheckpointError, match=r"holds quantized weights \(model.layers.0.mlp.up_proj.weight is "
                                              r"torch.float8_e4m3fn"):
        fxparallel.plan_model(model, 2)
