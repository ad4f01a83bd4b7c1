"""Read pieces of tensors from safetensors files, exactly their bytes, into a given tensor.

Each file is first opened with ``safetensors.safe_open`` (which validates the header
and that the data covers the file) and its header is parsed for data offsets. A piece
``tensor[index]`` (one basic slice per dimension) is a list of contiguous byte runs in
the file; they are read with ``pread`` straight into the destination when the dtypes
agree, else through a bounded staging buffer (``STAGING_BYTES``) and converted.

Why not ``safe_open(...).get_slice(...)[index]`` for the data: with torch it returns a
view of a memory map, so every page it touches counts in the process's resident memory
while the map lives, and a column slice touches the whole tensor (kernel readahead).
Reading the runs ourselves keeps the peak at "shard + staging buffer", and the bytes
read are exactly the piece's bytes.
"""
from __future__ import annotations

import json
import math
import os
import struct
from dataclasses import dataclass

import torch

from ..errors import CheckpointError

STAGING_BYTES = 16 * 2**20  # bound of the temporary buffer used to convert dtypes
MAX_HEADER = 100 * 2**20

DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool, "U16": torch.uint16, "U32": torch.uint32, "U64": torch.uint64,
    "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}


@dataclass(frozen=True)
class TensorInfo:
    name: str
    dtype: str  # safetensors dtype string, e.g. "BF16"
    shape: tuple
    start: int  # absolute byte offset of the data in the file
    end: int

    @property
    def torch_dtype(self):
        return DTYPES.get(self.dtype)

    @property
    def itemsize(self) -> int:
        dt = self.torch_dtype
        return torch.empty((), dtype=dt).element_size() if dt is not None else 0


