"""compressed-tensors FP8 checkpoints (llm-compressor's FP8 and FP8_DYNAMIC schemes), dequantized on load.

``quant_method`` "compressed-tensors" with format "float-quantized" (or "naive-quantized"), and config groups
whose weights are ``num_bits: 8, type: float``, static and symmetric, with one scale per tensor or per output
channel: a quantized linear stores ``X.weight`` as float8_e4m3fn and ``X.weight_scale`` (``[1]`` per tensor,
``[out, 1]`` per channel, usually in the model's dtype). compressed-tensors dequantizes it as
``weight.to(scale.dtype) * scale`` (in the scale's dtype), then transformers casts it to the parameter's dtype;
``read_dequantized`` (``fp8.py``) does the same on each piece of a rank's slice, a channel scale being a block of
one row (a row-parallel slice keeps its rows' scales whole, a column-parallel one reads the scales of its rows
only) and a tensor scale one block, so the weights equal transformers' ``dequantize=True`` model bit for bit.
transformers dequantizes the tensors its conversion mapping merges (per-expert weights stacked into 3-D experts,
Qwen3-MoE's) in float32 instead (``float32(weight) * float32(scale)``), and so do their pieces here; in bf16 both
products round to the same values.

Activations: the schemes also quantize each linear's input to FP8 (per token, dynamically, or per tensor with a
stored ``X.input_scale``). A model loaded with dequantized weights runs its activations in the compute dtype, as
transformers' ``CompressedTensorsConfig(dequantize=True)`` does (it loads no activation quantization and leaves
the input scales unused); ``X.input_scale`` is therefore not read (nor reported unused), and the numbers are those
of that model, not of an FP8 kernel. Every other compressed-tensors scheme (integer weights, W4A16
pack-quantized, NVFP4 / MXFP4 / MXFP8, group or block scales, zero points, output or KV-cache quantization,
sparsity, transforms) is refused by name before anything is captured.
"""
from __future__ import annotations

from typing import Optional

import torch

from .dequantize import companion
from .fp8 import FP8_DTYPES, ScaledFp8, is_fp8

METHOD = "compressed-tensors"
FORMATS = ("float-quantized", "naive-quantized")
STRATEGIES = ("tensor", "channel")
SCALE, INPUT_SCALE = "_scale", "input_scale"  # "X.weight" -> "X.weight_scale"; "X.input_scale"


def as_dict(found) -> dict:
    """A quantization_config as the dict config.json holds (transformers' config objects included)."""
    if isinstance(found, dict):
        return found
    to_dict = getattr(found, "to_dict", None)
    return to_dict() if callable(to_dict) else dict(vars(found))


def _value(v):
    return getattr(v, "value", v)  # compressed-tensors' enums


def _group_unsupported(name: str, group: dict, fmt) -> Optional[str]:
    """Why config group ``name`` is not FP8 weights fxparallel reads; None if it is."""
    weights = group.get("weights") or None
    if weights is None:
        return f"its config group {name!r} quantizes no weights"
    kind, bits = _value(weights.get("type")), weights.get("num_bits")
    strategy = _value(weights.get("strategy"))
    scheme = f"{kind} {bits}-bit weights, strategy {strategy!r}"
    fmt = _value(group.get("format")) or fmt
    if kind != "float" or bits != 8:
        return (f"its config group {name!r} quantizes {scheme} (format {fmt!r}): fxparallel reads FP8 weights "
                "(num_bits 8, type float) only")
    if strategy not in STRATEGIES:
        return (f"its config group {name!r} quantizes {scheme}: fxparallel reads FP8 scales per tensor or per "
                "channel only")
    if fmt not in FORMATS:
        return f"its config group {name!r} is stored in format {fmt!r}: fxparallel reads {' / '.join(FORMATS)}"
    if weights.get("dynamic"):
        return f"its config group {name!r} quantizes weights dynamically (no stored scales)"
    if weights.get("symmetric") is False:
        return f"its config group {name!r} has asymmetric weights (zero points): fxparallel reads symmetric only"
    if group.get("output_activations"):
        return f"its config group {name!r} quantizes output activations"
    return None


