"""Trainer checkpoints that resume exactly: the optimizer, learning-rate schedule and random state Trainer does not
save for a model sharded before it saw it.

transformers' Trainer refuses ``save_strategy`` for every model sharded at load (its own ``tp_plan`` models and this
library's): it cannot ``torch.save`` an optimizer whose states are spread over the ranks, and asks for
``save_only_model=True``. Its checkpoints then hold the model (``save_pretrained``: complete tensors, which
``resume_from_checkpoint`` loads back into the shards, ``full_state_loading.py``) and ``trainer_state.json``, but no
optimizer, schedule or random state, so a resumed run silently starts a fresh optimizer. ``TrainerCheckpoints``,
a ``TrainerCallback``, adds what is missing to each checkpoint folder when Trainer saves, and puts it back when a
resumed run begins:

- the optimizer state through torch.distributed.checkpoint (each rank writes its pieces of every state as parts
  of the full-shape tensor, named by parameter, as ``model.state_dict()`` does: ``dcp_state.py``; under FSDP,
  ``runtime.apply_data_parallel``, the rows of them its chunk of the tp shard holds), in ``fxparallel_optimizer/``;
- the optimizer's hyperparameters (each parameter group's learning rate, betas, ...) and the learning-rate
  scheduler's ``state_dict()`` as JSON (rank 0), ``fxparallel_trainer_state.json``;
- each process's random states in Trainer's own file (``rng_state_{rank}.pth``), which Trainer's resume reads
  itself.

A resumed run without these files (a checkpoint saved without the callback), or whose files were saved with other
weights than those Trainer loaded (another run's folder), is refused before its first step."""
from __future__ import annotations

import json
import os
import random
from typing import Optional

import torch
from transformers import TrainerCallback

from .errors import CheckpointError

OPTIMIZER_DIR = "fxparallel_optimizer"
STATE_FILE = "fxparallel_trainer_state.json"


class TrainerCheckpoints(TrainerCallback):
    """``Trainer(..., args=TrainingArguments(..., save_only_model=True), callbacks=[TrainerCheckpoints()])``: every
    checkpoint resumes exactly (see the module docstring). ``resume_from``: the checkpoint folder a resumed run
    reads (default: ``checkpoint-<step>`` in ``output_dir``, what ``resume_from_checkpoint=True`` picks)."""

    def __init__(self, resume_from: Optional[str] = None):
        self.resume_from = resume_from

    def on_save(self, args, state, control, model=None, optimizer=None, lr_scheduler=None, **kwargs):
        from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

        directory = os.path.join(args.output_dir, f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}")
        save(directory, model, optimizer, lr_scheduler, args)

    def on_train_begin(self, args, state, control, model=None, optimizer=None, lr_scheduler=None, **kwargs):
        if state.global_step == 0:  # not a resumed run
            return
        from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

        directory = self.resume_from or os.path.join(args.output_dir, f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}")
        load(directory, model, optimizer, lr_scheduler)


