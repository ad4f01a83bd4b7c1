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

    step_00000010/      a complete checkpoint: DCP files + fxparallel.json (written last)
    latest              name of the newest complete checkpoint (a plain step_* name)
    .tmp-step_00000012  a save in progress (or a crashed one; removed by the next save)
    .old-step_00000010  step_00000010 moved aside while it is saved again (a crash there
                        leaves it: loading and listing use it, the next save puts it back)
    .trash-step_...     a pruned checkpoint being deleted (removed by the next save)

A checkpoint is complete when its ``fxparallel.json`` is present and valid. A save
writes into the temporary directory and renames it only once every rank has written
and the metadata is on disk, then updates ``latest``; saving a step that exists moves
the old directory aside, renames the new one in, then deletes the old one, so a crash
at any point leaves a complete copy of every step. Older checkpoints are pruned only
after the new one is in place, by renaming them to a trash name before deleting.

What loading trusts: nothing in the directory runs code. DCP's ``.metadata`` is a pickle;
fxparallel reads it (before DCP does, and as DCP's reader) with a restricted unpickler that
builds only DCP's metadata classes, torch.Size, dtypes and layouts, and refuses any other
global (``os.system``, ``builtins.eval``...) with a CheckpointError naming the file and the
global before any of it runs (``_MetadataUnpickler``). Non-tensor entries, which DCP would
``torch.load(weights_only=False)``, are refused too: fxparallel saves only tensors. The save
records the file's sha256 in ``fxparallel.json``; the load refuses a mismatch, and a checkpoint
without a digest unless ``trust_metadata=True``. The digest is a damage check, not a signature
(whoever can write the directory can write a matching ``fxparallel.json``). ``latest`` is
followed only if it names a ``step_*`` directory of the root; ``latest`` and ``fxparallel.json``
are written through fresh temporary files, never through a name planted in advance. The root
must be on a file system every rank sees (one directory for the job).
"""
from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
import pathlib
import pickle
import re
import secrets
import shutil
from typing import Optional

import torch
import torch.distributed as dist

from ..errors import CheckpointError
from .dtensor import global_view, segment_views, segments_of
from .fsdp import reshard
from .fused_forms import SEGMENT, in_saved_form, without_segment
from .experts_over_dp import run_views

log = logging.getLogger("fxparallel")

META = "fxparallel.json"
LATEST = "latest"
FORMAT = "fxparallel-dcp/1"
DCP_METADATA = ".metadata"
TMP, ASIDE, TRASH = ".tmp-", ".old-", ".trash-"  # prefixes of a step directory's name
STEP_NAME = re.compile(r"step_([0-9]{8,})")  # step_dir_name's names; nothing else is a checkpoint


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
    step_without_change(optimizer, [p for _, p, _ in _params(model)])


def step_without_change(optimizer, params: list) -> None:
    """One step of ``optimizer`` with zero gradients on ``params`` at learning rate 0: creates its state (Adam's
    moments) and changes no parameter; the gradients and learning rates are put back."""
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


def _add_views(state: dict, key: str, tensor, plan, mesh, run=None) -> None:
    """``state[key]``: the full-shape DTensor view of ``tensor``; a fused weight (segmented shard)
    gets one entry per segment, ``key.segment<i>`` (see ``dtensor.segment_views``). ``run``: ``tensor`` holds a
    run of experts (experts over dp ranks: ``experts_over_dp.run_views``), under the same keys."""
    if run is not None:
        state.update({f"{key}{suffix}": view for suffix, view in run_views(tensor, plan, run, mesh).items()})
    elif segments_of(plan):
        for i, view in segment_views(tensor, plan, mesh).items():
            state[f"{key}{SEGMENT}{i}"] = view
    else:
        state[key] = global_view(tensor, plan, mesh)


def state_dict_views(model, optimizer, mesh, with_optimizer: bool) -> dict:
    """Flat {key: tensor} for DCP: full-shape views of the parameters and optimizer states (DCP writes
    and loads them in place), plus scalar optimizer states."""
    state = {}
    for name, param, plan in _params(model):
        run = getattr(param, "_fxparallel_expert_run", None)
        _add_views(state, f"model.{name}", param.detach(), plan, mesh, run)
        if not with_optimizer:
            continue
        for key, value in optimizer.state[param].items():
            full_key = f"optim.{name}.{key}"
            if not isinstance(value, torch.Tensor):
                raise CheckpointError(f"optimizer state {key!r} of {name} is a {type(value).__name__}; "
                                      "only tensor states are supported")
            if tuple(value.shape) == tuple(param.shape):
                _add_views(state, full_key, value, plan, mesh, run)
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
def _on_rank0(mesh, fn, what: str, after: str = "") -> None:
    """Run ``fn`` on rank 0 only (collective): if it fails, every rank raises the same CheckpointError
    (``what`` failed: the error, then ``after``)."""
    message = None
    if mesh.rank == 0:
        try:
            fn()
        except CheckpointError as err:
            message = str(err)
        except (OSError, TypeError, ValueError) as err:
            message = f"{what} failed: {type(err).__name__}: {err}{after}"
    box = [message]
    dist.broadcast_object_list(box, src=0)
    if box[0] is not None:
        raise CheckpointError(box[0])


def _everywhere(mesh, fn, what: str):
    """Run ``fn`` (returning ``(result, key)``) on every rank (collective) and return its result.

    If it raised a CheckpointError on any rank, every rank raises that error; if the ranks' keys
    differ (they found different checkpoints), every rank raises that. Either way no rank goes on
    into a DCP collective that another rank would never join."""
    message, result, key = None, None, None
    try:
        result, key = fn()
    except CheckpointError as err:
        message = str(err)
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, (message, key))
    for rank, (msg, _) in enumerate(gathered):
        if msg is not None:
            raise CheckpointError(msg if msg == message else f"rank {rank}: {msg}")
    if len({repr(k) for _, k in gathered}) > 1:
        found = "; ".join(f"rank {r}: {k}" for r, (_, k) in enumerate(gathered))
        raise CheckpointError(f"the ranks found different checkpoints for {what} ({found}); the checkpoint root "
                              "must be one directory that every rank sees with the same content")
    return result


def _write_text(path: str, text: str) -> None:
    """Write then rename: a reader sees the old or the new content, never a partial file.

    The temporary file is created new (``_create_new``), so a symlink planted at a predictable name
    (``latest.tmp``) is never followed out of the directory."""
    fd, tmp = _create_new(os.path.dirname(path), os.path.basename(path))
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def _create_new(directory: str, base: str):
    """(fd, path) of a new file ``.<base>.<random>.tmp`` in ``directory``: as ``tempfile.mkstemp`` (O_EXCL:
    an existing name, a symlink included, is never opened), but with the mode ``open(path, "w")`` gives
    (0o666 less the umask) rather than mkstemp's 0o600, so other users read the checkpoint as before."""
    for _ in range(100):
        tmp = os.path.join(directory, f".{base}.{secrets.token_hex(8)}.tmp")
        try:
            return os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), 0o666), tmp
        except FileExistsError:
            continue
    raise FileExistsError(f"no free temporary name for {os.path.join(directory, base)}")


