"""Dropout whose masks do not depend on the layout (tp, sequence parallelism, context parallelism).

Every rank draws the *logical* (full-shape) mask of each dropout site, in graph order, with
``torch.empty(full_shape).bernoulli_(1 - p)`` as ``F.dropout`` does on CPU, and keeps its own
part of it (``cuts``). The ranks' RNGs therefore stay in step, a replicated region draws the
same mask on every rank, and a sharded one (heads, columns, sequence chunks) uses its part
of one logical mask: with the same seed, loss and gradients are those of one device (and on
CPU those of transformers' own training-mode forward). Cost: each rank generates the random
numbers of the whole tensor, transiently holding its full mask (for attention dropout
``batch x heads x seq x seq`` per layer, as one device would), then keeps only its slice for
the backward pass. Data-parallel ranks draw from their own process's RNG: seeded alike they
use the same masks on different data (Megatron's default); seed them per dp rank for
independent masks. Every tp / cp rank of a group must be seeded alike.

Where a dropout is active is decided at call time by ``training``, the parallel module's
flag, which the ``dropout_mode`` pass (after ``bind``) wires into every site: one graph
serves ``train()`` and ``eval()``. Attention dropout inside ``scaled_dot_product_attention``
cannot be sliced (its mask is internal), so in training it runs as explicit math attention
(the same ops as PyTorch's math kernel) with the logical mask; in eval it is sdpa with
``dropout_p=0``.

A cut (plain data, so the generated code shows it) says how one dim of the local tensor is
taken from the logical one:

* ``("pieces", dim, full, ((start, stop), ...))``: tensor parallelism (segments, uneven splits);
* ``("blocks", dim, block, ((start, stop),))``: a blocked shard (batch x heads flattened): those
  pieces of every block of ``block`` elements;
* ``("even", dim, parts, rank, batch)``: sequence parallelism, rank's ``1/parts`` of the tokens;
* ``("chunks", dim, cp, rank, batch)``: context parallelism, chunks ``rank`` and ``2cp-1-rank``.

``batch`` is None when ``dim`` is the sequence, or the batch size when it is batch x sequence.
"""
from __future__ import annotations

import math

import torch

from ..errors import ShardingError

# the builtin that F.scaled_dot_product_attention names: torch's context_parallel (Trainer's, accelerate's) patches
# the name F.scaled_dot_product_attention with its own ring attention for the time of a step, never the builtin
SDPA = torch._C._nn.scaled_dot_product_attention


# ---- the masks -------------------------------------------------------------------------------
def _full_shape(shape, cuts) -> list:
    full = list(shape)
    for cut in cuts:
        if cut[0] == "blocks":  # every block of cut[2] keeps its pieces
            full[cut[1]] = shape[cut[1]] // sum(b - a for a, b in cut[3]) * cut[2]
        else:
            full[cut[1]] = cut[2] if cut[0] == "pieces" else shape[cut[1]] * cut[2]
    return full


def _pieces(mask: torch.Tensor, dim: int, pieces) -> torch.Tensor:
    parts = [mask.narrow(dim, a, b - a) for a, b in pieces]
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim)


def _chunks(rank: int, cp: int) -> tuple:
    return rank, 2 * cp - 1 - rank  # ops/context_parallel_attention.py's chunks_of


def _cut(mask: torch.Tensor, cut) -> torch.Tensor:
    kind, dim = cut[0], cut[1]
    if kind == "pieces":
        return _pieces(mask, dim, cut[3])
    if kind == "blocks":
        return _pieces(mask.unflatten(dim, (-1, cut[2])), dim + 1, cut[3]).flatten(dim, dim + 1)
    count, rank, batch = cut[2], cut[3], cut[4]
    d = dim
    if batch is not None:  # batch x sequence: cut the sequence of every row
        mask, d = mask.unflatten(dim, (batch, -1)), dim + 1
    n = mask.shape[d] // count
    if kind == "even":
        taken = mask.narrow(d, rank * n, n)
    else:
        c = n // 2
        taken = torch.cat([mask.narrow(d, j * c, c) for j in _chunks(rank, count)], d)
    return taken.flatten(dim, dim + 1) if batch is not None else taken