def _weights_digest(model) -> dict:
    """{parameter name: the sum of squares of the whole parameter} (all-reduced over the tp group, and under FSDP over
    its shard group first, whose chunks split each shard; HSDP's replicas hold the same chunks; the same at any layout
    up to rounding): which weights an optimizer state belongs to."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    from .runtime.dtensor import fsdp_mesh_dim, local_part
    from .runtime.fsdp import is_data_parallel, reshard

    group = model.tp_group
    if is_data_parallel(model):
        reshard(model)
    names, sums, chunked = [], [], None
    for name, param in model.local_named_parameters():
        plan = model.plan.param(name)
        whole_here = plan.placement.is_shard or group.rank == 0  # a replicated one counted once
        names.append(name)
        local = local_part(param.detach())
        sums.append(local.double().pow(2).sum() if whole_here else local.new_zeros((), dtype=torch.float64))
        if isinstance(param, DTensor) and fsdp_mesh_dim(param) is not None:  # FSDP's chunks (all on one mesh)
            chunked = param.device_mesh.get_group(fsdp_mesh_dim(param))
    total = torch.stack(sums)
    if chunked is not None:
        dist.all_reduce(total, group=chunked)
    if group.size > 1 and group.process_group is not None:
        dist.all_reduce(total, group=group.process_group)
    return dict(zip(names, total.tolist()))


def _check_weights(directory: str, saved: dict, model) -> None:
    """Refuse optimizer states saved with other weights than the model now holds (Trainer loaded them from the
    checkpoint it resumes: another folder's states would be silently wrong)."""
    now = _weights_digest(model)
    differ = [n for n in sorted(set(saved) | set(now))
              if n not in saved or n not in now or abs(now[n] - saved[n]) > 1e-6 * max(abs(saved[n]), 1e-30)]
    if differ:
        raise CheckpointError(f"resuming from {directory}: its optimizer states were saved with other weights than "
                              f"the model Trainer resumed holds ({', '.join(differ[:3])}"
                              f"{', ...' if len(differ) > 3 else ''} differ): pass TrainerCheckpoints(resume_from=...) "
                              f"the folder Trainer resumes from")


def _optimizer(optimizer):
    return getattr(optimizer, "optimizer", optimizer)  # accelerate's AcceleratedOptimizer holds the torch one


def _optimizer_states(model, optimizer) -> dict:
    """{parameter name: the optimizer's state of it}, for every trained parameter, named (not by the optimizer's
    positions) so that DCP matches them whatever order the parameters were given in. A state of a parameter's
    shape (Adam's moments) is handed out as this rank's local tensor (the same storage: ``dcp.load`` fills the
    optimizer's own) carrying DCP's protocol for the pieces of the full tensor it holds (``dcp_state.describe``):
    DCP's own handling of the DTensors cannot place a fused weight's pieces (``_StridedShard``: "overlapping
    chunks"), nor, under FSDP, a dp chunk of a tp shard (FSDP's DTensor is of the shard: DCP would take it for the
    whole tensor)."""
    from torch.distributed.tensor import DTensor

    from .dcp_state import describe, fsdp_rows_of
    from .runtime.fsdp import is_data_parallel, reshard

    fsdp = is_data_parallel(model)
    if fsdp:
        reshard(model)
    group = model.tp_group
    out = {}
    for name, param in model.named_parameters():
        if param not in optimizer.state:
            continue
        plan, entry = model.plan.param(name), {}
        for key, value in optimizer.state[param].items():
            if isinstance(value, DTensor) and value.shape == param.shape:
                rows = fsdp_rows_of(value) if fsdp else None  # FSDP's chunk of the tp shard (else a tp view's)
                value = value.to_local().detach()
                if plan.placement.is_shard or rows is not None:
                    describe(value, plan, group.rank, group.size, rows=rows)
            entry[key] = value
        out[name] = entry
    return out


def _create_states(optimizer) -> None:
    """Create the optimizer's states before the checkpoint's are loaded into them, changing no parameter."""
    from .runtime.checkpoint import step_without_change

    params = [p for group in optimizer.param_groups for p in group["params"] if p.requires_grad]
    if not all(p in optimizer.state for p in params):
        step_without_change(optimizer, params)


def save(directory: str, model, optimizer, lr_scheduler, args) -> None:
    """Write the optimizer, scheduler and random states of a Trainer checkpoint into ``directory``."""
    import torch.distributed.checkpoint as dcp

    state = {"param_groups": [{k: v for k, v in group.items() if k != "params"}
                              for group in _optimizer(optimizer).param_groups],
             "scheduler": lr_scheduler.state_dict() if lr_scheduler is not None else None,
             "weights": _weights_digest(model)}
    try:  # on every rank (they hold the same), so that all refuse alike
        text = json.dumps(state)
    except TypeError as err:
        raise CheckpointError(f"the optimizer's hyperparameters or the learning-rate scheduler's state_dict() are not "
                              f"plain data ({err}): TrainerCheckpoints writes them as JSON") from None
    dcp.save(_optimizer_states(model, _optimizer(optimizer)), checkpoint_id=os.path.join(directory, OPTIMIZER_DIR))
    if args.process_index == 0:
        with open(os.path.join(directory, STATE_FILE), "w") as f:
            f.write(text)
    _save_random_states(directory, args)


def _save_random_states(directory: str, args) -> None:
    """Trainer's ``rng_state_{rank}.pth`` (what its ``_load_rng_state`` reads when a run resumes)."""
    import numpy as np

    from transformers.training_args import ParallelMode

    states = {"python": random.getstate(), "numpy": np.random.get_state(), "cpu": torch.random.get_rng_state()}
    if torch.cuda.is_available():  # as Trainer writes it (and reads it back)
        distributed = args.parallel_mode == ParallelMode.DISTRIBUTED
        states["cuda"] = torch.cuda.random.get_rng_state_all() if distributed else torch.cuda.random.get_rng_state()
    name = f"rng_state_{args.process_index}.pth" if args.world_size > 1 else "rng_state.pth"
    torch.save(states, os.path.join(directory, name))


def load(directory: str, model, optimizer, lr_scheduler) -> None:
    """Put a checkpoint's optimizer and scheduler states back (before the resumed run's first step); refused
    before anything changes where the checkpoint lacks them."""
    import torch.distributed.checkpoint as dcp

    missing = [n for n in (OPTIMIZER_DIR, STATE_FILE) if not os.path.exists(os.path.join(directory, n))]
    if missing:
        raise CheckpointError(f"resuming from {directory}: it has no {' or '.join(missing)} (a checkpoint saved "
                              f"without fxparallel.TrainerCheckpoints, or another folder: pass "
                              f"TrainerCheckpoints(resume_from=...)); the resumed run would start a fresh optimizer")
    with open(os.path.join(directory, STATE_FILE)) as f:
        saved = json.load(f)
    _check_weights(directory, saved.get("weights", {}), model)
    optimizer = _optimizer(optimizer)
    if len(saved["param_groups"]) != len(optimizer.param_groups):
        raise CheckpointError(f"resuming from {directory}: the optimizer has {len(optimizer.param_groups)} parameter "
                              f"groups, the checkpoint {len(saved['param_groups'])}")
    _create_states(optimizer)
    dcp.load(_optimizer_states(model, optimizer), checkpoint_id=os.path.join(directory, OPTIMIZER_DIR))  # in place
    # the hyperparameters, the learning rate among them (a scheduler sets it in the groups when it steps; loading
    # its state does not)
    for group, hyper in zip(optimizer.param_groups, saved["param_groups"]):
        group.update({k: tuple(v) if isinstance(group.get(k), tuple) else v for k, v in hyper.items()})
    if lr_scheduler is not None and saved["scheduler"] is not None:
        lr_scheduler.load_state_dict(saved["scheduler"])
