"""Checks on the arguments of every call of the parallel module, before any graph runs.

* Shapes: ``input_ids`` is [batch, sequence] with neither empty; the other arguments have its shape.
* Ranges: token ids must index the embedding table and labels the logits (or be -100), as
  transformers' own model demands (it raises IndexError). A vocab-parallel lookup would
  otherwise turn a bad id into a zero row on every rank and go on silently.
* The TP contract: every rank of a tensor-parallel group must get the same arguments (the
  same tokens, labels, mask and shapes); each rank holds part of one model that computes one
  result. A fingerprint of the arguments (shapes, which are given, and position-weighted sums
  of every tensor: 14 int64 per rank) is all-gathered over the group, so a mismatch is an
  error on every rank that names the ranks that differ, instead of a hang or a result that
  mixes data. The range check rides on the same host sync.
* Dropout (a training-mode call of a model with dropout): every tp rank draws the same logical
  masks (``rewrite/dropout.py``), which holds only if their random generators are in the same
  state; a digest of the generator state rides in the fingerprint, so ranks seeded differently
  are an error instead of masks that silently disagree.
* Padding: whether the attention mask holds any, read in the same exchange. A call without a
  cache whose mask holds none runs attention as transformers does then, without the mask
  (``capture/causal_mask.py``).
"""
from __future__ import annotations

import zlib
from typing import Optional

import torch
import torch.distributed as dist

from .errors import InputError

# the arguments a fingerprint covers; its 14 fields: ndim, batch, seq, presence bits, 4 checksums (one per
# argument), ids min / max, labels bad count, problem, rng digest, mask without padding
FINGERPRINT = ("input_ids", "attention_mask", "position_ids", "labels")


def shape_problem(args: dict, mask_length: Optional[int] = None) -> Optional[str]:
    """What is wrong with the shapes of one call's arguments, or None. ``mask_length``: with a KV cache
    the attention mask spans the cache: [batch, mask_length]."""
    ids = args["input_ids"]
    if ids.dim() != 2:
        return f"input_ids must be [batch, sequence], got shape {tuple(ids.shape)}"
    if ids.numel() == 0:
        return f"input_ids {tuple(ids.shape)} is empty: give at least one token in one sequence"
    if ids.is_floating_point():
        return f"input_ids must hold integer token ids, got {ids.dtype}"
    mask = args.get("attention_mask")
    if mask is not None and mask_length is not None:
        if tuple(mask.shape) != (ids.shape[0], mask_length):
            return (f"attention_mask has shape {tuple(mask.shape)}; with a KV cache of {mask_length} tokens it must "
                    f"be [batch, {mask_length}] (1 for tokens to attend to, including positions not written yet)")
    for name in ("position_ids", "labels") if mask_length is not None else ("attention_mask", "position_ids",
                                                                            "labels"):
        value = args.get(name)
        if value is not None and tuple(value.shape) != tuple(ids.shape):
            return f"{name} has shape {tuple(value.shape)} but input_ids has {tuple(ids.shape)}: they must match"
    return None


def _checksum(t: torch.Tensor) -> torch.Tensor:
    """A position-weighted sum (int64, wrapping): equal tensors give equal sums, a swap of two
    values almost never does."""
    flat = t.reshape(-1).to(torch.int64)
    weights = torch.arange(1, flat.numel() + 1, device=flat.device, dtype=torch.int64) * 1000003
    return (flat * weights).sum() + flat.numel()


def rng_digest(device: torch.device) -> int:
    """A digest of the random generator that draws dropout masks on ``device``."""
    state = torch.cuda.get_rng_state(device) if device.type == "cuda" else torch.get_rng_state()
    return zlib.crc32(state.numpy().tobytes())


