"""The parameter dtype from what the user passed, as transformers' ``from_pretrained`` accepts it.

``dtype``: a floating-point ``torch.dtype``, its name (``"bfloat16"``, ``"torch.bfloat16"``, ``"half"``),
or ``"auto"`` / None for the checkpoint's own dtype (the config's ``dtype``, else float32).
``torch_dtype``: transformers' deprecated alias of ``dtype`` (a FutureWarning, as in transformers).
"""
from __future__ import annotations

import warnings

import torch

from ..errors import ArgumentError
from .source import default_dtype

# names accepted as strings (besides "auto"), also with a "torch." prefix
NAMES = {
    "float32": torch.float32, "float": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16, "half": torch.float16,
    "float64": torch.float64, "double": torch.float64,
}
ACCEPTED = "a floating-point torch.dtype, 'auto', or one of " + ", ".join(repr(n) for n in NAMES) + \
    " (also as 'torch.<name>')"


def resolve_dtype(dtype=None, torch_dtype=None, config=None) -> torch.dtype:
    """The torch.dtype to build and load the parameters in.

    ``config``: the model's config, for ``"auto"`` and None (its ``dtype``, else float32)."""
    if torch_dtype is not None:
        if dtype is not None:
            raise ArgumentError(f"pass dtype= or its deprecated alias torch_dtype=, not both (got dtype={dtype!r}, "
                                f"torch_dtype={torch_dtype!r})")
        warnings.warn("`torch_dtype` is deprecated! Use `dtype` instead!", FutureWarning, stacklevel=3)
        dtype, argument = torch_dtype, "torch_dtype"
    else:
        argument = "dtype"
    if dtype is None:
        return default_dtype(config)
    if isinstance(dtype, str):
        name = dtype.strip()
        if name == "auto":
            return default_dtype(config)
        key = name[len("torch."):] if name.startswith("torch.") else name
        if key not in NAMES:
            raise ArgumentError(f"{argument}={dtype!r} is not a dtype fxparallel knows: pass {ACCEPTED}")
        return NAMES[key]
    if isinstance(dtype, torch.dtype):
        if not dtype.is_floating_point:
            raise ArgumentError(f"{argument}={dtype} is not a floating-point dtype: parameters need one; pass "
                                f"{ACCEPTED}")
        return dtype
    raise ArgumentError(f"{argument} must be a torch.dtype or a string, got {type(dtype).__name__} {dtype!r}: pass "
                        f"{ACCEPTED}")
