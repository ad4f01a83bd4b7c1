"""What a rewritten graph depends on, as a key: everything that could change the code that capture,
solve and rewrite produce for one rank. Two calls with equal keys get the same code.

The key is plain JSON data (stored next to the graph and compared on every read), and its
digest names the file."""
from __future__ import annotations

import functools
import hashlib
import json
import os
import sys
import types
from typing import Optional

import torch

from ..capture.adapters import adapters_of
from ..version import __version__

# config fields that name where the config came from, not what the model computes
_PROVENANCE = ("_name_or_path", "transformers_version", "_commit_hash")
# config attributes transformers keeps out of to_dict() but the captured code depends on
_HIDDEN = ("_attn_implementation", "_experts_implementation")


@functools.lru_cache(maxsize=None)
def source_digest() -> str:
    """sha256 of fxparallel's own source: a change to any pass makes every cached graph stale."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the fxparallel package
    h = hashlib.sha256()
    for folder, dirs, files in sorted(os.walk(root)):
        dirs.sort()
        for name in sorted(files):
            if name.endswith(".py"):
                path = os.path.join(folder, name)
                h.update(os.path.relpath(path, root).encode())
                with open(path, "rb") as f:
                    h.update(f.read())
    return h.hexdigest()


def _versions() -> dict:
    import transformers

    return {"python": sys.version.split()[0], "torch": torch.__version__, "transformers": transformers.__version__,
            "fxparallel": __version__, "fxparallel_source": source_digest()}


def _config(config) -> dict:
    fields = {k: v for k, v in config.to_dict().items() if k not in _PROVENANCE}
    hidden = {}
    for owner in (config, getattr(config, "get_text_config", lambda: config)()):
        for name in _HIDDEN:
            hidden[name] = str(getattr(owner, name, None))
    return {"fields": json.loads(json.dumps(fields, sort_keys=True, default=str)), "hidden": hidden}


def _code_digest(code, h) -> None:
    h.update(code.co_code)
    h.update(repr(code.co_names).encode())
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            _code_digest(const, h)
        else:
            h.update(repr(const).encode())


def _callable_digest(obj, h) -> None:
    """The code of a function (and of what it wraps), a class's own methods, or the name of anything else."""
    h.update(f"{getattr(obj, '__module__', '')}.{getattr(obj, '__qualname__', type(obj).__name__)}".encode())
    seen = 0
    while obj is not None and seen < 8:  # decorators: the wrapper's code and the wrapped function's
        code = getattr(obj, "__code__", None)
        if isinstance(code, types.CodeType):
            _code_digest(code, h)
        obj, seen = getattr(obj, "__wrapped__", None), seen + 1


def model_code_digest(meta) -> str:
    """sha256 of the Python the capture of ``meta`` runs through, as this process has it now: every
    module class's own functions, every function and class in the modules that define them (model code
    calls module-level helpers such as ``apply_rotary_pos_emb``), and transformers' attention and mask
    function registries. A runtime patch of any of them (a replaced ``forward``, a kernel library's
    swapped helper) changes the key; the transformers version covers the rest of its code."""
    h = hashlib.sha256()
    classes = sorted({type(m) for m in meta.modules()}, key=lambda c: (c.__module__, c.__qualname__))
    for cls in classes:
        for name, value in sorted(vars(cls).items()):
            if callable(value) or isinstance(value, (staticmethod, classmethod, property)):
                h.update(name.encode())
                _callable_digest(getattr(value, "__func__", getattr(value, "fget", value)), h)
    for module_name in sorted({c.__module__ for c in classes}):
        module = sys.modules.get(module_name)
        for name, value in sorted(vars(module).items() if module else ()):
            if isinstance(value, (types.FunctionType, type)):
                h.update(name.encode())
                _callable_digest(value, h)
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    for registry in (ALL_ATTENTION_FUNCTIONS, ALL_MASK_ATTENTION_FUNCTIONS):
        for name in sorted(registry):
            h.update(name.encode())
            _callable_digest(registry[name], h)
    return h.hexdigest()


def graph_key(meta, spec, group, device, dtype, options, report: bool) -> Optional[dict]:
    """The key of one graph (``spec``: what it computes, ``options``: how it is planned), or None when it
    cannot be cached: a model class outside transformers (remote code, or the caller's own class), whose
    source the key cannot see."""
    cls = type(meta)
    if not cls.__module__.startswith("transformers."):
        return None
    return {
        "versions": _versions(),
        "model_class": f"{cls.__module__}.{cls.__qualname__}",
        "model_code": model_code_digest(meta),
        "config": _config(meta.config),
        "adapters": adapters_of(meta),
        "dtype": str(dtype),
        "device": str(torch.device(device)),
        "tp": [group.size, group.rank, group.handle],
        "graph": spec.to_dict(),
        "options": options.to_dict(),
        "report": report,
    }


def digest(key: dict) -> str:
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()
