"""Fill this rank's parameter shards: from safetensors pieces, from an in-memory model, or by init.

Every check (missing tensors, shapes, dtypes, headers, file sizes) runs before any
parameter is written, and the group agrees on the outcome, so a bad checkpoint leaves
nothing half-loaded and no rank waits for a peer that failed. In a quantized checkpoint fxparallel reads
(``quantization.loaded_format``: fine-grained FP8, MXFP4, compressed-tensors FP8) each quantized piece is read
with the scales covering it and dequantized to the parameter's dtype as it is written (``dequantize.py``).
"""
from __future__ import annotations

import logging
import time
import warnings
from dataclasses import dataclass
from typing import Callable, Optional

import torch

from ..errors import CheckpointError
from .checkpoint_files import CheckpointFiles
from .conversion import ConversionError, Stored, find_conversions
from .coordinate import agree, first_on_node, heartbeat
from .dequantize import bounds
from .expert_runs import pieces_in_run
from .progress import byte_bar
from .quantization import loaded_format
from .safetensors_io import SafetensorsFile, byte_runs, normalize_index

log = logging.getLogger("fxparallel")


def slice_pieces(p, rank: int, tp: int, run: Optional[tuple] = None) -> list:
    """The pieces of the stored tensor ``p`` that this rank keeps: [(source index, destination index)].

    A plain shard is one contiguous slice; a segmented shard (fused q/k/v, gate/up) is one
    piece per segment (``ParamPlan.pieces``); the reader handles any list. ``run``: the experts this rank
    holds of its tp shard (experts over data-parallel ranks, ``expert_runs.py``), the only ones read.
    """
    pieces = p.pieces(rank, tp)
    return pieces if run is None else pieces_in_run(pieces, run)


@dataclass
class _Read:
    path: str
    tensor: str
    source: tuple  # index into the stored tensor
    out: torch.Tensor  # where the piece goes: a view of this rank's shard
    nbytes: int
    offset: int  # where the piece starts in the file (reads go in file order)
    decode: Optional[Callable] = None  # a quantized piece: decode(handle) reads and dequantizes it (dequantize.py)


MAX_LISTED = 8


def _absent_note(name: str, absent: list) -> str:
    if not absent or absent == [name]:
        return name
    more = f" and {len(absent) - MAX_LISTED} more" if len(absent) > MAX_LISTED else ""
    return f"{name} (absent: {', '.join(absent[:MAX_LISTED])}{more})"


def _conversions(module, plan, needed: dict, files: CheckpointFiles, shape_of_stored, meta_model):
    """How the parameters in ``needed`` are stored (transformers' conversion mapping), or None."""
    if meta_model is None:
        from ..capture import build_meta_model

        try:
            meta_model = build_meta_model(module.config, dtype=torch.float32)
        except Exception as err:  # noqa: BLE001 - e.g. remote code: no conversion mapping then
            log.debug("no meta model for the conversion mapping: %s", err)
            return None
    shapes = {n: tuple(p.shape) for p in plan.params for n in p.names}
    return find_conversions(meta_model, needed, shapes, files.weight_map, shape_of_stored, shapes.__getitem__,
                            module.config)


