"""Context parallelism: each cp rank holds part of every sequence; attention stays exact.

Layout (causal load balancing): a sequence of length S is cut into 2*cp chunks of
c = S / (2*cp) tokens; cp rank i holds chunks i and 2*cp-1-i, in that order (a head
chunk and a tail chunk, so every rank does the same attention work). Everything
but attention is per token, so the local graph runs unchanged on the 2c local
tokens; rotary (or learned) positions come from the ``position_ids`` argument,
which holds the tokens' GLOBAL positions.

Attention: every ``scaled_dot_product_attention`` of the local graph is replaced by
``context_parallel_attention``. It all-gathers k and v over the cp group (one
collective for both; with grouped-query attention the kv heads before transformers'
``repeat_kv``, which is redone after the gather), puts the chunks in global order, and lets each local query
chunk j attend to the keys of chunks 0..j with a causal mask aligned to the lower
right (query t of chunk j sees keys up to j*c + t): exactly causal attention over the
whole sequence. The gather's backward sums the k/v gradients of every rank's
queries and keeps this rank's chunks (one reduce-scatter).

The model's own mask (built from the local positions) is dropped, so anything that
mask could express beyond plain causal attention is refused at ``parallelize``
(``context_parallel_checks.py``): padding masks, sliding windows, chunked attention,
soft-capping, packed sequences, graphs whose attention is not sdpa. Labels: the loss of a chunk cannot shift labels
across chunk boundaries, so under CP the model takes labels ALREADY shifted (label t
is the token that position t predicts) and the graph is captured with them passed as
transformers' ``shift_labels``.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from ..errors import ContextParallelError
from ..group import TPGroup, group_by_handle, resolve_group
from .dropout_kernels import SDPA, chunked_attention_dropout


# ---- the group and the layout ------------------------------------------------------------
def resolve_cp_group(cp_group):
    """A ProcessGroup or 1-D DeviceMesh as a registered group; None when absent or of size 1."""
    if cp_group is None or isinstance(cp_group, TPGroup):
        return cp_group if cp_group is None or cp_group.size > 1 else None
    group = resolve_group(cp_group, "cp_group", ContextParallelError)
    return group if group.size > 1 else None


def chunks_of(rank: int, cp: int) -> tuple:
    """The global chunk indices cp rank ``rank`` holds, in local order."""
    return rank, 2 * cp - 1 - rank


def global_positions(local_len: int, rank: int, cp: int, device=None) -> torch.Tensor:
    """Global positions of the ``local_len`` tokens cp rank ``rank`` holds."""
    if local_len % 2:
        raise ContextParallelError(f"a context-parallel rank holds two equal chunks of each sequence; its sequence "
                                   f"length {local_len} is odd")
    c = local_len // 2
    return torch.cat([torch.arange(j * c, (j + 1) * c, device=device) for j in chunks_of(rank, cp)])


def _permutation(cp: int) -> list:
    """Rank-major chunk slots (rank r, half h -> 2r+h) listed in global chunk order."""
    order = [0] * (2 * cp)
    for r in range(cp):
        for h, j in enumerate(chunks_of(r, cp)):
            order[j] = 2 * r + h
    return order


# the *_single names replace *_into_tensor / *_tensor in recent torch (same semantics)
_ALL_GATHER = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_REDUCE_SCATTER = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


class _GatherSequence(torch.autograd.Function):
    """[n, 2c, d] local tokens -> [n, 2*cp*c, d] every token in global order; backward sums
    the gradient over cp and keeps this rank's chunks (reduce-scatter)."""

    @staticmethod
    def forward(ctx, x, handle):
        group = group_by_handle(handle)
        cp = group.size
        n, s, d = x.shape
        c = s // 2
        out = torch.empty((cp * n, s, d), dtype=x.dtype, device=x.device)
        _ALL_GATHER(out, x.contiguous(), group=group.process_group)
        slots = out.view(cp, n, 2, c, d).permute(0, 2, 1, 3, 4).reshape(2 * cp, n, c, d)
        ctx.handle, ctx.shape = handle, (n, s, d)
        ordered = slots[_permutation(cp)]
        return ordered.permute(1, 0, 2, 3).reshape(n, 2 * cp * c, d)

    @staticmethod
    def backward(ctx, grad):
        group = group_by_handle(ctx.handle)
        cp = group.size
        n, s, d = ctx.shape
        c = s // 2
        ordered = grad.reshape(n, 2 * cp, c, d).permute(1, 0, 2, 3)
        slots = torch.empty_like(ordered)
        slots[_permutation(cp)] = ordered
        send = slots.view(cp, 2, n, c, d).permute(0, 2, 1, 3, 4).reshape(cp * n, s, d).contiguous()
        mine = torch.empty((n, s, d), dtype=grad.dtype, device=grad.device)
        _REDUCE_SCATTER(mine, send, group=group.process_group)
        return mine, None