def keep_mask(shape, p: float, dtype, device, cuts=()) -> torch.Tensor:
    """This rank's part of a logical dropout mask, scaled by 1 / (1 - p), for a local tensor of ``shape``."""
    full = _full_shape(shape, cuts)
    mask = torch.empty(full, dtype=dtype, device=device).bernoulli_(1 - p)
    for cut in cuts:
        mask = _cut(mask, cut)
    if tuple(mask.shape) != tuple(shape):
        raise ShardingError(f"dropout mask cut to {tuple(mask.shape)} for a local tensor of {tuple(shape)} "
                            f"(logical {full}, cuts {cuts})")
    if cuts:
        mask = mask.clone(memory_format=torch.contiguous_format)  # free the full mask; keep only this part
    return mask.div_(1 - p)


def logical_dropout(x: torch.Tensor, p: float, cuts=(), training: bool = True) -> torch.Tensor:
    """``F.dropout(x, p, training)`` on this rank's part of a logical tensor (see the module doc)."""
    if not training or p == 0:
        return x
    if p == 1:
        return x * torch.zeros((), dtype=x.dtype, device=x.device)  # as torch: no draw
    return x * keep_mask(x.shape, p, x.dtype, x.device, cuts)


# ---- attention -------------------------------------------------------------------------------
def _float_mask(mask, dtype):
    if mask is not None and mask.dtype == torch.bool:
        return torch.where(mask, 0.0, float("-inf")).to(dtype)
    return mask


def math_attention(q, k, v, mask, scale, enable_gqa: bool, keep):
    """PyTorch's math sdpa kernel (same ops, same order) with ``keep(shape, dtype, device)`` as the
    scaled dropout mask of the attention weights."""
    factor = 1.0 / math.sqrt(q.size(-1)) if scale is None else scale
    root = math.sqrt(abs(factor))
    q = q * (-root if factor < 0 else root)
    if enable_gqa and k.size(-3) != q.size(-3):
        repeat = q.size(-3) // k.size(-3)
        k, v = k.repeat_interleave(repeat, -3), v.repeat_interleave(repeat, -3)
    attn = torch.matmul(q, k.transpose(-2, -1) * root)
    mask = _float_mask(mask, q.dtype)
    if mask is not None:
        attn = attn + mask
    attn = torch.ops.aten._safe_softmax(attn, -1)
    return torch.matmul(attn * keep(attn.shape, attn.dtype, attn.device), v)


def attention_dropout(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False, *,
                      cuts=(), training: bool = True):
    """``scaled_dot_product_attention`` whose attention dropout uses this rank's part (``cuts``, e.g. its
    heads) of the logical mask in training; sdpa without dropout otherwise."""
    if not training or dropout_p == 0:
        return SDPA(q, k, v, attn_mask=attn_mask, dropout_p=0.0, is_causal=is_causal, scale=scale,
                    enable_gqa=enable_gqa)
    if is_causal:
        attn_mask = torch.ones(q.size(-2), k.size(-2), dtype=torch.bool, device=q.device).tril()
    return math_attention(q, k, v, attn_mask, scale, enable_gqa,
                          lambda shape, dtype, device: keep_mask(shape, dropout_p, dtype, device, cuts))


def chunked_attention_dropout(q, k, v, rank: int, cp: int, scale, p: float, cuts=()):
    """Context parallelism in training: causal attention of this rank's two query chunks over the gathered
    keys (``ops/context_parallel_attention.py``), each chunk with its rows of the logical [.., seq, seq] mask."""
    c = q.size(-2) // 2
    seq = 2 * cp * c
    mask = torch.empty(_full_shape([*q.shape[:-2], seq, seq], cuts), dtype=q.dtype, device=q.device)
    mask.bernoulli_(1 - p)
    for cut in cuts:
        mask = _cut(mask, cut)
    outs = []
    for half, j in enumerate(_chunks(rank, cp)):
        n = (j + 1) * c
        keep = mask[..., j * c:(j + 1) * c, :n].clone(memory_format=torch.contiguous_format).div_(1 - p)
        causal = torch.ones(c, n, dtype=torch.bool, device=q.device).tril(n - c)
        outs.append(math_attention(q[..., half * c:(half + 1) * c, :], k[..., :n, :], v[..., :n, :], causal, scale,
                                   False, lambda shape, dtype, device, keep=keep: _checked(keep, shape)))
    return torch.cat(outs, dim=-2)


def _checked(keep: torch.Tensor, shape) -> torch.Tensor:
    if tuple(keep.shape) != tuple(shape):
        raise ShardingError(f"attention dropout mask {tuple(keep.shape)} for attention weights {tuple(shape)}")
    return keep


logical_dropout.dropout_site = attention_dropout.dropout_site = True  # take the flag (bind_training_flag)
