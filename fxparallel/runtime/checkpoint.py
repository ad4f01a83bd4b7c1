"""Distributed checkpoints (torch.distributed.checkpoint) that load into any (dp, tp, cp) layout.

Every parameter, and every optimizer state tensor shaped like it, is handed to DCP
as a DTensor whose global shape is the FULL model tensor, keyed by its Hugging Face
name (``model.<name>``, ``optim.<name>.<state>``; see ``runtime/dtensor.py`` for how
TP and FSDP placements combine). Each rank writes only what it holds (replicated
pieces once); loading builds the same views for the target layout and DCP reads
the overlapping pieces, so any layout loads any other. The views share the
parameters' storage: saving and loading need no gathered copy (no extra memory
beyond DCP's write buffers).

Directory layout under the checkpoint root::

    step_00000010/     a complete checkpoint: DCP files + fxparallel.json
    latest             name of the newest complete checkpoint
    .tmp-step_00000012 a save in progress (or a crashed one; removed by the next save)

A save writes into the temporary directory and renames it only once every rank has
written and the metadata is on disk, then updates ``latest``. A crash at any point
leaves ``latest`` naming the previous, complete checkpoint; older ones are pruned
only after the new one is in place. The root must be on a file system every rank
sees (one directory for the job).
"""
from __future__ import annotations

import json
import logging
import os
import shutil
from typing import Optional

import torch
import torch.distributed as dist

from ..errors import CheckpointError
from .dtensor import global_view, segment_views, segments_of
from .fsdp import reshard

log = logging.getLogger("fxparallel")

META = "fxparallel.json"
LATEST = "latest"
FORMAT = "fxparallel-dcp/1"


def step_dir_name(step: int) -> str:
    return f"step_{step:08d}"


# ---- state dict ------------------------------------------------------------------
def _params(model):
    """(canonical Hugging Face name, parameter, ParamPlan) for each distinct (sharded) parameter."""
    reshard(model)
    for name, param in model.named_parameters():
        plan = model.plan.param(name)
        yield plan.name, param, plan


def _optimizer_has_state(model, optimizer) -> bool:
    states = [bool(optimizer.state.get(p)) for _, p, _ in _params(model)]
    if any(states) and not all(states):
        missing = [n for (n, _, _), s in zip(_params(model), states) if not s]
        raise CheckpointError(f"the optimizer has state for some parameters but not for {', '.join(missing[:5])}")
    return bool(states) and all(states)


def init_optimizer_state(model, optimizer) -> None:
    """Create the optimizer's state (e.g. AdamW moments) without changing any parameter:
    one step with zero gradients and learning rate 0. Needed before loading into it."""
    if _optimizer_has_state(model, optimizer):
        return
    params = [p for _, p, _ in _params(model)]
    saved_grads = [p.grad for p in params]
    saved_lr = [g["lr"] for g in optimizer.param_groups]
    for p in params:
        p.grad = torch.zeros_like(p)
    for g in optimizer.param_groups:
        g["lr"] = 0.0
    optimizer.step()
    for g, lr in zip(optimizer.param_groups, saved_lr):
        g["lr"] = lr
    for p, grad in zip(params, saved_grads):
        p.grad = grad


def _add_views(state: dict, key: str, tensor, plan, mesh, write_backs: list) -> None:
    """``state[key]``: the full-shape DTensor view of ``tensor``; a fused weight (segmented shard)
    gets one entry per segment, ``key.segment<i>`` (see ``dtensor.segment_views``)."""
    if segments_of(plan):
        views, write_back = segment_views(tensor, plan, mesh)
        for i, view in views.items():
            state[f"{key}.segment{i}"] = view
        write_backs.append(write_back)
    else:
        state[key] = global_view(tensor, plan, mesh)