class SafetensorsFile:
    """A safetensors file: its validated header, and reads of pieces of its tensors."""

    def __init__(self, path: str):
        self.path = path
        self.tensors = _parse_header(path)
        self._fd = None

    # ---- reads ---------------------------------------------------------------
    def __enter__(self):
        self._fd = os.open(self.path, os.O_RDONLY)
        return self

    def __exit__(self, *exc):
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def read_into(self, name: str, index: tuple, out: torch.Tensor) -> int:
        """Write ``tensor[index]`` (converted to ``out.dtype``) into ``out``; returns bytes read."""
        info = self.tensors[name]
        if info.torch_dtype is None:
            raise CheckpointError(f"tensor {name!r} in {self.path} has dtype {info.dtype}, which fxparallel cannot read")
        index = normalize_index(info.shape, index)
        piece_shape = tuple(b - a for a, b in index)
        if tuple(out.shape) != piece_shape:
            raise ValueError(f"{name}: destination shape {tuple(out.shape)} != piece shape {piece_shape}")
        runs = byte_runs(info.shape, index, info.itemsize)
        nbytes = sum(n for _, n in runs)
        if nbytes == 0:
            return 0
        out = out.detach()
        direct = out.is_contiguous() and out.device.type == "cpu"
        if direct and out.dtype == info.torch_dtype:
            self._read_runs(info, runs, _bytes_view(out))
        elif direct:
            self._stream_convert(info, runs, out.as_strided((out.numel(),), (1,)))
        else:  # a non-contiguous destination (one piece of a stacked parameter), or one on an accelerator
            tmp = torch.empty(piece_shape, dtype=info.torch_dtype)
            self._read_runs(info, runs, _bytes_view(tmp))
            out.copy_(tmp)
        return nbytes

    def _stream_convert(self, info: TensorInfo, runs: list, flat_out: torch.Tensor) -> None:
        """Read the runs in batches of at most STAGING_BYTES and convert each batch into ``flat_out``."""
        item = info.itemsize
        staging = torch.empty(max(1, min(STAGING_BYTES, sum(n for _, n in runs)) // item), dtype=info.torch_dtype)
        cap = staging.numel() * item
        view = _bytes_view(staging)
        filled, done = 0, 0  # bytes in staging; elements already written to flat_out
        for offset, n in runs:
            while n:
                take = min(n, cap - filled)
                self._pread(info, view[filled:filled + take], offset)
                filled, offset, n = filled + take, offset + take, n - take
                if filled == cap:
                    flat_out[done:done + cap // item].copy_(staging)
                    done, filled = done + cap // item, 0
        if filled:
            flat_out[done:done + filled // item].copy_(staging[: filled // item])

    def _read_runs(self, info: TensorInfo, runs: list, view: memoryview) -> None:
        pos = 0
        for offset, n in runs:
            self._pread(info, view[pos:pos + n], offset)
            pos += n

    def _pread(self, info: TensorInfo, buf: memoryview, offset: int) -> None:
        if self._fd is None:
            raise RuntimeError("use SafetensorsFile as a context manager to read")
        at = info.start + offset
        while len(buf):
            got = os.preadv(self._fd, [buf], at) if hasattr(os, "preadv") else _pread_copy(self._fd, buf, at)
            if got <= 0:
                raise CheckpointError(
                    f"{self.path} ended at byte {at} while reading tensor {info.name!r} (truncated while loading?)"
                )
            buf, at = buf[got:], at + got


def _pread_copy(fd: int, buf: memoryview, at: int) -> int:
    data = os.pread(fd, len(buf), at)
    buf[: len(data)] = data
    return len(data)


def _bytes_view(t: torch.Tensor) -> memoryview:
    """A writable byte view of a contiguous CPU tensor (any dtype, bfloat16 included)."""
    flat = t.as_strided((t.numel(),), (1,))  # t is contiguous; size-1 dims may carry any stride
    return memoryview(flat.view(torch.uint8).numpy()).cast("B")


# ---- geometry ----------------------------------------------------------------
def normalize_index(shape: tuple, index: tuple) -> tuple:
    """(start, stop) per dimension from a tuple of step-1 slices (missing trailing dims are full)."""
    index = tuple(index) + (slice(None),) * (len(shape) - len(index))
    if len(index) != len(shape):
        raise ValueError(f"index {index} has more dimensions than shape {shape}")
    out = []
    for s, n in zip(index, shape):
        if not isinstance(s, slice) or s.step not in (None, 1):
            raise ValueError(f"only step-1 slices are supported, got {s!r}")
        a, b, _ = s.indices(n)
        out.append((a, max(a, b)))
    return tuple(out)


def byte_runs(shape: tuple, index: tuple, itemsize: int) -> list:
    """Contiguous (byte offset, byte count) runs of ``tensor[index]`` in a row-major tensor, in order."""
    shape = tuple(shape)
    if any(b <= a for a, b in index) and shape:
        return []
    strides = [math.prod(shape[i + 1:]) for i in range(len(shape))]
    partial = [d for d, ((a, b), n) in enumerate(zip(index, shape)) if (a, b) != (0, n)]
    if not partial:  # the whole tensor
        return [(0, math.prod(shape) * itemsize)]
    d = partial[-1]  # innermost dimension that is cut; everything inside it is whole
    a, b = index[d]
    run = (b - a) * strides[d] * itemsize
    starts = [a * strides[d]]  # element offsets of the runs, one outer dimension at a time (row-major order)
    for (lo, hi), stride in zip(reversed(index[:d]), reversed(strides[:d])):
        starts = [i * stride + s for i in range(lo, hi) for s in starts]
    return [(s * itemsize, run) for s in starts]


# ---- header -------------------------------------------------------------------
def _parse_header(path: str) -> dict:
    """Validate ``path`` with safetensors itself, then read its header's offsets."""
    from safetensors import safe_open

    try:
        with safe_open(path, framework="pt", device="cpu") as f:
            names = set(f.keys())
    except Exception as err:  # SafetensorError / OSError for bad files
        raise CheckpointError(f"{path} is not a readable safetensors file (truncated or corrupted?): {err}") from err
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        head = f.read(8)
        (n,) = struct.unpack("<Q", head) if len(head) == 8 else (None,)
        if n is None or n > MAX_HEADER or 8 + n > size:
            raise CheckpointError(f"{path} has a corrupted safetensors header length")
        try:
            header = json.loads(f.read(n))
        except ValueError as err:
            raise CheckpointError(f"{path} has a corrupted safetensors header: {err}") from err
    base = 8 + n
    tensors = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        try:
            lo, hi = entry["data_offsets"]
            info = TensorInfo(name, entry["dtype"], tuple(int(s) for s in entry["shape"]), base + lo, base + hi)
        except (KeyError, TypeError, ValueError) as err:
            raise CheckpointError(f"{path}: header entry of tensor {name!r} is malformed: {err}") from err
        if info.end > size:
            raise CheckpointError(f"{path} is truncated: tensor {name!r} needs bytes up to {info.end}, file has {size}")
        if info.torch_dtype is not None and info.end - info.start != math.prod(info.shape) * info.itemsize:
            raise CheckpointError(f"{path}: tensor {name!r} has {info.end - info.start} bytes, "
                                  f"its shape {list(info.shape)} and dtype {info.dtype} need "
                                  f"{math.prod(info.shape) * info.itemsize}")
        tensors[name] = info
    if set(tensors) != names:
        raise CheckpointError(f"{path}: safetensors and the header disagree on the tensor names")
    return tensors


def tensor_names(path: str) -> list:
    return list(_parse_header(path))
