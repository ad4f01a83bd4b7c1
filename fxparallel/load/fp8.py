"""Fine-grained FP8 weights, dequantized piece by piece while a rank reads its slice.

The layout DeepSeek-V3/R1 and Qwen3-*-FP8 publish (transformers' ``FineGrainedFP8Config``, quant_method
"fp8"): a quantized weight ``X.weight`` of shape ``[..., rows, cols]`` is stored as float8 (e4m3fn), next to
``X.weight_scale_inv`` (float32) of shape ``[..., ceil(rows / bm), ceil(cols / bn)]`` for the config's
``weight_block_size`` ``[bm, bn]``; element ``[i, j]`` is ``float(weight[i, j]) * scale[i // bm, j // bn]``
(the last blocks of a dimension that ``bm`` / ``bn`` does not divide are partial). Layers left unquantized
(``modules_to_not_convert``: the embeddings, lm_head, norms, routers ...) are stored as plain tensors and read as
any other.

A piece ``weight[..., r0:r1, c0:c1]`` of a rank's slice (slices may cut through a block, be uneven or made of
several segments) needs the float8 bytes of the piece alone and the scale blocks
``[r0 // bm .. (r1 - 1) // bm] x [c0 // bn .. (c1 - 1) // bn]`` that cover it. Both are read with the same
``pread`` path as every other tensor, and the product is formed in float32 on row chunks whose temporaries take
at most ``STAGING_BYTES`` (each scale expanded to its block and cropped to the chunk), then cast to the parameter's
dtype: the same arithmetic as transformers' ``Fp8Dequantize`` (``float32(weight) * float32(scale)``, then the
cast), so the values equal its dequantized model bit for bit. No rank dequantizes (nor reads) a whole tensor
that it does not keep whole. ``read_dequantized`` serves compressed-tensors' per-tensor and per-channel FP8 too
(``compressed_tensors.py``): a scale per channel is a block of one row, a scale per tensor one block.
"""
from __future__ import annotations

import math
from typing import Optional

import torch

from .dequantize import Format, Piece, companion
from .safetensors_io import STAGING_BYTES, byte_runs, normalize_index

FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
SCALE_SUFFIX = "_scale_inv"  # "X.weight" -> "X.weight_scale_inv"
# per element of a chunk: the float8 byte, it and its scale in float32, their product, the cast
TEMPORARY_BYTES = 16


def scale_name(tensor: str) -> str:
    return tensor + SCALE_SUFFIX


def is_fp8(info) -> bool:
    return info is not None and info.torch_dtype in FP8_DTYPES


