"""This rank's shard of a parameter of a model split over tp > 1 ranks, as the module registers it.

Its gradient is this rank's piece. torch's ``clip_grad_norm_(model.parameters(), ...)`` is exact (the model answers
DTensor views there: ``dtensor_parameters.py``), but a list of the shards taken before (``params =
list(model.parameters())`` ahead of the loop) reaches torch's clipping without the model seeing it: each rank would
clip by its own norm, silently, and replicated weights drift apart (or, once the views hold the gradients, the list
has none and nothing is clipped). So reading a shard's ``.grad`` from within torch's ``clip_grad_norm_`` raises,
before any gradient is scaled. Clipping by value (``clip_grad_value_``) is element by element: exact on shards, let
through."""
from __future__ import annotations

import sys

import torch
from torch import nn

from .errors import ArgumentError

_CLIPPING_MODULE = "torch.nn.utils.clip_grad"
_BY_NORM = frozenset({"clip_grad_norm_", "clip_grad_norm"})
_GRAD = torch.Tensor.grad  # the tensor's own attribute (a getset descriptor)


def _read_by_norm_clipping() -> bool:
    """Whether the ``.grad`` being read is read by torch's ``clip_grad_norm_`` (its comprehension, a frame of its own
    before Python 3.12, or itself)."""
    frame = sys._getframe(2)  # the reader: past the property
    while frame is not None and frame.f_code.co_name.startswith("<"):  # <listcomp>, <genexpr>
        frame = frame.f_back
    return frame is not None and frame.f_code.co_name in _BY_NORM \
        and frame.f_globals.get("__name__") == _CLIPPING_MODULE


class ShardParameter(nn.Parameter):
    """An ``nn.Parameter`` whose ``.grad`` refuses torch's ``clip_grad_norm_`` (module docstring)."""

    @property
    def grad(self):
        if not torch.compiler.is_compiling() and _read_by_norm_clipping():
            raise ArgumentError(
                f"torch.nn.utils.clip_grad_norm_ reached a tensor-parallel shard "
                f"({getattr(getattr(self, '_fxparallel', None), 'name', 'a parameter')}, shape {tuple(self.shape)}) "
                "through a list of parameters taken before: each rank would clip by its own norm. Pass "
                "model.parameters() at the call (the model then answers DTensor views, whose norm is the whole "
                "model's), take the list after reading model.tp_size, or clip with "
                "fxparallel.runtime.clip_grad_norm_(model, max_norm, mesh); no gradient was changed")
        return _GRAD.__get__(self)

    @grad.setter
    def grad(self, value):
        _GRAD.__set__(self, value)

    @grad.deleter
    def grad(self):
        _GRAD.__delete__(self)