def _plan_reads(module, plan, files: CheckpointFiles, rank: int, tp: int, meta_model=None) -> list:
    """Check the checkpoint against the plan (headers only); returns the pieces to read and the files.

    A parameter is read from the tensor of its own name (or of a tied alias) when the checkpoint has
    one; else from the tensors transformers' conversion mapping builds it from (see conversion.py)."""
    stored = files.weight_map
    headers = {}

    def header(tensor: str):
        path = stored[tensor]
        if path not in headers:
            headers[path] = SafetensorsFile(path)
        return headers[path].tensors.get(tensor), path

    def shape_of_stored(tensor: str) -> tuple:
        info, path = header(tensor)
        if info is None:
            raise ConversionError(f"tensor {tensor!r} is listed in the index for {path}, which does not hold it")
        return info.shape

    form = loaded_format(module.config)  # a quantized checkpoint: dequantized on load
    held = getattr(module, "expert_runs", None) or {}  # experts over data-parallel ranks: this rank's runs
    direct = {p.name: next((n for n in p.names if n in stored), None) for p in plan.params}
    packed, problems = {}, []  # parameters stored in the format's own layout (MXFP4's X_blocks / X_scales)
    for p in (p for p in plan.params if form is not None and direct[p.name] is None):
        node, why = form.parameter(p.name, tuple(p.shape), stored, header)
        if node is not None or why is not None:
            packed[p.name] = node  # None: refused (``why``)
            problems += [why] if why is not None else []
    needed = {n: tuple(p.shape) for p in plan.params if direct[p.name] is None and p.name not in packed
              for n in p.names}
    conv = _conversions(module, plan, needed, files, shape_of_stored, meta_model) if needed else None
    converted, missing = {}, []
    for p in plan.params:
        if direct[p.name] is not None or p.name in packed:
            continue
        name = next((n for n in p.names if conv is not None and n in conv.groups), None)
        if name is None:
            expected = next((list(conv.expected[n]) for n in p.names if conv is not None and n in conv.expected), [])
            missing.append(_absent_note(p.name, [n for n in expected if n not in stored]))
        elif conv.absent(name, stored):
            missing.append(_absent_note(p.name, conv.absent(name, stored)))
        else:
            converted[p.name] = name
    if missing:
        where = files.source or "the checkpoint"
        raise CheckpointError(f"{where} has no weights for {len(missing)} parameter(s): {', '.join(missing)}")
    known = {n for p in plan.params for n in p.names} | {n for n, _ in module.named_buffers()}
    used = known | (conv.consumed if conv is not None else set())
    if form is not None:  # the scales of the weights the model uses are read with them
        used |= {c for n in used for c in form.companions(n, stored)}
    extra = sorted(set(stored) - used)
    if extra:
        warnings.warn(f"{files.source or 'checkpoint'} has {len(extra)} tensor(s) the model does not use: "
                      f"{', '.join(extra)}", stacklevel=4)
    reads, companions, dequantized = [], {}, False
    for p in plan.params:
        tensor = direct[p.name]  # tied: read once, under one name
        if p.name in packed:
            node = packed[p.name]
            if node is None:
                continue
        elif tensor is not None:
            info, path = header(tensor)
            if info is None:
                problems.append(f"tensor {tensor!r} is listed in the index for {path}, which does not hold it")
                continue
            if info.shape != tuple(p.shape):
                problems.append(f"tensor {tensor!r} in {path} has shape {list(info.shape)} but the config gives "
                                f"{list(p.shape)}")
                continue
            node = Stored(tensor, info.shape)
        else:
            node = _converted_node(p, converted[p.name], conv, header, problems)
            if node is None:
                continue
        merged = tensor is None and p.name not in packed and conv.groups[converted[p.name]].converter is not None
        bad = [n for n in node.leaves() if header(n)[0].torch_dtype is None]
        for n in bad:
            info, path = header(n)
            problems.append(f"tensor {n!r} in {path} has dtype {info.dtype}, which fxparallel cannot read")
        if bad:
            continue
        if form is not None:
            why = [w for w in (form.problem(n, header, stored) for n in node.leaves()) if w is not None]
            if why:
                problems += why
                continue
            dequantized = dequantized or any(form.is_quantized(n, header) for n in node.leaves())
        param = module.get_parameter(p.name).detach()
        for source, dest in slice_pieces(p, rank, tp, held.get(p.name)):
            for tensor, index, out in node.pieces(normalize_index(p.shape, source), param[dest]):
                info, path = header(tensor)
                piece = None if form is None else form.piece(tensor, bounds(index), out, header, companions, merged)
                if piece is not None:
                    if piece.nbytes:
                        reads.append(_Read(path, tensor, index, out, piece.nbytes, piece.offset, piece.decode))
                    continue
                runs = byte_runs(info.shape, normalize_index(info.shape, index), info.itemsize)
                if runs:
                    reads.append(_Read(path, tensor, index, out, sum(n for _, n in runs), info.start + runs[0][0]))
    for name, buffer in module.named_buffers():
        if name in stored:  # persistent buffers hold trained values too (e.g. MoE routing score biases)
            info, path = header(name)
            if info is None or info.shape != tuple(buffer.shape):
                problems.append(f"buffer {name!r} in {path} has shape {None if info is None else list(info.shape)} "
                                f"but the model has {list(buffer.shape)}")
                continue
            index = normalize_index(info.shape, ())
            runs = byte_runs(info.shape, index, info.itemsize)
            if runs:
                reads.append(_Read(path, name, (), buffer, sum(n for _, n in runs), info.start + runs[0][0]))
    if problems:
        raise CheckpointError("the checkpoint does not match the model:\n  " + "\n  ".join(problems))
    if dequantized:  # shown by print(model) (summary.py)
        module.dequantized_from = form.label
    reads.sort(key=lambda r: (r.path, r.offset))
    first = sorted(companions.values(), key=lambda r: (r.path, r.offset))  # scales, before the pieces using them
    return [_Read(r.path, r.tensor, r.source, r.out, r.nbytes, r.offset) for r in first] + reads, headers