def gather_sequence(x: torch.Tensor, handle: int) -> torch.Tensor:
    """All cp ranks' tokens of ``x`` ([..., local seq, d]) in global order."""
    lead = x.shape[:-2]
    flat = x.reshape(-1, x.shape[-2], x.shape[-1])
    out = _GatherSequence.apply(flat, handle)
    return out.view(*lead, out.shape[-2], out.shape[-1])


def context_parallel_attention(q, k, v, handle: int, scale=None, enable_gqa: bool = False, dropout_p: float = 0.0,
                               cuts=(), training: bool = False):
    """Exact causal attention of this rank's query chunks over the whole sequence (see module doc); in
    training with ``dropout_p``, its rows of the logical dropout mask (``ops/dropout_kernels.py``)."""

    group = group_by_handle(handle)
    s = q.shape[-2]
    if s % 2 or k.shape[-2] != s:
        raise ContextParallelError(f"context-parallel attention needs two equal local chunks of queries and keys, "
                                   f"got {s} queries and {k.shape[-2]} keys")
    if k.shape == v.shape:
        k, v = gather_sequence(torch.stack([k, v]), handle).unbind(0)
    else:
        k, v = gather_sequence(k, handle), gather_sequence(v, handle)
    if enable_gqa and k.shape[-3] != q.shape[-3]:
        repeat = q.shape[-3] // k.shape[-3]
        k, v = k.repeat_interleave(repeat, dim=-3), v.repeat_interleave(repeat, dim=-3)
    if training and dropout_p:
        return chunked_attention_dropout(q, k, v, group.rank, group.size, scale, dropout_p, cuts)
    c = s // 2
    outs = []
    for half, j in enumerate(chunks_of(group.rank, group.size)):
        n = (j + 1) * c
        mask = _lower_right_causal(c, n, q.device)
        outs.append(SDPA(q[..., half * c:(half + 1) * c, :], k[..., :n, :], v[..., :n, :], attn_mask=mask,
                         scale=scale))
    return torch.cat(outs, dim=-2)


def _lower_right_causal(queries: int, keys: int, device: torch.device):
    """Causal mask of the last ``queries`` of ``keys`` positions. On CUDA torch's ``CausalBias`` picks a
    lower-right causal kernel; on CPU SDPA turns it into this boolean mask anyway. A ``CausalBias`` cannot
    be created under a dispatch mode (selective activation checkpointing, FLOP counting: a torch limit),
    so there the boolean mask is used on CUDA too."""
    from torch.nn.attention.bias import causal_lower_right
    from torch.utils._python_dispatch import _get_current_dispatch_mode

    if device.type == "cuda" and _get_current_dispatch_mode() is None:
        return causal_lower_right(queries, keys)
    return torch.ones(queries, keys, dtype=torch.bool, device=device).tril(keys - queries)


context_parallel_attention.FORWARD, context_parallel_attention.BACKWARD = "all_gather", "reduce_scatter"
context_parallel_attention.dropout_site = True  # the dropout_mode pass gives it the module's training flag


# ---- the module's arguments ----------------------------------------------------------------
def prepare_arguments(args: dict, group: TPGroup, kind: str) -> dict:
    """Check a context-parallel call and give it the global position_ids of its tokens (an attention mask of all
    ones, as Trainer's collators give, dropped)."""
    if "attention_mask" in args:
        args = _without_unpadded_mask(args, group, kind)
    ids = args["input_ids"]
    expected = global_positions(ids.shape[-1], group.rank, group.size, device=ids.device)
    if "position_ids" not in args:
        args["position_ids"] = expected.expand(ids.shape).contiguous()
    elif not bool((args["position_ids"] == expected).all()):
        raise ContextParallelError(
            f"{kind}: under context parallelism position_ids must be the global positions of this rank's chunks "
            f"(fxparallel.runtime.split_for_context_parallel gives them); custom or packed positions are not supported")
    return args


def _without_unpadded_mask(args: dict, group: TPGroup, kind: str) -> dict:
    """Drop an attention mask that is all ones on every cp rank; otherwise refuse it on every cp rank. One
    all-reduce over cp, so that all of them decide alike (each sees its own chunks of the mask)."""
    mask = args["attention_mask"]
    ones = torch.tensor([1.0 if bool((mask == 1).all()) else 0.0], device=mask.device)
    dist.all_reduce(ones, op=dist.ReduceOp.MIN, group=group.process_group)
    if not ones.item():
        raise ContextParallelError(f"{kind}: attention_mask is not supported under context parallelism (padding "
                                   "masks are not; one of all ones is dropped); pass full rows without padding")
    return {k: v for k, v in args.items() if k != "attention_mask"}
