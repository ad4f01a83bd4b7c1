"""What the loader asks of a quantized checkpoint format it dequantizes on load.

One ``Format`` per format fxparallel reads exactly (fine-grained FP8 ``fp8.py``, MXFP4 ``mxfp4.py``,
compressed-tensors FP8 ``compressed_tensors.py``); ``quantization.loaded_format(config)`` picks it. The loader
(``weights.py``) plans every read from the headers first, so a format answers from the headers alone:

- ``parameter``: the symbolic tensor of a parameter stored under other names (MXFP4's ``X_blocks`` and
  ``X_scales`` for ``X``), or None;
- ``companions``: the stored tensors read with a weight (its scales), which are not "unused";
- ``problem``: why a stored tensor cannot be dequantized (a float8 weight without scales, scales of the wrong
  shape, ...), checked before anything is read;
- ``piece``: how a piece of a stored tensor is read: its own bytes, the companion pieces read into buffers
  first (``Companion``, shared by the pieces that need the same one), and ``decode(handle)``, which reads the
  piece, dequantizes it and writes the parameter's dtype into the destination; None for a plain read.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch

from .safetensors_io import byte_runs


@dataclass
class Companion:
    """A piece of a companion tensor (scales), read into ``out`` before the pieces that use it."""

    path: str
    tensor: str
    source: tuple  # index into the stored tensor
    out: torch.Tensor
    nbytes: int
    offset: int  # where the piece starts in the file


@dataclass
class Piece:
    """A quantized piece: ``nbytes`` of its own from ``offset``, read and dequantized by ``decode(handle)``
    (an open ``SafetensorsFile``; returns the bytes read) once its companions are in."""

    nbytes: int
    offset: int
    decode: Callable


def bounds(index: tuple) -> tuple:
    """(start, stop) per dim of a complete index of step-1 slices with explicit bounds (the symbolic tensors')."""
    return tuple((s.start, s.stop) for s in index)


def companion(tensor: str, index: tuple, header, shared: dict, dtype=None) -> Companion:
    """The read of ``tensor[index]`` (``index``: (start, stop) per dim) into a buffer of ``dtype`` (default the
    stored one); one per distinct (tensor, index), kept in ``shared``. ``header(name)``: (TensorInfo, path)."""
    key = (tensor, index)
    if key not in shared:
        info, path = header(tensor)
        runs = byte_runs(info.shape, index, info.itemsize)
        out = torch.empty(tuple(b - a for a, b in index), dtype=dtype or info.torch_dtype)
        shared[key] = Companion(path, tensor, tuple(slice(a, b) for a, b in index), out, sum(n for _, n in runs),
                                info.start + (runs[0][0] if runs else 0))
    return shared[key]


class Format:
    """A quantized checkpoint format read exactly; the defaults describe a tensor stored plainly."""

    label = ""  # what print(model) says the weights were dequantized from

    def parameter(self, name: str, shape: tuple, stored, header):
        """(symbolic tensor, problem) for the parameter ``name`` when it is stored in this format's own layout
        under other names; (None, None) when it is not."""
        return None, None

    def companions(self, tensor: str, stored) -> list:
        """The stored tensors read with ``tensor`` (or deliberately not read: named, so not reported unused)."""
        return []

    def problem(self, tensor: str, header, stored) -> Optional[str]:
        """Why ``tensor`` cannot be read in this format; None if it can (quantized or plain)."""
        return None

    def is_quantized(self, tensor: str, header) -> bool:
        return False

    def piece(self, tensor: str, index: tuple, out: torch.Tensor, header, shared: dict,
              merged: bool = False) -> Optional[Piece]:
        """How ``tensor[index]`` (``index``: (start, stop) per dim) is read into ``out``; None for a plain read.
        ``merged``: the tensor makes its parameter through one of transformers' converters (e.g. per-expert
        weights stacked into 3-D experts), which may dequantize otherwise."""
        return None
