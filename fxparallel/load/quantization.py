"""Quantized checkpoints: loaded exactly (dequantized on load) or refused by name before anything is captured
or read, never loaded silently wrong.

A checkpoint whose config.json has a ``quantization_config`` stores its weights in another form (fine-grained
FP8 with ``weight_scale_inv`` block scales, MXFP4 ``*_blocks`` / ``*_scales``, packed integers of GPTQ / AWQ /
bitsandbytes, ...): read as plain tensors they give wrong numbers (FP8 cast without its scales) or missing
weights.

Three forms are dequantized on load, each rank reading only its own slice of a weight and the scales that cover
it, so the parallel model holds the weights transformers' ``dequantize=True`` gives (``loaded_format``):

- fine-grained FP8 as DeepSeek-V3/R1 and Qwen3-*-FP8 publish it (``quant_method`` "fp8" with a 2-D
  ``weight_block_size``, float scales, dynamic activations): ``fp8.py``;
- MXFP4 as GPT-OSS publishes it (``quant_method`` "mxfp4", the experts as ``X_blocks`` / ``X_scales``):
  ``mxfp4.py``;
- compressed-tensors FP8 as llm-compressor writes it (``quant_method`` "compressed-tensors", FP8 weights with
  scales per tensor or per channel, activations left in the compute dtype): ``compressed_tensors.py``.

Every other ``quant_method`` transformers knows, and the variants of these three that fxparallel does not read
(per-tensor or ue8m0 fine-grained scales, FP4 experts, static activation scales, MXFP4 outside GPT-OSS, integer or
FP4 compressed-tensors schemes, ...), are refused, naming them and what to do. A transformers model passed in is
accepted when its weights are plain floating tensors (e.g. loaded with ``dequantize=True``), refused when they are
still quantized."""
from __future__ import annotations

import copy
import logging
from typing import Optional

import torch

from ..errors import CheckpointError
from . import compressed_tensors
from .dequantize import Format
from .fp8 import FineGrainedFp8
from .mxfp4 import Mxfp4

log = logging.getLogger("fxparallel")

_FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
_ADVICE = ("dequantize it with transformers and save the result, then parallelize that directory: e.g. "
           "AutoModelForCausalLM.from_pretrained(path, quantization_config=<its config class>(dequantize=True)) "
           "where the method supports it (fp8, mxfp4, compressed-tensors, ...), then .save_pretrained(out_dir); or "
           "use the checkpoint's unquantized original")
SUPPORTED = ("fine-grained FP8 (quant_method 'fp8' with a 2-D weight_block_size), MXFP4 (quant_method 'mxfp4', "
             "GPT-OSS's experts) and compressed-tensors FP8 (quant_method 'compressed-tensors', FP8 weights with "
             "scales per tensor or per channel), each dequantized on load")
READ = ("fp8", "mxfp4", compressed_tensors.METHOD)  # the quant_methods some of whose forms are read
MXFP4_MODELS = ("gpt_oss",)  # transformers dequantizes MXFP4 experts of these only (its GptOssMLP)


def _field(found, name: str, default=None):
    value = found.get(name, default) if isinstance(found, dict) else getattr(found, name, default)
    return getattr(value, "value", value)  # an enum in transformers' config classes


def quant_method(config):
    """The ``quant_method`` named by ``config.quantization_config`` (dict or object), None when unquantized."""
    found = getattr(config, "quantization_config", None)
    if found is None:
        return None
    method = _field(found, "quant_method")
    return str(method) if method is not None else "unknown"


def _fp8_unsupported(found) -> Optional[str]:
    """Why the fp8 ``quantization_config`` ``found`` is not fine-grained FP8 fxparallel reads; None if it is."""
    block = _field(found, "weight_block_size")
    if block is None:
        return ("it has no weight_block_size (per-tensor scales, or a block size left to a default): fxparallel reads "
                "block-wise scales only")
    if (not isinstance(block, (list, tuple)) or len(block) != 2
            or not all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in block)):
        return f"its weight_block_size {block!r} is not two positive integers"
    scale_fmt = _field(found, "scale_fmt", "float")
    if scale_fmt not in (None, "float"):
        return f"its scale_fmt is {scale_fmt!r}: fxparallel reads float scales only"
    scheme = _field(found, "activation_scheme", "dynamic")
    if scheme not in (None, "dynamic"):
        return f"its activation_scheme is {scheme!r} (static activation scales): fxparallel reads 'dynamic' only"
    experts = _field(found, "expert_dtype", "fp8")
    if experts not in (None, "fp8"):
        return f"its expert_dtype is {experts!r}: fxparallel reads fp8 experts only"
    if _field(found, "modules_to_convert"):
        return "it quantizes embeddings (modules_to_convert): fxparallel reads quantized linear weights only"
    return None


