"""MXFP4 expert weights (GPT-OSS), dequantized piece by piece while a rank reads its slice.

The layout openai/gpt-oss-* publish (transformers' ``Mxfp4Config``, quant_method "mxfp4"): the expert weight
``X`` of the model (``mlp.experts.gate_up_proj`` ``[E, hidden, 2 * inter]``, ``mlp.experts.down_proj``
``[E, inter, hidden]``) is stored transposed, as the dequantized ``[E, rows, cols]`` with ``X`` its
``transpose(1, 2)``, in two uint8 tensors:

- ``X_blocks`` ``[E, rows, cols / 32, 16]``: 32 FP4 (e2m1) values per block, two per byte, value ``2k`` in the
  low nibble of byte ``k`` and value ``2k + 1`` in the high one; a nibble is an index into
  ``FP4_VALUES`` (sign bit 3);
- ``X_scales`` ``[E, rows, cols / 32]``: the block's e8m0 exponent, biased by 127.

Element ``[e, r, c]`` is ``FP4_VALUES[nibble] * 2 ** (scales[e, r, c // 32] - 127)``. Every other tensor (attention,
router, embeddings, norms, biases: ``modules_to_not_convert``) is stored plainly and read as any other.

A piece ``[e0:e1, r0:r1, c0:c1]`` of the stored form (the parameter's piece transposed; a slice may take experts,
rows or columns, cut through a block, be uneven or made of segments) needs the blocks ``c0 // 32 ..
(c1 - 1) // 32`` of its rows alone and their scales. The scales are read first (a companion read); the blocks in
chunks whose temporaries take at most ``STAGING_BYTES``, each dequantized in float32 and cropped to the piece's
columns, then cast to the parameter's dtype: the arithmetic of transformers' ``convert_moe_packed_tensors`` (a value
table, then ``ldexp`` by the unbiased exponent, exact in float32), so the weights equal its ``dequantize=True``
model bit for bit. No rank dequantizes (nor reads) a whole tensor it does not keep whole.
"""
from __future__ import annotations

from typing import Optional

import torch

from .conversion import Transposed
from .dequantize import Format, Piece, companion
from .safetensors_io import STAGING_BYTES, byte_runs

FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
BLOCK = 32  # values per block (one scale each)
BLOCK_BYTES = BLOCK // 2
SCALE_BIAS = 127
TEMPORARY_BYTES = 16  # per value of a chunk: its nibbles (2 x uint8), int32 codes, float32 values, the cast
BLOCKS, SCALES = "_blocks", "_scales"  # "X" -> "X_blocks", "X_scales"


class Mxfp4Stored:
    """The dequantized ``[E, rows, cols]`` of ``X_blocks`` / ``X_scales`` (a leaf of the symbolic tensors of
    ``conversion.py``); a piece of it is yielded under the name of its blocks and read by ``Mxfp4.piece``."""

    def __init__(self, blocks: str, scales: str, shape: tuple):
        self.blocks, self.scales, self.shape = blocks, scales, tuple(shape)

    def pieces(self, index: tuple, out: torch.Tensor):
        yield self.blocks, tuple(slice(a, b) for a, b in index), out

    def leaves(self) -> list:
        return [self.blocks, self.scales]


def _block_range(c0: int, c1: int) -> tuple:
    return c0 // BLOCK, (c1 - 1) // BLOCK + 1