def state_dict_views(model, optimizer, mesh, with_optimizer: bool, write_backs: Optional[list] = None) -> dict:
    """Flat {key: tensor} for DCP: full-shape DTensor views, plus scalar optimizer states.

    ``write_backs`` collects what must run after a load to put values that DCP loaded into
    temporary copies (fused weights under FSDP) back into the parameters."""
    state = {}
    write_backs = [] if write_backs is None else write_backs
    for name, param, plan in _params(model):
        _add_views(state, f"model.{name}", param.detach(), plan, mesh, write_backs)
        if not with_optimizer:
            continue
        for key, value in optimizer.state[param].items():
            full_key = f"optim.{name}.{key}"
            if not isinstance(value, torch.Tensor):
                raise CheckpointError(f"optimizer state {key!r} of {name} is a {type(value).__name__}; "
                                      "only tensor states are supported")
            if tuple(value.shape) == tuple(param.shape):
                _add_views(state, full_key, value, plan, mesh, write_backs)
            elif value.numel() == 1:
                state[full_key] = value  # e.g. Adam's step: the same on every rank
            else:
                raise CheckpointError(f"optimizer state {key!r} of {name} has shape {tuple(value.shape)}, neither "
                                      f"the parameter's {tuple(param.shape)} nor a scalar")
    return state


def _group_hyperparameters(optimizer) -> list:
    out = []
    for g in optimizer.param_groups:
        out.append({k: v for k, v in g.items() if k != "params" and _jsonable(v)})
    return out


def _jsonable(v) -> bool:
    if v is None or isinstance(v, (bool, int, float, str)):
        return True
    if isinstance(v, (tuple, list)):
        return all(_jsonable(x) for x in v)
    return False


# ---- coordination ------------------------------------------------------------------
def _agree(ok: bool, mesh) -> bool:
    """True when every rank says ok (also a barrier)."""
    flag = torch.tensor([0.0 if ok else 1.0], device=mesh.device)
    dist.all_reduce(flag)
    return flag.item() == 0


def _write_text(path: str, text: str) -> None:
    """Write then rename: a reader sees the old or the new content, never a partial file."""
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def list_checkpoints(root: str) -> list:
    """Complete checkpoints under ``root``, oldest first: [(step, directory)]."""
    if not os.path.isdir(root):
        return []
    found = []
    for entry in os.listdir(root):
        path = os.path.join(root, entry)
        if entry.startswith("step_") and os.path.exists(os.path.join(path, META)):
            try:
                found.append((int(entry[len("step_"):]), path))
            except ValueError:
                continue
    return sorted(found)


def latest_checkpoint(root: str) -> Optional[str]:
    """The directory ``latest`` names (else the newest complete one), or None."""
    pointer = os.path.join(root, LATEST)
    if os.path.exists(pointer):
        with open(pointer) as f:
            path = os.path.join(root, f.read().strip())
        if os.path.exists(os.path.join(path, META)):
            return path
    found = list_checkpoints(root)
    return found[-1][1] if found else None


# ---- save / load -------------------------------------------------------------------
def save_checkpoint(root: str, model, optimizer, mesh, step: int, *, extra: Optional[dict] = None,
                    keep: int = 2) -> str:
    """Save model and optimizer state as ``root/step_<step>`` (collective). Returns its path.

    ``extra``: JSON-serializable data to keep with it (e.g. a scheduler's state).
    ``keep``: how many complete checkpoints to keep (older ones are deleted after
    the new one is complete).
    """
    import torch.distributed.checkpoint as dcp

    name = step_dir_name(step)
    final = os.path.join(root, name)
    tmp = os.path.join(root, ".tmp-" + name)
    ok = True
    if mesh.rank == 0:
        try:
            os.makedirs(root, exist_ok=True)
            if os.path.exists(tmp):
                shutil.rmtree(tmp)  # left by a crashed save
            os.makedirs(tmp)
        except OSError as err:
            log.error("cannot create %s: %s", tmp, err)
            ok = False
    if not _agree(ok, mesh):
        raise CheckpointError(f"rank 0 could not create the checkpoint directory {tmp}")

    with_optimizer = optimizer is not None and _optimizer_has_state(model, optimizer)
    state = state_dict_views(model, optimizer, mesh, with_optimizer)
    try:
        dcp.save(state, storage_writer=dcp.FileSystemWriter(tmp))  # raises on every rank if any rank failed
    except dcp.CheckpointException as err:  # a BaseException: turn it into an ordinary error
        raise CheckpointError(f"saving {final} failed ({_failures(err)}); the previous checkpoint "
                              f"({latest_checkpoint(root) or 'none'}) is kept") from None

    error = None
    if mesh.rank == 0:
        try:
            meta = {"format": FORMAT, "step": step, "layout": mesh.layout(), "model_type": model.plan.model_type,
                    "optimizer_state": with_optimizer,
                    "param_groups": _group_hyperparameters(optimizer) if optimizer is not None else None,
                    "extra": extra or {}}
            _write_text(os.path.join(tmp, META), json.dumps(meta, indent=2))
            if os.path.exists(final):  # saving the same step again: replace it
                shutil.rmtree(final)
            os.rename(tmp, final)
            _write_text(os.path.join(root, LATEST), name)
            for _, old in list_checkpoints(root)[:-keep] if keep > 0 else []:
                if old != final:
                    shutil.rmtree(old, ignore_errors=True)
        except (OSError, TypeError, ValueError) as err:
            error = err
    if not _agree(error is None, mesh):
        if error is not None:
            raise CheckpointError(f"finishing checkpoint {final} failed: {error}") from error
        raise CheckpointError(f"rank 0 failed to finish checkpoint {final}; the previous one is kept")
    return final