# ---- what is on disk ---------------------------------------------------------------
def _marker(directory: str):
    """(its fxparallel.json as a dict, None) when ``directory`` is a complete checkpoint, else
    (None, why not). Complete: the marker, written last by a save, is present and valid."""
    path = os.path.join(directory, META)
    if not os.path.isdir(directory):
        return None, f"{directory} does not exist"
    try:
        with open(path, "rb") as f:
            raw = f.read()
    except FileNotFoundError:
        return None, f"{directory} has no {META} (a save writes it last: the save, or a delete, was interrupted)"
    except OSError as err:
        return None, f"{path} cannot be read ({type(err).__name__}: {err})"
    try:
        meta = json.loads(raw.decode("utf-8"))
    except ValueError as err:  # JSONDecodeError, UnicodeDecodeError
        return None, f"{path} is not valid JSON ({type(err).__name__}: {err})"
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        found = meta.get("format") if isinstance(meta, dict) else type(meta).__name__
        return None, f"{path} has format {found!r}, expected {FORMAT!r}"
    if not isinstance(meta.get("step"), int):
        return None, f"{path} records no integer step"
    return meta, None


def _read_meta(directory: str) -> dict:
    meta, why = _marker(directory)
    if meta is None:
        raise CheckpointError(f"{why}; the checkpoint cannot be loaded. Restore {directory} from a copy, or load "
                              "another step (list_checkpoints gives the complete ones)")
    return meta