def _mxfp4_unsupported(config) -> Optional[str]:
    model_type = getattr(config, "model_type", None)
    if model_type not in MXFP4_MODELS:
        return (f"transformers dequantizes MXFP4 experts of {' / '.join(MXFP4_MODELS)} only, and this config is a "
                f"{model_type!r}")
    return None


def _unsupported(config) -> Optional[str]:
    """Why the quantization of ``config`` (a method in ``READ``) is not a form fxparallel reads; None if it is."""
    method, found = quant_method(config), config.quantization_config
    if method == "fp8":
        return _fp8_unsupported(found)
    if method == "mxfp4":
        return _mxfp4_unsupported(config)
    return compressed_tensors.unsupported(found)


def fp8_block_size(config) -> Optional[tuple]:
    """(rows, cols) of the blocks of a fine-grained FP8 checkpoint fxparallel dequantizes; None otherwise."""
    found = getattr(config, "quantization_config", None)
    if found is None or quant_method(config) != "fp8" or _fp8_unsupported(found) is not None:
        return None
    return tuple(int(b) for b in _field(found, "weight_block_size"))


def loaded_format(config) -> Optional[Format]:
    """How the checkpoint of ``config`` is dequantized on load; None when it is not quantized (or refused)."""
    method = quant_method(config)
    if method not in READ or _unsupported(config) is not None:
        return None
    if method == "fp8":
        return FineGrainedFp8(fp8_block_size(config))
    if method == "mxfp4":
        return Mxfp4()
    return compressed_tensors.CompressedTensorsFp8(config.quantization_config)


def _known() -> str:
    try:
        from transformers.quantizers.auto import AUTO_QUANTIZATION_CONFIG_MAPPING
    except ImportError:  # pragma: no cover - transformers moved it
        return "none"
    return ", ".join(sorted(m for m in AUTO_QUANTIZATION_CONFIG_MAPPING if m not in READ))


def check_checkpoint_not_quantized(config, where: str) -> None:
    """Refuse a checkpoint (hub id, directory or config) whose config declares a quantization fxparallel does
    not read; the forms of ``loaded_format`` pass: they are dequantized on load."""
    method = quant_method(config)
    if method is None or loaded_format(config) is not None:
        return
    why = f" ({_unsupported(config)})" if method in READ else ""
    raise CheckpointError(
        f"{where} is quantized (quantization_config.quant_method={method!r}){why}; fxparallel does not load these "
        f"quantized weights (it loads {SUPPORTED}; none of transformers' other methods: {_known()}), and reading "
        f"them as plain tensors would be wrong. To parallelize it, {_ADVICE}")


def check_model_not_quantized(model) -> None:
    """Refuse a transformers model whose parameters are still quantized (not plain floating tensors)."""
    odd = [(n, p.dtype) for n, p in model.named_parameters() if p.dtype not in _FLOATS]
    if odd:
        name, dtype = odd[0]
        method = quant_method(model.config)
        raise CheckpointError(
            f"the {type(model).__name__} passed holds quantized weights ({name} is {dtype}"
            f"{f', quant_method={method!r}' if method else ''}; {len(odd)} such parameter(s)); fxparallel takes "
            f"floating-point weights: {_ADVICE}")


def config_for_float_weights(config, dtype=None):
    """The config to save next to the floating weights of a model loaded from a quantized checkpoint: a copy
    without ``quantization_config`` (with it, transformers would read the saved floats as FP8 weights missing
    their scales). ``config`` itself when it has none."""
    if getattr(config, "quantization_config", None) is None:
        return config
    method = quant_method(config)
    config = copy.deepcopy(config)
    del config.quantization_config
    log.info("the weights were dequantized from %s on load: saving them as %s, in a config without "
             "quantization_config", method, str(dtype).replace("torch.", "") if dtype is not None else "floats")
    return config