def _failures(err) -> str:
    """'rank 1: OSError: disk full' for each failed rank of a DCP CheckpointException."""
    parts = []
    for rank, (exc, _) in sorted(err.failures.items()):
        parts.append(f"rank {rank}: {type(exc).__name__}: {exc}")
    return "; ".join(parts)


def _resolve(path: str) -> str:
    if os.path.exists(os.path.join(path, META)):
        return path
    found = latest_checkpoint(path)
    if found is None:
        raise CheckpointError(f"no complete checkpoint in {path} (no {META} there nor in a step_* subdirectory)")
    return found


def _check_against_metadata(state: dict, directory: str) -> None:
    """Clear errors for a checkpoint of another model, before DCP reads anything."""
    import torch.distributed.checkpoint as dcp

    saved = dcp.FileSystemReader(directory).read_metadata().state_dict_metadata
    missing = [k for k in state if k not in saved]
    if missing:
        raise CheckpointError(f"checkpoint {directory} lacks {len(missing)} tensor(s) the model needs: "
                              f"{', '.join(missing[:5])}{' ...' if len(missing) > 5 else ''}")
    for key, value in state.items():
        size = getattr(saved[key], "size", None)
        if size is not None and tuple(size) != tuple(value.shape):
            raise CheckpointError(f"checkpoint {directory}: {key} has shape {list(size)}, the model's is "
                                  f"{list(value.shape)}")


def load_checkpoint(path: str, model, optimizer, mesh) -> dict:
    """Load ``path`` (a checkpoint directory, or a root: its latest) into ``model`` and ``optimizer``
    in place, whatever layout it was saved with (collective). Returns its metadata
    (``step``, ``layout``, ``extra``, ...)."""
    import torch.distributed.checkpoint as dcp

    directory = _resolve(path)
    with open(os.path.join(directory, META)) as f:
        meta = json.load(f)
    if meta.get("format") != FORMAT:
        raise CheckpointError(f"{directory}/{META} has format {meta.get('format')!r}, expected {FORMAT!r}")
    with_optimizer = optimizer is not None and meta.get("optimizer_state", False)
    if with_optimizer:
        init_optimizer_state(model, optimizer)
    write_backs = []
    state = state_dict_views(model, optimizer, mesh, with_optimizer, write_backs)
    _check_against_metadata(state, directory)
    try:
        dcp.load(state, storage_reader=dcp.FileSystemReader(directory))
    except dcp.CheckpointException as err:
        raise CheckpointError(f"loading {directory} failed ({_failures(err)})") from None
    with torch.no_grad():
        for write_back in write_backs:
            write_back()
    if with_optimizer and meta.get("param_groups"):
        groups = meta["param_groups"]
        if len(groups) != len(optimizer.param_groups):
            raise CheckpointError(f"checkpoint has {len(groups)} optimizer param groups, the optimizer "
                                  f"{len(optimizer.param_groups)}")
        for group, saved in zip(optimizer.param_groups, groups):
            for k, v in saved.items():
                group[k] = tuple(v) if isinstance(group.get(k), tuple) else v
    return meta
