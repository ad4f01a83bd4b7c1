"""Activation checkpointing: recompute decoder layers in the backward pass instead of keeping
their activations.

Each decoder layer is a module the graphs call (``ops/layer_units.py``), so checkpointing
one is ``torch.utils.checkpoint`` (non-reentrant) around that module's piece, inside its
``forward``: FSDP's hooks sit outside it on ``__call__``, as with torchtitan's wrapping, so the
layer's parameters are all-gathered again for the recomputation by FSDP's pre-backward hook.
The recomputation runs the same ops on the same inputs (and the same RNG state), so gradients
are bit-identical to a run without checkpointing; in the full mode the tensor-parallel
collectives inside a layer run again, in the same order on every rank.

Modes:

* ``"full"``: a layer keeps only its inputs; everything else is recomputed.
* ``"selective"``: a layer also keeps the outputs of its matrix products (mm, addmm, bmm,
  attention kernels) and of its tensor-parallel all-reduces, and recomputes only the cheap rest
  (norms, activations, rotary, softmax of eager attention). The products are most of a layer's
  FLOPs, so the recomputation is nearly free in time, while the activations it does not keep
  (elementwise intermediates, several per product) are most of the memory. Keeping the
  all-reduces (as torchtitan keeps its collectives) means the recomputation communicates
  nothing: a step runs the all-reduces of a step without checkpointing, where ``"full"`` runs
  a layer's forward all-reduces again (those the backward needs), for one more kept tensor of
  the hidden size per all-reduce (at TP=2, 1024 tokens: 0.67 of the bytes kept without
  checkpointing instead of 0.56). Inside a selective region the all-reduce is the functional
  op, whose output is a new tensor that can be kept (``ops/collectives.py``,
  ``in_selective_checkpointing``); the in-place ``dist.all_reduce`` could not be. With sequence
  parallelism the same holds for its all-gathers and reduce-scatters.
  ``benchmarks/activation_checkpointing.py`` measures both modes against keeping everything.

As in transformers, layers are recomputed only in training mode with gradients enabled.
"""
from __future__ import annotations

import functools
from typing import Optional

import torch
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from ..ops.collectives import FUNCTIONAL_ALL_REDUCE, FUNCTIONAL_SEQUENCE

MODES = ("full", "selective")

_aten = torch.ops.aten
# products kept by the selective mode: most of the FLOPs, a fraction of the activation bytes
_KEPT = {_aten.mm.default, _aten.addmm.default, _aten.bmm.default, _aten.baddbmm.default}
for _name in ("_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_flash_attention",
              "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention"):
    _op = getattr(_aten, _name, None)
    if _op is not None:
        _KEPT.add(_op.default)
# the all-reduces (and sequence parallelism's gathers and reduce-scatters): kept, the recomputation runs no
# collective (the wait on one is a no-op when recomputed)
_KEPT.update(FUNCTIONAL_ALL_REDUCE + FUNCTIONAL_SEQUENCE)

# torch.utils.checkpoint.checkpoint's own options that may be passed through gradient_checkpointing_kwargs
_PASSED = ("preserve_rng_state", "determinism_check", "debug")


def _keep_products(ctx, op, *args, **kwargs):
    return CheckpointPolicy.MUST_SAVE if op in _KEPT else CheckpointPolicy.PREFER_RECOMPUTE


@functools.lru_cache(maxsize=None)
def _selective_context():
    return functools.partial(create_selective_checkpoint_contexts, _keep_products)


def checkpoint_options(mode: str, kwargs: Optional[dict]) -> dict:
    """The keyword arguments of ``torch.utils.checkpoint.checkpoint`` for ``mode`` and the caller's
    ``gradient_checkpointing_kwargs`` (transformers' name); raises on anything we cannot honour."""
    if mode not in MODES:
        raise ValueError(f"activation checkpointing mode must be one of {MODES}, got {mode!r}")
    kwargs = dict(kwargs or {})
    if kwargs.pop("use_reentrant", False):
        raise ValueError("gradient_checkpointing_kwargs: use_reentrant=True is not supported (the reentrant "
                         "variant does not compose with FSDP2 and ignores the selective mode); leave it out "
                         "or pass use_reentrant=False")
    unknown = sorted(set(kwargs) - set(_PASSED))
    if unknown:
        raise ValueError(f"gradient_checkpointing_kwargs: unsupported {unknown} (supported: use_reentrant=False, "
                         f"{', '.join(_PASSED)})")
    options = {"use_reentrant": False, **kwargs}
    if mode == "selective":
        options["context_fn"] = _selective_context()
    return options


def enable(model, mode: str = "full", gradient_checkpointing_kwargs: Optional[dict] = None,
           every_n_layers: int = 1, offload: bool = False) -> None:
    """Checkpoint the decoder layers of ``model`` (a ParallelCausalLM) from its next call on: every layer, or
    layers 0, n, 2n, ... with ``every_n_layers=n`` (transformers 5's option)."""
    options = checkpoint_options(mode, gradient_checkpointing_kwargs)
    if isinstance(every_n_layers, bool) or not isinstance(every_n_layers, int) or every_n_layers < 1:
        raise ValueError(f"every_n_layers must be a positive int, got {every_n_layers!r}")
    if offload:
        raise ValueError("activation checkpointing with offload=True (activations kept in host memory) is not "
                         "supported on the parallel model; leave offload=False (each rank keeps 1/tp of a layer's "
                         "activations already), or checkpoint more layers (every_n_layers=1)")
    for i, unit in enumerate(model.layer_units(required_by="activation checkpointing")):
        unit.checkpoint = options if i % every_n_layers == 0 else None


def disable(model) -> None:
    for unit in model.layer_units():
        unit.checkpoint = None