def _converted_node(p, name: str, conv, header, problems: list):
    """The symbolic tensor of a converted parameter after checking its stored tensors; None (and
    ``problems`` extended) if they do not fit."""
    group = conv.groups[name]
    expected = conv.expected.get(name, {})
    ok = True
    for tensor in group.sources:
        info, path = header(tensor)
        if info is None:
            problems.append(f"tensor {tensor!r} is listed in the index for {path}, which does not hold it")
            ok = False
        elif tensor in expected and info.shape != expected[tensor]:
            problems.append(f"tensor {tensor!r} in {path} has shape {list(info.shape)} but the config gives "
                            f"{list(expected[tensor])}")
            ok = False
    if expected and set(group.sources) & set(expected):  # save_pretrained's layout: nothing else belongs
        for tensor in group.sources:
            if tensor not in expected:
                problems.append(f"tensor {tensor!r} in {header(tensor)[1]} does not fit the config: {p.name} is "
                                f"stored as {len(expected)} tensor(s), e.g. {next(iter(expected))!r}")
                ok = False
    if not ok:
        return None
    sources = ", ".join(repr(t) for t in group.sources[:MAX_LISTED])
    sources += " ..." if len(group.sources) > MAX_LISTED else ""
    where = header(group.sources[0])[1]
    if group.error is not None:
        problems.append(f"{p.name} cannot be built from its stored tensors {sources} in {where}: {group.error}")
        return None
    node = group.made[name]
    if tuple(node.shape) != tuple(p.shape):
        problems.append(f"{p.name} built from its stored tensors {sources} in {where} has shape {list(node.shape)} "
                        f"but the config gives {list(p.shape)}")
        return None
    return node


def _progress(total: int, rank: int, tp: int):
    return byte_bar(f"loading rank {rank}/{tp} shards", total, show=first_on_node())


def load_from_files(module, plan, files: CheckpointFiles, rank: int, tp: int, *, progress: bool = True,
                    meta_model=None) -> int:
    """Read each parameter's rank pieces from the checkpoint into the shards; returns bytes read.

    ``meta_model``: the transformers model on the meta device, for its conversion mapping (built
    from ``module.config`` when needed and not given)."""
    group = getattr(getattr(module, "tp_group", None), "process_group", None)
    t0 = time.perf_counter()
    nbytes, error = 0, None
    beat = heartbeat(group) if group is not None else None  # peers wait for a rank still reading
    try:
        reads, headers = _plan_reads(module, plan, files, rank, tp, meta_model)
        bar = _progress(sum(r.nbytes for r in reads), rank, tp) if progress else None
        with torch.no_grad():
            path, handle = None, None
            try:
                for r in reads:
                    if r.path != path:
                        if handle is not None:
                            handle.__exit__(None, None, None)
                        path, handle = r.path, headers[r.path].__enter__()
                    if r.decode is None:
                        nbytes += handle.read_into(r.tensor, r.source, r.out)
                    else:
                        nbytes += r.decode(handle)
                    if bar is not None:
                        bar.update(r.nbytes)
                    if beat is not None:
                        beat()
            finally:
                if handle is not None:
                    handle.__exit__(None, None, None)
                if bar is not None:
                    bar.close()
    except Exception as err:  # noqa: BLE001 - every rank must learn of it (agree re-raises)
        error = err
    agree(group, error, "loading the checkpoint", step="load checkpoint")
    seconds = time.perf_counter() - t0
    log.info("rank %d read %.1f MiB of a %.1f MiB checkpoint (%.1f%%) in %.2f s", rank, nbytes / 2**20,
             files.total_bytes / 2**20, 100.0 * nbytes / max(files.total_bytes, 1), seconds)
    return nbytes


def load_from_state_dict(module, plan, state: dict, rank: int, tp: int) -> None:
    missing = [p.name for p in plan.params if not any(n in state for n in p.names)]
    if missing:
        raise CheckpointError(f"the given model has no weights for: {', '.join(missing)}")
    for p in plan.params:
        full = state[next(n for n in p.names if n in state)]
        if tuple(full.shape) != tuple(p.shape):
            raise CheckpointError(f"parameter {p.name} has shape {list(full.shape)}, expected {list(p.shape)}")
    held = getattr(module, "expert_runs", None) or {}  # experts over data-parallel ranks: this rank's runs
    with torch.no_grad():
        for p in plan.params:
            full = state[next(n for n in p.names if n in state)]
            param = module.get_parameter(p.name)
            for source, dest in slice_pieces(p, rank, tp, held.get(p.name)):
                param[dest].copy_(full[source])
        for name, buffer in module.named_buffers():
            if name in state and tuple(state[name].shape) == tuple(buffer.shape):  # persistent buffers
                buffer.copy_(state[name])


def initialize(module, plan, config, rank: int, tp: int, seed: int, dtype, model_class=None) -> None:
    """No weights given: initialize the full model as transformers would (same seed on every
    rank, so all ranks agree), then keep this rank's slices."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    if model_class is not None:
        full = model_class._from_config(config, dtype=dtype)
    else:
        full = AutoModelForCausalLM.from_config(config, dtype=dtype)
    load_from_state_dict(module, plan, {k: v for k, v in full.state_dict().items()}, rank, tp)
