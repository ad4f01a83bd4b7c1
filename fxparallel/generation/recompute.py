"""Generation without a cache: each step runs the forward over the whole sequence so far, as transformers'
``generate(use_cache=False)`` does, and as it does for a model that has no cache at all (GPT-1).

The loop takes this path when asked (``use_cache=False``) or when the model's cache cannot be carried by the
graphs (``CacheNotCarried``: a state the graphs do not hold, cache code Dynamo cannot capture whole, RWKV's
own state). It is exact where transformers' forward is given just the tokens, mask and positions
(``ModelFacts.inputs_beyond_tokens``: XLNet and XLM are refused) and slower: each new token costs a forward
over the sequence.

The sequence grows by a token per step where one graph serves every length (most models: the sequence
dimension is symbolic). Where the model's code fixes the length (RWKV's and CPM-Ant's loops over the tokens),
that would be a graph per token: the sequence is right-padded (masked) to a fixed length instead, the next power
of two of the generation's longest, so one graph serves every step and prompt of that bucket. That is exact only
where a position's logits do not read later positions (a causal model): checked once per model, on its first
generation, against the unpadded forward (an exchange of one number between the ranks), and refused by name
where they do (CPM-Ant's attention is bidirectional over the tokens it is given). A model parallelized with
``sequence_parallel`` takes the padded path too, its length a multiple of the tp size (the sequence is split
over the ranks), checked likewise at the longest prefix that divides.
"""
from __future__ import annotations

import logging

import torch
import torch.distributed as dist

from ..errors import CacheNotCarried, InputError

log = logging.getLogger("fxparallel")

SHORTEST = 16  # sequence lengths: powers of two from this


def sequence_length(model, max_length: int) -> int:
    """The padded length of every step of a generation of ``max_length`` tokens: the next power of two (at
    least ``SHORTEST``), within the model's learned positions."""
    length = max(SHORTEST, 1 << (max_length - 1).bit_length())
    limit = model.position_limit
    length = length if limit is None else max(max_length, min(length, limit))
    if not _splits_sequence(model):
        return length
    tp = model.tp_group.size
    return -(-length // tp) * tp  # (padded slots take position id 1, where the model takes position ids)


def _splits_sequence(model) -> bool:
    return model.sequence_parallel and model.tp_group.size > 1


def refuse_extra_inputs(model, why: str) -> None:
    """Refuse a generation without a cache where transformers feeds the model more than tokens and a mask
    (``why``: why there is no cache)."""
    if model.inputs_beyond_tokens is not None:
        raise InputError(f"generate is not supported for this model ({model.config.model_type}): {why}, "
                         f"and without a cache {model.inputs_beyond_tokens}, which the parallel model's forward does "
                         f"not take")


def fall_back(model, refused: CacheNotCarried) -> None:
    """A step's capture found the model's cache cannot be carried: generation goes on without one (said once:
    the refusal is remembered, and later generations start without a cache, ``without_cache``), or is refused
    where that would not be what transformers runs."""
    without_cache(model, refused)
    if model.tp_group.rank == 0:
        why = refused.why
        log.warning("%s: generating without a cache, each step recomputes the sequence (%s; model.cache_refusal "
                    "says it whole)", model.config.model_type, why if len(why) <= 200 else why[:200] + " ...")


def without_cache(model, refused: CacheNotCarried) -> None:
    """Refuse a generation without a cache where transformers would feed the model more than tokens."""
    refuse_extra_inputs(model, f"its cache cannot be carried ({refused.why})")


def step_logits(model, sequences: torch.Tensor, full_mask: torch.Tensor, positions_of, compile_config):
    """The forward over ``sequences`` [rows, now], grown or padded to ``full_mask``'s length (module docstring):
    (this rank's vocabulary slice of the last token's logits [rows, local vocab], float32, the slice's first id).
    ``positions_of``: the loop's position ids of a mask."""
    now = sequences.shape[1]
    graphs = model._graph_set
    if graphs.recompute_padded is None and _splits_sequence(model):
        _check_split_padding(model, sequences, full_mask, positions_of)
    if graphs.recompute_padded:
        return _forward(model, sequences, full_mask, positions_of, compile_config, now)
    grown = _forward(model, sequences, full_mask[:, :now], positions_of, compile_config, now)
    if graphs.recompute_padded is None:  # the model's first generation without a cache: which of the two
        longer = {name: shape[:-1] + (shape[-1] + 1,) for name, shape in
                  (("input_ids", sequences.shape), ("attention_mask", sequences.shape),
                   ("position_ids", sequences.shape if model.takes_position_ids else None)) if shape is not None}
        graphs.recompute_padded = not graphs.last.guards.holds_for(longer)
        if graphs.recompute_padded:
            _check_padding(model, grown[0], _forward(model, sequences, full_mask, positions_of, None, now)[0])
    return grown


def _forward(model, sequences: torch.Tensor, mask: torch.Tensor, positions_of, compile_config, now: int):
    ids = sequences.new_zeros(mask.shape)
    ids[:, :now] = sequences
    given = {"position_ids": positions_of(mask)} if model.takes_position_ids else {}
    if model.takes_router_logits:
        given["output_router_logits"] = False
    out = model(input_ids=ids, attention_mask=mask, use_cache=False, gather_logits=False, check_inputs=False,
                compile_config=compile_config, **given)
    local = out.local_logits if out.local_logits is not None else out.logits
    start = out.vocab_range[0] if out.vocab_range is not None else 0
    return local[:, now - 1, :].to(torch.float32, copy=True), start


def _check_split_padding(model, sequences: torch.Tensor, full_mask: torch.Tensor, positions_of) -> None:
    """Sequence parallelism splits the sequence over the ranks, so every step is padded to a multiple of the
    tp size: checked once, as ``_check_padding``, at the longest prefix that divides (unpadded there)."""
    tp = model.tp_group.size
    prefix = sequences.shape[1] - sequences.shape[1] % tp
    if prefix == 0:
        raise InputError(f"generate without a cache with sequence_parallel: the prompt ({sequences.shape[1]} "
                         f"tokens) is shorter than the tp size {tp}, which the padding check needs; give a "
                         f"prompt of at least {tp} tokens")
    padded = full_mask.clone()
    padded[:, prefix:] = 0
    model._graph_set.recompute_padded = True
    _check_padding(model, _forward(model, sequences[:, :prefix], full_mask[:, :prefix], positions_of, None, prefix)[0],
                   _forward(model, sequences[:, :prefix], padded, positions_of, None, prefix)[0])


def _check_padding(model, grown: torch.Tensor, padded: torch.Tensor) -> None:
    """Refuse a model whose logits at a position read later positions (masked padding after the tokens moved
    them beyond rounding), on every rank alike (the largest difference over the vocabulary shards)."""
    scale = torch.stack([grown.abs().max(), (grown - padded).abs().max()])
    group = model.tp_group
    if group.process_group is not None and group.size > 1:
        dist.all_reduce(scale, op=dist.ReduceOp.MAX, group=group.process_group)
    tolerance = max(1e-4, 16 * torch.finfo(model.dtype_).eps)  # relative: float32 rounding of another length
    if float(scale[1]) > tolerance * max(float(scale[0]), 1.0):
        model._graph_set.recompute_padded = None  # (checked again on the next call, which is refused alike)
        raise InputError(f"generate is not supported for this model ({model.config.model_type}) without a cache: its "
                         f"code fixes the sequence length (a graph per token), and masked padding after the tokens "
                         f"moves the last token's logits by {float(scale[1]):.3g} (of {float(scale[0]):.3g}): its "
                         f"logits at a position read later positions")