def _step_entries(root: str, prefix: str = ""):
    """(step, entry) for each entry of ``root`` named ``prefix`` + a step directory name."""
    try:
        entries = os.listdir(root)
    except OSError:
        return []
    out = []
    for entry in entries:
        if entry.startswith(prefix):
            m = STEP_NAME.fullmatch(entry[len(prefix):])
            if m:
                out.append((int(m.group(1)), entry))
    return out


def list_checkpoints(root: str) -> list:
    """Complete checkpoints under ``root``, oldest first: [(step, directory)].

    A step whose directory is missing but which a re-save interrupted between its renames left
    as ``.old-step_N`` is listed with that directory (the next save renames it back)."""
    found = {}
    for step, entry in _step_entries(root):
        if _marker(os.path.join(root, entry))[0] is not None:
            found[step] = os.path.join(root, entry)
    for step, entry in _step_entries(root, ASIDE):
        path = os.path.join(root, entry)
        if step not in found and _marker(path)[0] is not None:
            log.warning("%s is incomplete or missing; using %s, the copy a re-save of that step moved aside "
                        "before it was interrupted (the next save puts it back)",
                        os.path.join(root, entry[len(ASIDE):]), path)
            found[step] = path
    return sorted(found.items())


def _read_latest(root: str) -> Optional[str]:
    """The step directory name ``root/latest`` holds, or None without one; never a path elsewhere."""
    pointer = os.path.join(root, LATEST)
    try:
        with open(pointer, "rb") as f:
            raw = f.read(4096)
    except FileNotFoundError:
        return None
    except OSError as err:
        raise CheckpointError(f"cannot read {pointer} ({type(err).__name__}: {err}); delete it to use the newest "
                              "complete checkpoint") from None
    name = raw.decode("utf-8", "replace").strip()
    if not STEP_NAME.fullmatch(name):
        shown = name if len(name) <= 100 else name[:100] + "..."
        raise CheckpointError(f"{pointer} names {shown!r}, which is not a checkpoint directory of {root} (a name "
                              "like step_00000010: no '/', no '..'); refusing to follow it. Write the name of one of "
                              "its step_* directories into it, or delete it to use the newest complete checkpoint")
    return name


def latest_checkpoint(root: str) -> Optional[str]:
    """The complete checkpoint ``root/latest`` names (else the newest complete one), or None.

    ``latest`` must hold a step directory name of ``root`` (CheckpointError otherwise: it is never
    followed elsewhere). When the directory it names is missing or incomplete (deleted by hand to
    roll back, say), this logs a warning naming both and returns the newest complete checkpoint."""
    name = _read_latest(root)
    found = list_checkpoints(root)
    if name is None:
        return found[-1][1] if found else None
    step = int(STEP_NAME.fullmatch(name).group(1))
    for s, path in found:
        if s == step and os.path.basename(path) in (name, ASIDE + name):
            return path
    _, why = _marker(os.path.join(root, name))
    fallback = found[-1][1] if found else None
    log.warning("%s names %s, but %s; %s", os.path.join(root, LATEST), name, why,
                f"using the newest complete checkpoint, {fallback}, instead" if fallback
                else "there is no other complete checkpoint")
    return fallback


def _latest_or_none(root: str) -> str:
    try:
        return latest_checkpoint(root) or "none"
    except CheckpointError:
        return "unknown"