def fingerprint(args: dict, classes: Optional[int], problem: bool, rng: int = 0) -> torch.Tensor:
    """The 14 numbers each rank sends; ``problem``: this rank's arguments failed a local check; ``rng``:
    its generator digest when the call draws dropout masks (else 0)."""
    ids = args["input_ids"]
    present = sum(1 << i for i, name in enumerate(FINGERPRINT) if name in args)
    zero = torch.zeros((), dtype=torch.int64, device=ids.device)
    sums = [_checksum(args[name]) if name in args else zero for name in FINGERPRINT]
    labels = args.get("labels")
    bad_labels = zero
    if labels is not None and classes is not None and not problem:
        bad_labels = ((labels != -100) & ((labels < 0) | (labels >= classes))).sum()
    shape = (ids.dim(), ids.shape[0] if ids.dim() else 0, ids.shape[-1] if ids.dim() else 0, present)
    head = torch.tensor(shape, dtype=torch.int64, device=ids.device)
    low, high = (ids.min(), ids.max()) if ids.numel() else (zero, zero)
    mask = args.get("attention_mask")
    unpadded = mask.bool().all().to(torch.int64) if mask is not None and mask.numel() and not problem else zero
    return torch.cat([head, torch.stack(sums + [low.to(torch.int64), high.to(torch.int64), bad_labels.to(torch.int64),
                                                zero + int(problem), zero + rng, unpadded])])


def check_arguments(args: dict, group, vocab: Optional[int], classes: Optional[int],
                    mask_length: Optional[int] = None, dropout: bool = False) -> bool:
    """Shapes, ranges and (over ``group``, a TPGroup) equality of the arguments of one call, and with
    ``dropout`` of the ranks' random generators. Every rank takes part in the exchange before anything
    is raised, so all raise together. Returns whether an attention mask was given that holds no padding."""
    problem = shape_problem(args, mask_length)
    rng = rng_digest(args["input_ids"].device) if dropout else 0
    mine = fingerprint(args, classes, problem is not None, rng)
    if group is not None and group.process_group is not None and group.size > 1:
        rows = [torch.empty_like(mine) for _ in range(group.size)]
        dist.all_gather(rows, mine, group=group.process_group)
        table = torch.stack(rows).cpu().tolist()
    else:
        table = [mine.cpu().tolist()]
    if problem is not None:
        raise InputError(problem)
    failed = [r for r, row in enumerate(table) if row[11]]
    if failed:
        raise InputError(f"the arguments of tp rank {failed[0]} are invalid (see the error on that rank); every tp "
                         f"rank must be given the same arguments")
    compared = lambda row: row[:8] + row[13:]  # noqa: E731 - shapes, presence, checksums, padding
    differ = [r for r, row in enumerate(table) if compared(row) != compared(table[0])]
    if differ:
        what = _what_differs(table[0], table[differ[0]])
        raise InputError(
            f"the ranks of one tensor-parallel group got different arguments ({what}: rank 0 vs rank "
            f"{differ[0]}; ranks differing from rank 0: {differ}). Every tp rank must be given the same "
            f"input_ids, attention_mask, position_ids and labels; data parallelism splits data across dp "
            f"ranks, never across tp ranks")
    seeded = [r for r, row in enumerate(table) if row[12] != table[0][12]]
    if seeded:
        raise InputError(
            f"dropout: the random generators of tp ranks {seeded} are in another state than rank 0's, so their "
            f"dropout masks would disagree; seed every rank of a tp group alike (e.g. torch.manual_seed(seed) on "
            f"each, the same seed) and draw the same random numbers on each between steps")
    low, high, bad_labels = table[0][8], table[0][9], table[0][10]
    if vocab is not None and (low < 0 or high >= vocab):
        raise InputError(f"input_ids holds token id {low if low < 0 else high}, outside the embedding table of "
                         f"{vocab} rows (ids must be in [0, {vocab})): is the tokenizer the model's?")
    if bad_labels:
        raise InputError(f"labels holds {bad_labels} value(s) outside [0, {classes}) that are not the ignore index "
                         f"-100")
    return bool(table[0][13])


def _what_differs(a: list, b: list) -> str:
    if a[:3] != b[:3]:
        return f"input_ids shape {tuple(a[1:3])} vs {tuple(b[1:3])}"
    if a[3] != b[3]:
        names = lambda bits: [n for i, n in enumerate(FINGERPRINT) if bits >> i & 1] or ["none"]  # noqa: E731
        return f"arguments given {names(a[3])} vs {names(b[3])}"
    for i, name in enumerate(FINGERPRINT):
        if a[4 + i] != b[4 + i]:
            return f"the values of {name}"
    if a[13] != b[13]:
        return "whether attention_mask holds padding (zeros)"
    return "values"
