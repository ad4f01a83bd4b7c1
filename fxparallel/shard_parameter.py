"""This rank's shard of a parameter of a model split over tp > 1 ranks, as the module registers it.

Its gradient is this rank's piece. Two of torch's readers of ``.grad`` would treat it as the whole gradient and act
on each rank alone, silently, when they reach the shards without the model seeing it:

- ``clip_grad_norm_`` over a list of the shards taken before (``params = list(model.parameters())`` ahead of the
  loop): each rank would clip by its own norm, and replicated weights drift apart (or, once the views hold the
  gradients, the list has none and nothing is clipped). ``clip_grad_norm_(model.parameters(), ...)`` is exact (the
  model answers DTensor views there: ``dtensor_parameters.py``); clipping by value is element by element: exact on
  shards, let through.
- ``torch.amp.GradScaler``'s unscaling over an optimizer of the shards: each rank would look for inf / NaN in its
  own pieces only, so an overflow in one rank's piece skips the step there and not elsewhere (measured at TP=2:
  the ranks' replicated weights 0.01 apart and their scales 1 and 2 after one step), or, once the views hold the
  gradients, finds none to unscale while the step then takes the views' scaled ones. ``ShardedGradScaler`` (its
  found_inf summed over a process group) is exact; over the DTensor views DTensor sums found_inf itself.

So reading a shard's ``.grad`` from within either raises, before any gradient is changed. Under FSDP
(``runtime.apply_data_parallel`` at tp > 1) the parameters are FSDP's DTensors of chunks of the shards, spanning the
data-parallel ranks only, and the same two readers would act on each tp rank's pieces alone: their class becomes
``FSDPShardParameter``, whose ``.grad`` refuses them too (``clip_grad_norm_(model.parameters(), ...)`` is refused by
the model itself there, naming ``runtime.clip_grad_norm_``).

And one reader of ``.data``: for a model sharded at load, Trainer broadcasts from rank 0 every parameter that is not a
DTensor (``_sync_replicated_trainable_parameters``, meant for adapters added after FSDP). The model answers it
DTensor views; under ``TrainingArguments(torch_compile=True)`` Trainer asks torch.compile's wrapper, which collects
the registered shards, and rank 0's would overwrite the others' (tried at TP=2: then a TypeError at the first
backward, its gradient hook finding no gradient; with that mended, the views' gradients never cleared by the
wrapper's ``zero_grad``, the second step's norm 4.03 where one device gives 2.97). So it raises there, before the
broadcast."""
from __future__ import annotations

import sys

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from .callers import TRAINER
from .errors import ArgumentError

