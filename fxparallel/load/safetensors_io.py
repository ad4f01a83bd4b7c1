"""Read slices of tensors from safetensors files with clear errors."""
from __future__ import annotations

from safetensors import safe_open

from ..errors import CheckpointError


def open_file(path: str):
    try:
        return safe_open(path, framework="pt", device="cpu")
    except Exception as err:  # safetensors raises SafetensorError / OSError for bad files
        raise CheckpointError(f"{path} is not a readable safetensors file (truncated or corrupted?): {err}") from err


def tensor_names(path: str) -> list:
    with open_file(path) as f:
        return list(f.keys())


def read_slice(handle, path: str, tensor: str, expected_shape: tuple, index: tuple):
    """Read ``tensor[index]`` after checking its stored shape; only those bytes are read."""
    try:
        sl = handle.get_slice(tensor)
        shape = tuple(sl.get_shape())
    except Exception as err:  # noqa: BLE001
        raise CheckpointError(f"cannot read tensor {tensor!r} from {path}: {err}") from err
    if shape != tuple(expected_shape):
        raise CheckpointError(
            f"tensor {tensor!r} in {path} has shape {list(shape)} but the config gives {list(expected_shape)}"
        )
    try:
        return sl[index] if shape else handle.get_tensor(tensor)
    except Exception as err:  # noqa: BLE001
        raise CheckpointError(f"cannot read tensor {tensor!r} from {path} (truncated or corrupted?): {err}") from err