def unsupported(found) -> Optional[str]:
    """Why the compressed-tensors ``quantization_config`` ``found`` is not FP8 fxparallel reads; None if it is."""
    config = as_dict(found)
    groups = config.get("config_groups") or {}
    if not groups:
        return "it has no config_groups (nothing fxparallel can dequantize)"
    if config.get("kv_cache_scheme"):
        return "it quantizes the KV cache (kv_cache_scheme)"
    sparsity = config.get("sparsity_config") or {}
    if _value(sparsity.get("format", "dense")) not in (None, "dense"):
        return f"it is sparse (sparsity_config format {_value(sparsity.get('format'))!r})"
    if config.get("transform_config"):
        return "it applies transforms (transform_config)"
    for name, group in groups.items():
        why = _group_unsupported(name, as_dict(group), _value(config.get("format")))
        if why is not None:
            return why
    return None


def strategies(found) -> list:
    """The weight scale strategies of a readable config, e.g. ["channel"]."""
    groups = as_dict(found).get("config_groups") or {}
    return sorted({_value(as_dict(g)["weights"]["strategy"]) for g in groups.values()})


def scale_name(tensor: str) -> str:
    return tensor + SCALE


def input_scale_name(tensor: str) -> Optional[str]:
    return tensor[:-len("weight")] + INPUT_SCALE if tensor.endswith(".weight") else None


PER_TENSOR = ((), (1,), (1, 1))  # the shapes of a scale per tensor


def _grid(shape: tuple, scale_shape: tuple) -> Optional[tuple]:
    """The block (rows, cols) each scale covers: the whole weight for a scale per tensor (``PER_TENSOR``), a row
    for ``[out, 1]``; None for any other shape."""
    rows, cols = shape
    if tuple(scale_shape) in PER_TENSOR:
        return rows, cols
    if tuple(scale_shape) == (rows, 1):
        return 1, cols
    return None


class CompressedTensorsFp8(ScaledFp8):
    """quant_method "compressed-tensors", FP8 weights with ``weight_scale`` per tensor or per channel."""

    def __init__(self, found):
        self.label = f"compressed-tensors fp8 ({' and '.join(f'per-{s}' for s in strategies(found))} scales)"

    def scale_name(self, tensor: str) -> str:
        return scale_name(tensor)

    def companions(self, tensor: str, stored) -> list:
        names = [scale_name(tensor), input_scale_name(tensor),  # input scales: activations run unquantized
                 tensor + "_zero_point"]  # refused by ``problem``
        return [n for n in names if n is not None and n in stored]

    def problem(self, tensor: str, header, stored) -> Optional[str]:
        info, path = header(tensor)
        scale = scale_name(tensor)
        scale_info = header(scale)[0] if scale in stored else None
        if tensor + "_zero_point" in stored:
            return (f"tensor {tensor!r} in {path} has zero points ({tensor + '_zero_point'!r}): fxparallel reads "
                    "symmetric compressed-tensors FP8 only")
        if not is_fp8(info):
            return self.scales_on_float(tensor, info, path, scale_info)
        if scale_info is None:
            return (f"tensor {tensor!r} in {path} is {info.torch_dtype} but the checkpoint has no {scale!r}: "
                    "compressed-tensors FP8 needs the scale of every float8 weight to dequantize it")
        if len(info.shape) != 2:
            return (f"tensor {tensor!r} in {path} is a {len(info.shape)}-D {info.torch_dtype} tensor; FP8 linear "
                    "weights are 2-D")
        dtype = scale_info.torch_dtype
        if dtype is None or not dtype.is_floating_point or dtype in FP8_DTYPES:
            return (f"tensor {scale!r} has dtype {scale_info.dtype}; fxparallel reads float scales only (float32, "
                    "bfloat16, float16)")
        if _grid(info.shape, scale_info.shape) is None:
            return (f"tensor {scale!r} has shape {list(scale_info.shape)}, but {tensor!r} of shape {list(info.shape)} "
                    f"needs [1] (a scale per tensor) or [{info.shape[0]}, 1] (per output channel)")
        return None

    def scales_of(self, tensor: str, index: tuple, info, header, shared: dict, merged: bool) -> tuple:
        scale_info, _ = header(scale_name(tensor))
        if tuple(scale_info.shape) in PER_TENSOR:  # the one scale, as stored
            sindex = tuple((0, n) for n in scale_info.shape)
        else:  # per channel: the scales of the piece's rows
            sindex = (index[0], (0, 1))
        read = companion(scale_name(tensor), sindex, header, shared, torch.float32 if merged else None)
        return read.out.reshape(-1, 1), _grid(info.shape, scale_info.shape)