def expected_scale_shape(shape: tuple, block: tuple) -> tuple:
    """The shape of the scales of a weight of ``shape``: its leading dims, then ceil(rows / bm), ceil(cols / bn)."""
    return tuple(shape[:-2]) + tuple(-(-n // b) for n, b in zip(shape[-2:], block))


def check_pair(weight: str, info, scale_info, block: tuple, path: str) -> Optional[str]:
    """Why the float8 tensor ``weight`` (header ``info``) and its scales cannot be dequantized; None if they can."""
    if scale_info is None:
        return (f"tensor {weight!r} in {path} is {info.torch_dtype} but the checkpoint has no "
                f"{scale_name(weight)!r}: fine-grained FP8 (quant_method 'fp8') needs the block scales of every float8 "
                "weight to dequantize it")
    if len(info.shape) < 2:
        return f"tensor {weight!r} in {path} is a {len(info.shape)}-D {info.torch_dtype} tensor; block scales need 2-D"
    dtype = scale_info.torch_dtype
    if dtype is None or not dtype.is_floating_point or dtype in FP8_DTYPES:
        return (f"tensor {scale_name(weight)!r} has dtype {scale_info.dtype}; fxparallel reads float scales only "
                "(float32, bfloat16, float16)")
    expected = expected_scale_shape(info.shape, block)
    if tuple(scale_info.shape) != expected:
        return (f"tensor {scale_name(weight)!r} has shape {list(scale_info.shape)}, but {weight!r} of shape "
                f"{list(info.shape)} in blocks of {list(block)} (weight_block_size) needs {list(expected)}")
    return None


def scale_index(index: tuple, block: tuple) -> tuple:
    """The index of the scales covering ``weight[index]`` (``index``: (start, stop) per dim, non-empty)."""
    lead = tuple(index[:-2])
    blocked = tuple((a // b, (z - 1) // b + 1) for (a, z), b in zip(index[-2:], block))
    return lead + blocked


def read_dequantized(handle, tensor: str, source: tuple, out: torch.Tensor, scales: torch.Tensor,
                     block: tuple) -> int:
    """Write ``dequantize(tensor)[source]`` into ``out`` (any dtype, device or strides): the float8 bytes of the
    piece are read from ``handle`` (an open ``SafetensorsFile``), ``scales``: the scale blocks covering the
    piece (``scale_index``), in the dtype the product is formed in (the weight is cast to it), then cast to
    ``out``'s. Returns the bytes read."""
    info = handle.tensors[tensor]
    index = normalize_index(info.shape, source)
    if any(b <= a for a, b in index):
        return 0
    (r0, r1), (c0, c1) = index[-2:]
    bm, bn = block
    lead = tuple(b - a for a, b in index[:-2])
    per_row = max(1, math.prod(lead) * (c1 - c0) * TEMPORARY_BYTES)
    step = max(bm, STAGING_BYTES // per_row // bm * bm)  # rows per chunk, whole blocks (except at the ends)
    cols = torch.arange(c0, c1) // bn - c0 // bn  # the scale column of each column of the piece
    lead_index = tuple(slice(a, b) for a, b in index[:-2])
    nbytes = 0
    start = r0
    while start < r1:
        stop = min(r1, (start // step + 1) * step)
        q = torch.empty(lead + (stop - start, c1 - c0), dtype=info.torch_dtype)
        nbytes += handle.read_into(tensor, lead_index + (slice(start, stop), slice(c0, c1)), q)
        rows = torch.arange(start, stop) // bm - r0 // bm
        s = scales.index_select(-2, rows).index_select(-1, cols)  # each scale over its block, cropped
        out[..., start - r0:stop - r0, :].copy_(q.to(s.dtype).mul_(s))  # the copy casts
        start = stop
    return nbytes


class ScaledFp8(Format):
    """float8 weights with float scales (a scale per block, channel or tensor), dequantized by
    ``read_dequantized``; a subclass names the scales and says which of them cover a piece."""

    def scale_name(self, tensor: str) -> str:
        raise NotImplementedError

    def scales_of(self, tensor: str, index: tuple, info, header, shared: dict, merged: bool) -> tuple:
        """(the ``Companion`` read of the scales covering ``tensor[index]``, as a 2-D grid; the block (rows,
        cols) each scale covers)."""
        raise NotImplementedError

    def scales_on_float(self, tensor: str, info, path: str, scale_info) -> Optional[str]:
        """A floating tensor with scales is refused: they would be dropped."""
        if scale_info is None:
            return None
        return (f"tensor {tensor!r} in {path} has scales {self.scale_name(tensor)!r} but is stored as {info.dtype}, "
                "not float8: fxparallel does not know how to apply them")

    def is_quantized(self, tensor: str, header) -> bool:
        return is_fp8(header(tensor)[0])

    def piece(self, tensor: str, index: tuple, out: torch.Tensor, header, shared: dict,
              merged: bool = False) -> Optional[Piece]:
        info, _ = header(tensor)
        if not is_fp8(info):
            return None
        runs = byte_runs(info.shape, index, info.itemsize)
        if not runs:
            return Piece(0, info.start, lambda handle: 0)
        scales, block = self.scales_of(tensor, index, info, header, shared, merged)
        source = tuple(slice(a, b) for a, b in index)
        return Piece(sum(n for _, n in runs), info.start + runs[0][0],
                     lambda handle: read_dequantized(handle, tensor, source, out, scales, block))


class FineGrainedFp8(ScaledFp8):
    """quant_method "fp8" with ``weight_block_size`` ``block``: float8 weights and their ``weight_scale_inv``."""

    def __init__(self, block: tuple):
        self.block = tuple(block)
        self.label = f"fp8 (blocks {block[0]}x{block[1]})"

    def scale_name(self, tensor: str) -> str:
        return scale_name(tensor)

    def companions(self, tensor: str, stored) -> list:
        return [scale_name(tensor)] if scale_name(tensor) in stored else []

    def problem(self, tensor: str, header, stored) -> Optional[str]:
        """A float8 weight needs its block scales."""
        info, path = header(tensor)
        scales = scale_name(tensor)
        scale_info = header(scales)[0] if scales in stored else None
        if is_fp8(info):
            return check_pair(tensor, info, scale_info, self.block, path)
        return self.scales_on_float(tensor, info, path, scale_info)

    def scales_of(self, tensor: str, index: tuple, info, header, shared: dict, merged: bool) -> tuple:
        read = companion(scale_name(tensor), scale_index(index, self.block), header, shared, torch.float32)
        return read.out, self.block