_GRAD = torch.Tensor.grad  # the tensor's own attributes (getset descriptors)
_DATA = torch.Tensor.data
# (module, functions) of the readers of ``.grad`` refused, and what to do instead
_GRAD_READERS = {
    ("torch.nn.utils.clip_grad", frozenset({"clip_grad_norm_", "clip_grad_norm"})): (
        "torch.nn.utils.clip_grad_norm_ reached a tensor-parallel shard ({name}, shape {shape}) through a list of "
        "parameters taken before: each rank would clip by its own norm. Pass model.parameters() at the call (the "
        "model then answers DTensor views, whose norm is the whole model's), take the list after reading "
        "model.tp_size, or clip with fxparallel.runtime.clip_grad_norm_(model, max_norm, mesh); no gradient was "
        "changed"),
    ("torch.amp.grad_scaler", frozenset({"_unscale_grads_"})): (
        "torch.amp.GradScaler reached a tensor-parallel shard ({name}, shape {shape}) through its optimizer: each "
        "rank would look for inf / NaN in its own shards only, and an overflow in one rank's piece would skip the "
        "step there alone. Use torch.distributed.fsdp.sharded_grad_scaler.ShardedGradScaler (it sums found_inf "
        "over its process group, the world by default), or build the optimizer on model.parameters() after "
        "reading model.tp_size (DTensor views: DTensor sums it); no gradient was changed"),
}
# the same readers of an FSDP parameter's ``.grad`` (FSDPShardParameter)
_FSDP_GRAD_READERS = {
    ("torch.nn.utils.clip_grad", frozenset({"clip_grad_norm_", "clip_grad_norm"})): (
        "torch.nn.utils.clip_grad_norm_ reached FSDP's chunk of a tensor-parallel shard ({name}, shape {shape} on "
        "this rank's tp position) through a list of parameters: FSDP's DTensors span the data-parallel ranks only, "
        "so each tp rank would clip by its own norm. Clip with fxparallel.runtime.clip_grad_norm_(model, max_norm, "
        "mesh) (train_step does), or under transformers.Trainer pass model.parameters() at the call; no gradient "
        "was changed"),
    ("torch.amp.grad_scaler", frozenset({"_unscale_grads_"})): (
        "torch.amp.GradScaler reached FSDP's chunk of a tensor-parallel shard ({name}, shape {shape} on this "
        "rank's tp position) through its optimizer: each tp rank would look for inf / NaN in its own pieces only. "
        "Use torch.distributed.fsdp.sharded_grad_scaler.ShardedGradScaler (it sums found_inf over its process "
        "group, the world by default); no gradient was changed"),
}
# the reader of ``.data`` refused (module docstring): Trainer's broadcast of the parameters that are not DTensors
_DATA_READERS = {
    (TRAINER, frozenset({"_sync_replicated_trainable_parameters"})): (
        "transformers.Trainer reached the parallel model's shard {name} (shape {shape}) as a plain parameter, to "
        "broadcast it from rank 0 over the other ranks, whose shards differ: TrainingArguments(torch_compile=True) "
        "hands Trainer torch.compile's wrapper, whose parameters are the registered shards, not the model's DTensor "
        "views (and its zero_grad would not clear the views' gradients). Not supported: leave torch_compile unset; "
        "no weight was changed"),
}


def _refuse_reader(parameter, readers: dict) -> None:
    """Raise the message of ``readers`` for the function reading ``parameter``'s attribute, if it is one of them
    (looked for past the property and any comprehension, a frame of its own before Python 3.12)."""
    if torch.compiler.is_compiling():
        return
    frame = sys._getframe(2)  # the reader: past this function and the property
    while frame is not None and frame.f_code.co_name.startswith("<"):  # <listcomp>, <genexpr>
        frame = frame.f_back
    if frame is None:
        return
    module, function = frame.f_globals.get("__name__"), frame.f_code.co_name
    message = next((message for (where, names), message in readers.items() if module == where and function in names),
                   None)
    if message is not None:
        name = getattr(getattr(parameter, "_fxparallel", None), "name", "a parameter")
        raise ArgumentError(message.format(name=name, shape=tuple(parameter.shape)))


def _refusing(attribute, readers: dict, deletable: bool = False) -> property:
    """The tensor's own ``attribute`` (a getset descriptor) as a property whose reading refuses ``readers``."""
    def read(parameter):
        _refuse_reader(parameter, readers)
        return attribute.__get__(parameter)

    return property(read, attribute.__set__, attribute.__delete__ if deletable else None)


class ShardParameter(nn.Parameter):
    """An ``nn.Parameter`` whose ``.grad`` refuses torch's ``clip_grad_norm_`` and GradScaler, and whose ``.data``
    refuses Trainer's broadcast (module docstring)."""

    data = _refusing(_DATA, _DATA_READERS)
    grad = _refusing(_GRAD, _GRAD_READERS, deletable=True)


class FSDPShardParameter(DTensor):
    """FSDP's DTensor parameter of a chunk of a tensor-parallel shard, whose ``.grad`` refuses torch's
    ``clip_grad_norm_`` and GradScaler (module docstring); FSDP and DTensor treat it as the DTensor it is."""

    grad = _refusing(_GRAD, _FSDP_GRAD_READERS, deletable=True)


def guard_fsdp_parameters(model) -> None:
    """Give each of FSDP's DTensor parameters of a model at tp > 1 the class ``FSDPShardParameter`` (and its
    ParamPlan, for the messages); FSDP registers the same objects again after every reshard."""
    if model.tp_group.size == 1:
        return
    for name, param in model.local_named_parameters():
        if type(param) is DTensor:
            param._fxparallel = model.plan.param(name)
            param.__class__ = FSDPShardParameter
