"""Checks on the arguments of every call of the parallel module, before any graph runs.

* Shapes: ``input_ids`` is [batch, sequence] with neither empty; the other arguments have its shape.
* Ranges: token ids must index the embedding table and labels the logits (or be -100), as
  transformers' own model demands (it raises IndexError). A vocab-parallel lookup would
  otherwise turn a bad id into a zero row on every rank and go on silently.
* The TP contract: every rank of a tensor-parallel group must get the same arguments (the
  same tokens, labels, mask and shapes); each rank holds part of one model that computes one
  result. A fingerprint of the arguments (shapes, which are given, and position-weighted sums
  of every tensor: 15 int64 per rank) is all-gathered over the group, so a mismatch is an
  error on every rank that names the ranks that differ, instead of a hang or a result that
  mixes data. The range check rides on the same host sync.
* Options that change which collectives run (whether the logits are gathered, logits_to_keep,
  the KV cache's length, dropout in training mode, the model's dtype) ride in the fingerprint
  too: given on one rank only, they would make the ranks run different collectives and wait on
  each other.
* A rank whose own arguments are refused (a shape above, or an argument forward refuses before
  this check: ``refused``) still takes part in the exchange, flagged as failed, and then raises
  its own error; the others raise one naming that rank. No refusal is raised before the exchange,
  so an argument given to one rank only never leaves the others waiting in a collective.
* Dropout (a training-mode call of a model with dropout): every tp rank draws the same logical
  masks (``ops/dropout_kernels.py``), which holds only if their random generators are in the same
  state; a digest of the generator state rides in the fingerprint, so ranks seeded differently
  are an error instead of masks that silently disagree.
* Padding: whether the attention mask holds any, read in the same exchange. A call without a
  cache whose mask holds none runs attention as transformers does then, without the mask
  (``capture/causal_mask.py``).
* Weights: how many times ``load_state_dict`` loaded weights into this rank's shards rides along too, so a load
  run on some ranks only (``if rank == 0:``, or Trainer's ``load_best_model_at_end`` with a checkpoint folder a
  rank cannot see) is an error at the next call instead of shards of two models computing together.
* A caller's own number can ride on the same read (``read_with_argument_check``): ``train_step`` reads its
  global label count there, so a training step reads the host once.
"""
from __future__ import annotations

import contextlib
import threading
import zlib
from typing import Optional

import torch
import torch.distributed as dist

from .errors import InputError

# the tensor arguments of the forward, in the order the graphs take them
ARGUMENTS = ("input_ids", "attention_mask", "position_ids", "labels")

# the arguments a fingerprint covers; its 15 fields: ndim, batch, seq, presence bits (and above them the
# options, ``options_code``), 4 checksums (one per argument), ids min / max, labels bad count, problem, rng
# digest, mask without padding, weights loaded (``loads``)
FINGERPRINT = ("input_ids", "attention_mask", "position_ids", "labels")
FIELDS = 15
LOADS = 14
_PRESENCE_BITS = len(FINGERPRINT)
_KEEP_LIMIT = 1 << 20  # logits_to_keep above this is compared as this (no graph keeps more)
_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)  # the model's dtype as an index (4: other)
_RIDER = threading.local()  # read_with_argument_check's value, while its block runs


@contextlib.contextmanager
def read_with_argument_check(value: torch.Tensor):
    """Within the block, the next argument check reads ``value`` (an integer scalar, the same on every rank of the
    tp group) on the host with its own exchange, as one more field of the fingerprint (compared across the tp
    ranks like the others). Yields a dict that then holds it under "value" (nothing when no check ran:
    ``check_inputs=False``)."""
    box, previous = {"tensor": value.reshape(1).to(torch.int64)}, getattr(_RIDER, "box", None)
    _RIDER.box = box
    try:
        yield box
    finally:
        _RIDER.box = previous


def options_code(gather: bool, dropout: bool, logits_to_keep: int, cache_length: Optional[int],
                 dtype: Optional[torch.dtype] = None, router_logits: bool = False, expert_counts: bool = False) -> int:
    """The options of one call that change which collectives run, as one integer: whether the logits are
    gathered, whether dropout masks are drawn (training mode), the model's dtype (``model.to(dtype)`` on one
    rank only), logits_to_keep, whether router logits and expert counts are output and the KV cache's length."""
    keep = min(int(logits_to_keep), _KEEP_LIMIT - 1)
    cache = 0 if cache_length is None else int(cache_length) + 1
    kind = 0 if dtype is None else (_DTYPES.index(dtype) + 1 if dtype in _DTYPES else len(_DTYPES) + 1)
    return int(bool(gather)) | int(bool(dropout)) << 1 | kind << 2 | keep << 5 | int(bool(router_logits)) << 25 \
        | int(bool(expert_counts)) << 26 | cache << 27


def _options(code: int) -> dict:
    """``options_code``'s integer read back, as the option names a user passes."""
    cache, kind = code >> 27, code >> 2 & 7
    dtype = str(_DTYPES[kind - 1]).replace("torch.", "") if 0 < kind <= len(_DTYPES) else ("other" if kind else None)
    return {"gather_logits": bool(code & 1), "training mode with dropout (model.train())": bool(code >> 1 & 1),
            "the model's dtype": dtype, "logits_to_keep": code >> 5 & (_KEEP_LIMIT - 1),
            "output_router_logits": bool(code >> 25 & 1), "output_tokens_per_expert": bool(code >> 26 & 1),
            "KV cache (use_cache / past_key_values) length": cache - 1 if cache else None}


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


