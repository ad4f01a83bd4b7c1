"""What an optimizer stepping the parallel model's shards must not do, refused before its first step changes them.

Over the plain shards (a loop of one's own at tp > 1) an optimizer sees each rank's piece as if it were the whole
parameter. That is exact for the element-wise ones (SGD, Adam, AdamW, RMSprop, ...), and silently wrong in three
cases:

- an optimizer whose update reads the whole tensor: Adafactor's factored moments and relative step (row / column
  means, the parameter's RMS), Muon's orthogonalization, LBFGS's dot products all become statistics of the shard;
- ZeroRedundancyOptimizer over ranks of one tp group: it broadcasts each parameter from the rank that updated
  it, so one rank's shards overwrite the others' (measured at TP=2: weights 0.12 off after one step);
- a state saved by another layout loaded into it: torch's ``Optimizer.load_state_dict`` pairs states with
  parameters by position and keeps any shape, so a single-device run's moments (accelerate's ``optimizer.bin``
  under ``accelerator.load_state``, a ``torch.save(optimizer.state_dict())``) land whole next to a shard, and the
  step then fails deep inside the optimizer (a shape mismatch, DTensor's "mixed torch.Tensor and DTensor") or,
  where a whole moment broadcasts against a shard, updates with the wrong numbers.

A process-wide step pre-hook (torch's ``register_optimizer_step_pre_hook``) looks at each optimizer once, at its
first step, and at every later ``load_state_dict`` (a hook on the optimizer itself). Parameters stepped as DTensors
(Trainer's and accelerate's views, FSDP) are DTensor's business (it computes over the whole tensor, or stops with
its own error: torch's and transformers' Adafactor do): only their state must be DTensors too."""
from __future__ import annotations

import sys
import weakref

import torch
from torch.distributed.tensor import DTensor
from torch.optim.optimizer import register_optimizer_step_pre_hook

from .errors import ArgumentError
from .parallel_models import known_parameters

WHOLE_TENSOR_OPTIMIZERS = (("torch.optim", "Adafactor"), ("torch.optim", "LBFGS"), ("torch.optim", "Muon"),
                           ("transformers.optimization", "Adafactor"))  # (module, class): updates that read a whole tensor
RESUME = ("Resume a run of another layout from its weights (accelerate's model.safetensors, a Hugging Face folder: "
          "fxparallel.parallelize(folder, ...)) with a new optimizer, or save the training state as full-shape tensors "
          "that load at any tp size: dcp.save({'model': model.state_dict(), 'optim': optimizer.state_dict()}) "
          "(docs/training.md, \"Checkpoints\"), under Trainer fxparallel.TrainerCheckpoints()")

_HOOK: list = []
_SEEN: "weakref.WeakSet" = weakref.WeakSet()


def install_hook() -> None:
    """Check every optimizer that steps a parallel model's parameters (``parallel_models.py``); once per process."""
    if not _HOOK:
        _HOOK.append(register_optimizer_step_pre_hook(_first_step))


def _first_step(optimizer, _args, _kwargs) -> None:
    if optimizer in _SEEN:
        return
    _SEEN.add(optimizer)
    known = known_parameters()
    if any(id(p) in known for group in optimizer.param_groups for p in group["params"]):
        check_optimizer(optimizer, known)
        optimizer.register_load_state_dict_post_hook(lambda opt: check_optimizer(opt, known_parameters()))


def reads_whole_tensors(optimizer) -> bool:
    """Is it one of ``WHOLE_TENSOR_OPTIMIZERS`` (or a subclass)? Only modules already imported are looked at."""
    kinds = (getattr(sys.modules.get(module), name, None) for module, name in WHOLE_TENSOR_OPTIMIZERS)
    return isinstance(optimizer, tuple(kind for kind in kinds if isinstance(kind, type)))


def _shares_ranks(optimizer, tp_group) -> bool:
    """Is ``optimizer`` a ZeroRedundancyOptimizer whose process group holds two ranks of ``tp_group``?"""
    zero = getattr(sys.modules.get("torch.distributed.optim.zero_redundancy_optimizer"), "ZeroRedundancyOptimizer",
                   None)
    if zero is None or not isinstance(optimizer, zero):
        return False
    import torch.distributed as dist

    ranks = set(dist.get_process_group_ranks(optimizer.process_group))
    return len(ranks & set(dist.get_process_group_ranks(tp_group.process_group))) > 1


def check_optimizer(optimizer, known: dict) -> None:
    """Refuse (``ArgumentError``) a whole-tensor optimizer over plain shards, and a state tensor that cannot be its
    parameter's: of the whole shape next to a shard, plain next to a DTensor view, or, for torch's element-wise
    optimizers (whose states are shaped as the parameter), of any other shape. ``known``: ``known_parameters()``."""
    cls = type(optimizer)
    whole_tensor = reads_whole_tensors(optimizer)
    elementwise = cls.__module__.split(".")[:2] == ["torch", "optim"] and not whole_tensor
    for group in optimizer.param_groups:
        for param in group["params"]:
            if id(param) not in known:
                continue
            entry = known[id(param)]
            name, plan, tp_group = entry.name, entry.plan, entry.tp_group
            whole, sharded = tuple(plan.shape), entry.sharded
            plain = entry.plain
            if sharded and _shares_ranks(optimizer, tp_group):
                raise ArgumentError(
                    f"torch.distributed.optim.ZeroRedundancyOptimizer over the parallel model: after each step it "
                    f"broadcasts every parameter from the rank that updated it, over ranks of one tensor-parallel "
                    f"group, which hold different shards of it ({name}: {list(param.shape)} of {list(whole)} here): "
                    "one rank's shards would overwrite the others'. Shard the optimizer state over data-parallel "
                    "ranks with fxparallel.runtime.apply_data_parallel (FSDP2) instead, or build it over a process "
                    "group of data-parallel peers (ranks holding the same shards)")
            if whole_tensor and sharded and plain and getattr(param, "_fxparallel_view", None) is None:
                raise ArgumentError(  # (a plain parameter with a view is stepped as the view: optimizer_views.py)
                    f"{cls.__module__}.{cls.__name__} over the parallel model's shards would compute its update "
                    f"from this rank's piece of each parameter ({name}: {list(param.shape)} of {list(whole)}), "
                    "not from the whole tensor as on one device. Use an element-wise optimizer (SGD, Adam, AdamW, "
                    "Adagrad, ...) at tp > 1")
            for key, value in optimizer.state.get(param, {}).items():
                if not torch.is_tensor(value) or value.dim() == 0 or isinstance(value, DTensor):
                    continue
                shape = tuple(value.shape)
                if not plain or (shape != tuple(param.shape) and (elementwise or shape == whole)):
                    raise ArgumentError(
                        f"optimizer state {key!r} of the parallel model's parameter {name} "
                        f"({'a DTensor' if not plain else list(param.shape)} on this rank) has "
                        f"{'a plain tensor of ' if not plain else ''}shape {list(shape)}: a state saved by a run of "
                        "another layout (a single-device optimizer.bin, as accelerator.load_state loads), which torch "
                        "pairs with the parameters by position (the parallel model's are its shards, in an order of "
                        f"their own). Nothing was stepped. {RESUME}")