def _metadata_digest(directory: str) -> str:
    h = hashlib.sha256()
    with open(os.path.join(directory, DCP_METADATA), "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _identity(model, mesh) -> dict:
    """What wrote a checkpoint: the layout, the model type and a fingerprint of its parameters'
    names and full shapes (the same for every layout of one model)."""
    params = sorted((p.name, [int(d) for d in p.shape]) for p in model.plan.params)
    return {"layout": mesh.layout(), "model_type": model.plan.model_type,
            "model_fingerprint": hashlib.sha256(json.dumps(params).encode()).hexdigest()[:16]}


def _describe(identity: dict) -> str:
    layout = identity.get("layout")
    text = ", ".join(f"{k}={v}" for k, v in layout.items()) if isinstance(layout, dict) else repr(layout)
    return (f"layout {text} (model {identity.get('model_type')}, parameter fingerprint "
            f"{identity.get('model_fingerprint') or 'not recorded'})")


# ---- housekeeping (rank 0) ---------------------------------------------------------
LEFTOVER = re.compile(r"(\.tmp-|\.trash-(\.old-)?)step_[0-9]{8,}")
LEFTOVER_FILE = re.compile(rf"\.{LATEST}\.[0-9a-f]{{16}}\.tmp")  # _write_text's temporary file, of a crash


def _delete(root: str, path: str) -> None:
    """Rename to a trash name (no longer a checkpoint, at once), then delete."""
    trash = os.path.join(root, TRASH + os.path.basename(path))
    if os.path.lexists(trash):
        shutil.rmtree(trash)
    os.rename(path, trash)
    shutil.rmtree(trash)


def _recover(root: str) -> None:
    """Finish what a re-save interrupted between its renames left: ``.old-step_N`` goes back to
    ``step_N`` when that is not complete, else it is deleted."""
    for _, entry in _step_entries(root, ASIDE):
        aside, final = os.path.join(root, entry), os.path.join(root, entry[len(ASIDE):])
        if _marker(final)[0] is not None or _marker(aside)[0] is None:
            _delete(root, aside)
        else:
            if os.path.lexists(final):
                _delete(root, final)
            os.rename(aside, final)
            log.warning("restored %s from %s (a save of that step had been interrupted)", final, aside)


def _refuse_foreign_overwrite(final: str, identity: dict) -> None:
    """Saving a step that a run with another layout or model wrote is refused (different runs
    sharing one root would otherwise overwrite each other's steps)."""
    meta, _ = _marker(final)
    if meta is None:
        return
    differs = [k for k, v in identity.items() if meta.get(k) is not None and meta[k] != v]
    if differs:
        raise CheckpointError(f"refusing to overwrite {final}: it was written with {_describe(meta)}, this run has "
                              f"{_describe(identity)}. Save runs of different layouts or models into different "
                              "directories (e.g. one named after the layout; loading it into this layout works), or "
                              "delete it first to replace it")


def _move_in(tmp: str, final: str, root: str) -> None:
    """Rename the new checkpoint into place. An existing one is moved aside first and deleted
    after: a crash between leaves ``.old-<step>``, which listing, loading and the next save use."""
    aside = os.path.join(root, ASIDE + os.path.basename(final))
    if os.path.lexists(final):
        if os.path.lexists(aside):
            _delete(root, aside)
        os.rename(final, aside)
    os.rename(tmp, final)
    if os.path.lexists(aside):
        _delete(root, aside)


def _prune(root: str, keep: int, final: str) -> None:
    for _, old in list_checkpoints(root)[:-keep] if keep > 0 else []:
        if old != final:
            try:
                _delete(root, old)
            except OSError as err:
                log.warning("could not delete old checkpoint %s: %s", old, err)


def _remove_leftovers(root: str) -> None:
    """Temporary directories of crashed saves and trash of interrupted deletes."""
    for entry in os.listdir(root):
        if LEFTOVER_FILE.fullmatch(entry):
            try:
                os.unlink(os.path.join(root, entry))  # (a symlink there: the link goes, not its target)
            except OSError as err:
                log.warning("could not delete leftover %s: %s", os.path.join(root, entry), err)
        elif LEFTOVER.fullmatch(entry):
            try:
                shutil.rmtree(os.path.join(root, entry))
            except OSError as err:
                log.warning("could not delete leftover %s: %s", os.path.join(root, entry), err)


# ---- DCP's .metadata: a restricted unpickler ------------------------------------------
def _layout_named(name):
    """Stands for ``torch.serialization._get_layout`` (how torch.layout pickles), without its cache: a
    pickle could set attributes on the real function, and torch.load reads that cache."""
    for value in vars(torch).values():
        if isinstance(value, torch.layout) and str(value) == name:
            return value
    raise pickle.UnpicklingError(f"no torch layout is named {name!r}")


def _posix_path(*parts):
    return pathlib.PurePosixPath(*parts)  # StorageMeta.checkpoint_id; a pure path does no I/O


def _windows_path(*parts):
    return pathlib.PureWindowsPath(*parts)


@functools.lru_cache(maxsize=None)
def _metadata_globals() -> dict:
    """{(module, name): object} that a ``.metadata`` may refer to: what DCP's save pickles for the
    tensors fxparallel saves (found by saving checkpoints and listing their globals), nothing that
    runs code. BytesStorageMetadata is left out on purpose: DCP loads such an entry with
    ``torch.load(weights_only=False)``, and fxparallel saves only tensors."""
    from torch.distributed.checkpoint import filesystem, metadata

    classes = [getattr(metadata, n, None) for n in ("Metadata", "TensorStorageMetadata", "TensorProperties",
                                                    "ChunkStorageMetadata", "MetadataIndex", "StorageMeta",
                                                    "_MEM_FORMAT_ENCODING")] + [filesystem._StorageInfo]
    allowed = {(c.__module__, c.__qualname__): c for c in classes if c is not None}
    allowed[("torch", "Size")] = torch.Size
    for name, value in vars(torch).items():
        if isinstance(value, (torch.dtype, torch.layout, torch.memory_format)):
            allowed[("torch", name)] = value
            allowed[("torch._utils", f"torch.{name}")] = value  # how a torch.memory_format pickles
    allowed[("torch.serialization", "_get_layout")] = _layout_named
    for module in ("pathlib", "pathlib._local"):  # (Python 3.13 moved the classes)
        allowed.update({(module, "PosixPath"): _posix_path, (module, "PurePosixPath"): _posix_path,
                        (module, "WindowsPath"): _windows_path, (module, "PureWindowsPath"): _windows_path})
    return allowed


class _MetadataUnpickler(pickle.Unpickler):
    """Unpickles only the globals of ``_metadata_globals``; any other raises a CheckpointError naming the
    file and the global, before it is called (a crafted pickle runs code only through globals)."""

    def __init__(self, file, path: str):
        super().__init__(file)
        self.path = path

    def find_class(self, module, name):
        found = _metadata_globals().get((module, name))
        if found is None:
            why = ("a non-tensor entry, which DCP would load with torch.load(weights_only=False); fxparallel saves "
                   "only tensors" if name == "BytesStorageMetadata" else "not part of DCP's checkpoint metadata")
            raise CheckpointError(f"{self.path} refers to the global {module}.{name} ({why}); refusing to unpickle it, "
                                  "as a crafted file runs code that way. Nothing of it was run. Restore the checkpoint "
                                  "from a copy you trust, or load another step")
        return found


def _mutable_allowed() -> list:
    """The allowed objects a pickle could change for the whole process (BUILD sets attributes on whatever
    it is given, a class included): the classes and the members of the enum. Torch's dtypes, layouts and
    torch.Size take no attributes."""
    out = []
    for value in _metadata_globals().values():
        if isinstance(value, type) and value.__module__.startswith("torch.distributed."):
            out.append(value)
            out.extend(getattr(value, "__members__", {}).values())
    return out


def _restore(before: dict) -> list:
    """Put back the attributes of ``before`` ({object: its vars before}); returns the names of those changed."""
    changed = []
    for obj, attrs in before.items():
        now = dict(vars(obj))
        if now.keys() == attrs.keys() and all(now[k] is v for k, v in attrs.items()):
            continue
        for key in now.keys() - attrs.keys():
            delattr(obj, key)
        for key, value in attrs.items():
            if now.get(key) is not value:
                setattr(obj, key, value)
        changed.append(obj.__qualname__ if isinstance(obj, type) else repr(obj))  # (named once put back)
    return changed


def _unpickle_metadata(file, path: str):
    before = {obj: dict(vars(obj)) for obj in _mutable_allowed()}
    try:
        return _MetadataUnpickler(file, path).load()
    finally:
        changed = _restore(before)
        if changed:
            raise CheckpointError(f"{path} sets attributes of {', '.join(changed)} (process-wide objects, put back "
                                  "now); refusing it, DCP's save never does that. Restore the checkpoint from a copy "
                                  "you trust, or load another step")


def _check_metadata_structure(metadata, path: str, directory: str) -> None:
    """What DCP will use: a Metadata whose data lies in files of ``directory``."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import Metadata

    if not isinstance(metadata, Metadata):
        raise CheckpointError(f"{path} holds a {type(metadata).__name__}, not DCP's Metadata; the file is damaged")
    for info in (metadata.storage_data or {}).values():
        rel = getattr(info, "relative_path", None)
        if not isinstance(info, _StorageInfo) or not isinstance(rel, str):
            raise CheckpointError(f"{path} places data in {info!r}, not a file of {directory}; the file is damaged")
        if not rel or os.path.isabs(rel) or ".." in rel.replace("\\", "/").split("/"):
            raise CheckpointError(f"{path} places data in {rel!r}, outside {directory}; refusing to read it")


@functools.lru_cache(maxsize=None)
def _reader_class():
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import StorageMeta

    class MetadataReader(FileSystemReader):
        """DCP's file system reader whose ``.metadata`` goes through ``_MetadataUnpickler``. What
        FileSystemReader.read_metadata does besides unpickling is kept (the load id). It takes no
        ``rank=``: DCP then never falls back to per-rank ``__<rank>.metadata`` files."""

        def read_metadata(self):
            path = os.path.join(str(self.path), DCP_METADATA)
            with open(path, "rb") as f:
                metadata = _unpickle_metadata(f, path)
            _check_metadata_structure(metadata, path, str(self.path))
            if getattr(metadata, "storage_meta", None) is None:
                metadata.storage_meta = StorageMeta()
            metadata.storage_meta.load_id = self.load_id
            return metadata

    return MetadataReader


def metadata_reader(directory: str):
    """A ``torch.distributed.checkpoint`` storage reader of ``directory`` that never runs code from it:
    every read of ``.metadata`` in fxparallel goes through it (``load_checkpoint`` hands it to dcp.load)."""
    return _reader_class()(directory)


# ---- save / load -------------------------------------------------------------------
def save_checkpoint(root: str, model, optimizer, mesh, step: int, *, extra: Optional[dict] = None,
                    keep: int = 2) -> str:
    """Save model and optimizer state as ``root/step_<step>`` (collective). Returns its path.

    ``extra``: JSON-serializable data to keep with it (e.g. a scheduler's state).
    ``keep``: how many complete checkpoints to keep (older ones are deleted after
    the new one is complete).

    Saving a step that exists replaces it atomically; it is refused (CheckpointError naming both)
    when the existing one was written with another layout or model. Temporary directories of
    crashed saves are removed once this one is complete.
    """
    import torch.distributed.checkpoint as dcp

    name = step_dir_name(step)
    final = os.path.join(root, name)
    tmp = os.path.join(root, TMP + name)
    identity = _identity(model, mesh)

    def prepare():
        os.makedirs(root, exist_ok=True)
        _recover(root)
        _refuse_foreign_overwrite(final, identity)
        if os.path.lexists(tmp):
            shutil.rmtree(tmp)  # left by a crashed save of this step
        os.makedirs(tmp)

    _on_rank0(mesh, prepare, f"creating the checkpoint directory {tmp}")

    with_optimizer = optimizer is not None and _optimizer_has_state(model, optimizer)
    state = state_dict_views(model, optimizer, mesh, with_optimizer)
    try:
        dcp.save(state, storage_writer=dcp.FileSystemWriter(tmp))  # raises on every rank if any rank failed
    except dcp.CheckpointException as err:  # a BaseException: turn it into an ordinary error
        raise CheckpointError(f"saving {final} failed ({_failures(err)}); the previous checkpoint "
                              f"({_latest_or_none(root)}) is kept") from None

    def finish():  # every rank has written (dcp.save ends with a barrier)
        meta = {"format": FORMAT, "step": step, **identity, "metadata_sha256": _metadata_digest(tmp),
                "optimizer_state": with_optimizer,
                "param_groups": _group_hyperparameters(optimizer) if optimizer is not None else None,
                "extra": extra or {}}
        _write_text(os.path.join(tmp, META), json.dumps(meta, indent=2))  # last: now it is complete
        _move_in(tmp, final, root)
        _write_text(os.path.join(root, LATEST), name)
        _prune(root, keep, final)
        _remove_leftovers(root)

    _on_rank0(mesh, finish, f"finishing checkpoint {final}",
              after="; the checkpoints saved before it are kept (listing and loading find them; the next save "
                    "tidies up)")
    return final


def _failures(err) -> str:
    """'rank 1: OSError: disk full' for each failed rank of a DCP CheckpointException."""
    parts = []
    for rank, (exc, _) in sorted(err.failures.items()):
        parts.append(f"rank {rank}: {type(exc).__name__}: {exc or '(no message)'}")
    return "; ".join(parts)


def _resolve(path: str) -> str:
    if os.path.exists(os.path.join(path, META)):
        return path  # a checkpoint directory (its fxparallel.json is checked next)
    base = os.path.basename(os.path.normpath(path))
    if STEP_NAME.fullmatch(base):  # a step directory, missing or incomplete
        aside = os.path.join(os.path.dirname(os.path.normpath(path)), ASIDE + base)
        if _marker(aside)[0] is not None:
            log.warning("%s is missing; using %s, the copy a re-save of that step moved aside before it was "
                        "interrupted (the next save puts it back)", path, aside)
            return aside
        raise CheckpointError(f"{_marker(path)[1]}: not a complete checkpoint. Load another step "
                              "(list_checkpoints gives the complete ones)")
    found = latest_checkpoint(path)
    if found is None:
        raise CheckpointError(f"no complete checkpoint in {path} (no valid {META} there nor in a step_* subdirectory)")
    return found


def _check_metadata_digest(directory: str, meta: dict, trust_metadata: bool) -> None:
    """Compare ``.metadata`` with the digest the save recorded: a damage check (a file replaced, cut or
    taken from another checkpoint), not a defence against a crafted one: ``_MetadataUnpickler`` is."""
    path = os.path.join(directory, DCP_METADATA)
    expected = meta.get("metadata_sha256")
    if expected is None:
        if trust_metadata:
            return
        raise CheckpointError(f"{os.path.join(directory, META)} records no sha256 of {path} (a checkpoint from before "
                              "fxparallel recorded one); without it a damaged or swapped .metadata cannot be told "
                              "from the one saved. If you trust that the checkpoint is intact, pass "
                              "trust_metadata=True to load_checkpoint (a new save of it records the digest)")
    try:
        actual = _metadata_digest(directory)
    except FileNotFoundError:
        raise CheckpointError(f"{path} is missing: the checkpoint is incomplete. Restore {directory} from a copy, or "
                              "load another step") from None
    except OSError as err:
        raise CheckpointError(f"{path} cannot be read ({type(err).__name__}: {err})") from None
    if actual != expected:
        raise CheckpointError(f"{path} was modified after it was written (its sha256 is {actual[:16]}..., "
                              f"{META} records {str(expected)[:16]}...); refusing to unpickle it. Restore the "
                              "checkpoint from a copy you trust, or load another step")


def _check_against_metadata(state: dict, directory: str) -> None:
    """Clear errors for a damaged checkpoint or one of another model, before DCP reads any tensor; fused weights
    the checkpoint holds in the other form are put in its form in ``state`` (``fused_forms.py``)."""
    path = os.path.join(directory, DCP_METADATA)
    try:
        metadata = metadata_reader(directory).read_metadata()
        saved = metadata.state_dict_metadata
    except CheckpointError:
        raise
    except Exception as err:  # noqa: BLE001 - unpickling garbage raises about any type
        raise CheckpointError(f"{path} cannot be read as DCP metadata ({type(err).__name__}: {err}); the file is "
                              f"damaged. Restore {directory} from a copy, or load another step") from None
    ends = {}  # data file -> the end of the last byte range .metadata places in it
    for info in (getattr(metadata, "storage_data", None) or {}).values():
        rel = getattr(info, "relative_path", None)
        if isinstance(rel, str):
            ends[rel] = max(ends.get(rel, 0), int(info.offset) + int(info.length))
    for rel, end in sorted(ends.items()):
        file = os.path.join(directory, rel)  # (inside directory: checked by the reader)
        try:
            size = os.path.getsize(file)
        except OSError:
            raise CheckpointError(f"{file} is missing; {path} places tensor data in it. The checkpoint is incomplete: "
                                  f"restore {directory} from a complete copy, or load another step") from None
        if size < end:
            raise CheckpointError(f"{file} is truncated: {size} bytes, but {path} places tensor data up to byte "
                                  f"{end} in it. Restore {directory} from a complete copy, or load another step")
    # a fused weight saved whole where the model holds its parts, or the other way (experts whole per rank against
    # split inside): read in the checkpoint's form (fused_forms.py)
    failed = in_saved_form(state, {key: md.size for key, md in saved.items() if hasattr(md, "size")})
    if failed:
        raise CheckpointError(f"checkpoint {directory} holds {without_segment(failed[0])} in parts that do not "
                              "make up this model's tensor; it is of another model")
    missing = [k for k in state if k not in saved]
    if missing:
        raise CheckpointError(f"checkpoint {directory} lacks {len(missing)} tensor(s) the model needs: "
                              f"{', '.join(missing[:5])}{' ...' if len(missing) > 5 else ''}")
    for key, value in state.items():
        size = getattr(saved[key], "size", None)
        if size is not None and tuple(size) != tuple(value.size()):  # the full size (a view's is not its shape)
            raise CheckpointError(f"checkpoint {directory}: {key} has shape {list(size)}, the model's is "
                                  f"{list(value.size())}")


def load_checkpoint(path: str, model, optimizer, mesh, *, trust_metadata: bool = False) -> dict:
    """Load ``path`` (a checkpoint directory, or a root: its latest) into ``model`` and ``optimizer``
    in place, whatever layout it was saved with (collective). Returns its metadata
    (``step``, ``layout``, ``extra``, ...).

    Nothing in the checkpoint runs code: DCP's ``.metadata`` (a pickle) is read with a restricted
    unpickler that builds only DCP's metadata classes and refuses any other global (CheckpointError
    naming the file and the global). Its sha256 must equal the one the save recorded in
    ``fxparallel.json`` (a damage check); ``trust_metadata=True`` also loads checkpoints that record
    none (older ones). A digest that does not match is refused either way."""
    import torch.distributed.checkpoint as dcp

    def locate():
        directory = _resolve(path)
        meta = _read_meta(directory)
        _check_metadata_digest(directory, meta, trust_metadata)
        return (directory, meta), (meta["step"], meta.get("metadata_sha256"))

    directory, meta = _everywhere(mesh, locate, path)
    with_optimizer = optimizer is not None and meta.get("optimizer_state", False)
    if with_optimizer:
        init_optimizer_state(model, optimizer)
    state = state_dict_views(model, optimizer, mesh, with_optimizer)
    _everywhere(mesh, lambda: (_check_against_metadata(state, directory), None), path)
    try:
        dcp.load(state, storage_reader=metadata_reader(directory))
    except dcp.CheckpointException as err:
        raise CheckpointError(f"loading {directory} failed ({_failures(err)}); a file of it may be damaged: restore "
                              "it from a copy, or load another step") from None
    if with_optimizer and meta.get("param_groups"):
        groups = meta["param_groups"]
        if len(groups) != len(optimizer.param_groups):
            raise CheckpointError(f"checkpoint has {len(groups)} optimizer param groups, the optimizer "
                                  f"{len(optimizer.param_groups)}")
        for group, saved in zip(optimizer.param_groups, groups):
            for k, v in saved.items():
                group[k] = tuple(v) if isinstance(group.get(k), tuple) else v
    return meta