def fingerprint(args: dict, classes: Optional[int], problem: bool, rng: int = 0, options: int = 0,
                loads: int = 0) -> torch.Tensor:
    """The 15 numbers each rank sends; ``problem``: this rank's arguments failed a local check; ``rng``:
    its generator digest when the call draws dropout masks (else 0); ``options``: ``options_code``; ``loads``:
    how many times weights were loaded into the model on this rank."""
    ids = args["input_ids"]
    present = sum(1 << i for i, name in enumerate(FINGERPRINT) if name in args) | options << _PRESENCE_BITS
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
                                                zero + int(problem), zero + rng, unpadded, zero + loads])])


def check_arguments(args: dict, group, vocab: Optional[int], classes: Optional[int],
                    mask_length: Optional[int] = None, dropout: bool = False, options: int = 0,
                    refused: Optional[BaseException] = None, device=None, loads: int = 0) -> bool:
    """Shapes, ranges and (over ``group``, a TPGroup) equality of the arguments of one call and of its
    ``options`` (``options_code``), and with ``dropout`` of the ranks' random generators. Every rank takes
    part in the exchange before anything is raised, so all raise together. ``refused``: the error this rank's
    arguments already got from a check before this one (an unsupported argument, say); the rank then sends a
    fingerprint flagged as failed (on ``device``: its arguments may hold no tensor) and raises that error
    after the exchange, while the others raise one naming it. Returns whether an attention mask was given that
    holds no padding. ``loads``: how many times weights were loaded into the model on this rank
    (``load_state_dict``), compared across the ranks: a load on some of them only leaves their shards of
    different models."""
    if refused is None:
        problem = shape_problem(args, mask_length)
        rng = rng_digest(args["input_ids"].device) if dropout else 0
        mine = fingerprint(args, classes, problem is not None, rng, options, loads)
    else:
        problem = None
        mine = torch.zeros(FIELDS, dtype=torch.int64, device=device)
        mine[11], mine[LOADS] = 1, loads
    box = getattr(_RIDER, "box", None)
    if box is not None and "value" not in box:
        mine = torch.cat([mine, box["tensor"].to(mine.device)])
    if group is not None and group.process_group is not None and group.size > 1:
        rows = [torch.empty_like(mine) for _ in range(group.size)]
        dist.all_gather(rows, mine, group=group.process_group)
        table = torch.stack(rows).cpu().tolist()
    else:
        table = [mine.cpu().tolist()]
    if len(table[0]) > FIELDS:
        box["value"] = table[0][FIELDS]
    if refused is not None:
        raise refused
    if problem is not None:
        raise InputError(problem)
    failed = [r for r, row in enumerate(table) if row[11]]
    if failed:
        where = "that rank" if len(failed) == 1 else "those ranks"
        raise InputError(f"the arguments of {ranks_named(failed)} are invalid (see the error on {where}); every tp "
                         f"rank must be given the same arguments")
    loaded = [row[LOADS] for row in table]
    if len(set(loaded)) > 1:
        raise InputError(
            f"the tp ranks hold shards of different weights: load_state_dict loaded weights into this model "
            f"{', '.join(f'{n} time(s) on tp rank {r}' for r, n in enumerate(loaded))}, so a load ran on some ranks "
            "only. Load on every rank of the tp group: an `if rank == 0:` around load_state_dict, or Trainer's "
            "load_best_model_at_end with a checkpoint folder some ranks cannot see (give them one output_dir on a "
            "shared filesystem, or save_on_each_node=True across nodes)")
    compared = lambda row: row[:8] + row[13:LOADS] + row[FIELDS:]  # noqa: E731 - shapes, presence, options, ...
    differ = [r for r, row in enumerate(table) if compared(row) != compared(table[0])]
    if differ:
        what = _what_differs(table[0], table[differ[0]])
        raise InputError(
            f"the ranks of one tensor-parallel group got different arguments ({what}: rank 0 vs rank "
            f"{differ[0]}; ranks differing from rank 0: {differ}). Every tp rank must be given the same "
            f"input_ids, attention_mask, position_ids and labels (and options: gather_logits, logits_to_keep, KV "
            f"cache, train/eval mode, dtype); data parallelism splits data across dp ranks, never across tp ranks")
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


def ranks_named(ranks: list) -> str:
    """"tp rank 1" / "tp ranks 1, 3": the ranks an error names."""
    return f"tp rank {ranks[0]}" if len(ranks) == 1 else f"tp ranks {', '.join(map(str, ranks))}"


def _what_differs(a: list, b: list) -> str:
    if a[:3] != b[:3]:
        return f"input_ids shape {tuple(a[1:3])} vs {tuple(b[1:3])}"
    mask = (1 << _PRESENCE_BITS) - 1
    if a[3] & mask != b[3] & mask:
        names = lambda bits: [n for i, n in enumerate(FINGERPRINT) if bits >> i & 1] or ["none"]  # noqa: E731
        return f"arguments given {names(a[3] & mask)} vs {names(b[3] & mask)}"
    if a[3] != b[3]:
        mine, theirs = _options(a[3] >> _PRESENCE_BITS), _options(b[3] >> _PRESENCE_BITS)
        name = next(n for n in mine if mine[n] != theirs[n])
        return f"{name} {mine[name]} vs {theirs[name]}"
    for i, name in enumerate(FINGERPRINT):
        if a[4 + i] != b[4 + i]:
            return f"the values of {name}"
    if a[13] != b[13]:
        return "whether attention_mask holds padding (zeros)"
    return "values"