def read_dequantized(handle, blocks: str, index: tuple, out: torch.Tensor, scales: torch.Tensor) -> int:
    """Write ``dequantize(blocks)[index]`` (``index``: (start, stop) of expert, row and column of the stored
    ``[E, rows, cols]``, non-empty) into ``out`` (any dtype or strides); ``scales``: the uint8 exponents of the
    blocks the piece touches (``[e1 - e0, r1 - r0, g1 - g0]``). Returns the bytes read."""
    (e0, e1), (r0, r1), (c0, c1) = index
    g0, g1 = _block_range(c0, c1)
    lut = torch.tensor(FP4_VALUES, dtype=torch.float32)
    per_row = (g1 - g0) * BLOCK * TEMPORARY_BYTES
    step = max(1, STAGING_BYTES // per_row)
    crop = slice(c0 - g0 * BLOCK, c1 - g0 * BLOCK)
    nbytes = 0
    for e in range(e0, e1):
        for start in range(r0, r1, step):
            stop = min(r1, start + step)
            q = torch.empty((1, stop - start, g1 - g0, BLOCK_BYTES), dtype=torch.uint8)
            nbytes += handle.read_into(blocks, (slice(e, e + 1), slice(start, stop), slice(g0, g1)), q)
            codes = torch.stack((q[0] & 0x0F, q[0] >> 4), dim=-1).flatten(-2).to(torch.int32)  # [n, G, 32]
            value = lut[codes]
            exponents = scales[e - e0, start - r0:stop - r0].to(torch.int32) - SCALE_BIAS
            torch.ldexp(value, exponents[..., None], out=value)
            out[e - e0, start - r0:stop - r0].copy_(value.flatten(-2)[:, crop])
    return nbytes


def _layout_problem(name: str, blocks, scales, shape: tuple) -> Optional[str]:
    """Why ``X_blocks`` / ``X_scales`` (TensorInfo, path pairs) are not the MXFP4 form of ``name`` of ``shape``."""
    (b, bpath), (s, spath) = blocks, scales
    if b.torch_dtype != torch.uint8 or s.torch_dtype != torch.uint8:
        return (f"{name!r} is stored as MXFP4 ({b.name!r} {b.dtype} in {bpath}, {s.name!r} {s.dtype} in {spath}); "
                "MXFP4 blocks and scales are uint8")
    if len(b.shape) != 4 or b.shape[-1] != BLOCK_BYTES or tuple(s.shape) != tuple(b.shape[:-1]):
        return (f"{name!r} is stored as MXFP4 blocks {b.name!r} {list(b.shape)} and scales {s.name!r} "
                f"{list(s.shape)} in {bpath}; fxparallel reads [experts, rows, blocks, {BLOCK_BYTES}] blocks with "
                "[experts, rows, blocks] scales")
    experts, rows, groups, _ = b.shape
    if tuple(shape) != (experts, groups * BLOCK, rows):
        return (f"{name!r} of shape {list(shape)} is stored as MXFP4 blocks {b.name!r} {list(b.shape)} in {bpath}, "
                f"which dequantize to {[experts, rows, groups * BLOCK]}, transposed {[experts, groups * BLOCK, rows]}")
    return None


class Mxfp4(Format):
    """quant_method "mxfp4": GPT-OSS's experts as ``X_blocks`` / ``X_scales``."""

    label = "mxfp4"

    def __init__(self):
        self.blocks = set()  # the X_blocks of the parameters made by ``parameter``: read by ``piece``

    def parameter(self, name: str, shape: tuple, stored, header):
        blocks, scales = name + BLOCKS, name + SCALES
        if blocks not in stored and scales not in stored:
            return None, None
        if blocks not in stored or scales not in stored:
            have, lack = (blocks, scales) if blocks in stored else (scales, blocks)
            return None, (f"{name!r} is stored as MXFP4 but {header(have)[1]} has {have!r} and the checkpoint no "
                          f"{lack!r}: both are needed to dequantize it")
        problem = _layout_problem(name, header(blocks), header(scales), shape)
        if problem is not None:
            return None, problem
        experts, rows, groups, _ = header(blocks)[0].shape
        self.blocks.add(blocks)
        return Transposed(Mxfp4Stored(blocks, scales, (experts, rows, groups * BLOCK)), 1, 2), None

    def companions(self, tensor: str, stored) -> list:
        return [n for n in (tensor + BLOCKS, tensor + SCALES) if n in stored]

    def is_quantized(self, tensor: str, header) -> bool:
        return tensor in self.blocks

    def piece(self, tensor: str, index: tuple, out: torch.Tensor, header, shared: dict,
              merged: bool = False) -> Optional[Piece]:
        if tensor not in self.blocks:
            return None
        info, _ = header(tensor)
        (e0, e1), (r0, r1), (c0, c1) = index
        if e1 <= e0 or r1 <= r0 or c1 <= c0:
            return Piece(0, info.start, lambda handle: 0)
        g0, g1 = _block_range(c0, c1)
        runs = byte_runs(info.shape, ((e0, e1), (r0, r1), (g0, g1), (0, BLOCK_BYTES)), info.itemsize)
        scales = companion(tensor[:-len(BLOCKS)] + SCALES, ((e0, e1), (r0, r1), (g0, g1)), header, shared)
        return Piece(sum(n for _, n in runs), info.start + runs[0][0],
                     lambda handle: read_dequantized(handle, tensor, index, out, scales.out))

