"""Shape arithmetic the view and indexing rules share: which output dimension a sharded input
dimension becomes through a reshape, a basic index or a permutation of dims, if it survives whole.

Reshapes are matched by groups of dimensions with equal products (symbolic sizes compared as
sympy expressions); a shard survives a reshape only if it is the outermost dimension of its group
on both sides, so each rank's chunk stays contiguous."""
from __future__ import annotations

from typing import Optional

import sympy
import torch

from ..op_traits import op_name
from ..size_arguments import spelled_out
from .base import norm_dim, size_hint as _hint, splits_in_proportion


def _expr(size):
    return size.node.expr if isinstance(size, torch.SymInt) else sympy.Integer(int(size))


def _same(a, b) -> bool:
    return sympy.expand(_expr(a) - _expr(b)) == 0


def dim_groups(in_shape, out_shape) -> Optional[list]:
    """Pair dims of a reshape: a list of (input dims, output dims) with equal element counts.

    Trailing dims equal on both sides pair first; where the leading run's products cannot be matched by sympy
    (sizes with floor divisions: Mamba-2's ``x.reshape(b, -1, chunk, heads, head_dim)``, a gated delta net's
    ``x.reshape(b, heads, -1, chunk, head_dim)`` of a padded length), its equal leading dims pair and the dims
    between are one group, its product equal on both sides since the rest is."""
    n_in, n_out = len(in_shape), len(out_shape)
    tail = 0
    while tail < min(n_in, n_out) and _same(in_shape[n_in - 1 - tail], out_shape[n_out - 1 - tail]):
        tail += 1
    head = _leading_groups(in_shape, out_shape, n_in - tail, n_out - tail)
    if head is None:
        lead = 0  # equal leading dims pair (batch, heads), the run between them and the tail is one group
        while lead < min(n_in, n_out) - tail and _same(in_shape[lead], out_shape[lead]):
            lead += 1
        if n_in - tail > lead and n_out - tail > lead:
            head = [([k], [k]) for k in range(lead)] + \
                [(list(range(lead, n_in - tail)), list(range(lead, n_out - tail)))]
    if head is None:
        return None
    return head + [([n_in - tail + k], [n_out - tail + k]) for k in range(tail)]


def _leading_groups(in_shape, out_shape, n_in: int, n_out: int) -> Optional[list]:
    """``dim_groups`` of the first ``n_in`` / ``n_out`` dims, matched by products, or None."""
    i = j = 0
    groups = []
    try:
        while i < n_in or j < n_out:
            if i < n_in and j < n_out and _same(in_shape[i], out_shape[j]):
                groups.append(([i], [j]))
                i, j = i + 1, j + 1
                continue
            if i < n_in and _hint(in_shape[i]) == 1:
                groups.append(([i], []))
                i += 1
                continue
            if j < n_out and _hint(out_shape[j]) == 1:
                groups.append(([], [j]))
                j += 1
                continue
            gi, gj = [i], [j]
            pi, pj = _expr(in_shape[i]), _expr(out_shape[j])
            hi, hj = _hint(in_shape[i]), _hint(out_shape[j])
            i, j = i + 1, j + 1
            while sympy.expand(pi - pj) != 0:
                if (i if hi < hj else j) >= (n_in if hi < hj else n_out):
                    return None
                if hi < hj:
                    gi.append(i)
                    pi, hi = pi * _expr(in_shape[i]), hi * _hint(in_shape[i])
                    i += 1
                else:
                    gj.append(j)
                    pj, hj = pj * _expr(out_shape[j]), hj * _hint(out_shape[j])
                    j += 1
            groups.append((gi, gj))
    except IndexError:
        return None
    return groups


def reshape_shard_dim(in_shape, out_shape, dim: int, tp: int, split_sizes=None) -> Optional[int]:
    """Output dim that carries input shard ``dim`` through a reshape, or None if it cannot.

    ``split_sizes(size)``: each rank's part of a dimension (default: even); the input's and the
    output's parts must be proportional, so every rank's block stays the same elements."""
    if split_sizes is None:
        split_sizes = lambda n: (n // tp,) * tp if isinstance(n, int) and n % tp == 0 else None  # noqa: E731
    groups = dim_groups(in_shape, out_shape)
    if groups is None:
        return None
    for gi, gj in groups:
        if dim in gi:
            outer_in = [d for d in gi if _hint(in_shape[d]) != 1]
            outer_out = [d for d in gj if _hint(out_shape[d]) != 1]
            if not outer_in or outer_in[0] != dim or not outer_out:
                return None
            o = outer_out[0]
            size, full = out_shape[o], in_shape[dim]
            if _same(size, full):
                return o  # the sharded dim passes unchanged, and so does its split
            # not in proportion: e.g. whole heads on one side, whole columns on the other
            return o if splits_in_proportion(split_sizes, full, size) else None
    return None


def index_shard_dim(index, ndim: int, dim: int) -> Optional[int]:
    """Output dim of input dim ``dim`` after basic indexing ``x[index]``, or None."""
    if not isinstance(index, tuple):
        index = (index,)
    consumed = sum(1 for i in index if isinstance(i, (int, slice)))
    out = 0
    src = 0
    for item in index:
        if item is None:
            out += 1
        elif item is Ellipsis:
            span = ndim - consumed
            if src <= dim < src + span:
                return out + (dim - src)
            src += span
            out += span
        elif isinstance(item, int):
            if src == dim:
                return None
            src += 1
        elif isinstance(item, slice):
            if src == dim:
                return out if item == slice(None) else None
            src += 1
            out += 1
        else:
            return None  # tensor or symbolic index
    if dim >= src:
        return out + (dim - src)
    return None


def permutation(node, ndim) -> Optional[list]:
    """The dims of a transpose / permute / movedim / ``x.T`` output, as input dims (None: not one)."""
    name = op_name(node)
    if name in ("transpose", "swapaxes", "swapdims"):
        a = norm_dim(node.args[1], ndim)
        b = norm_dim(node.args[2], ndim)
        perm = list(range(ndim))
        perm[a], perm[b] = perm[b], perm[a]
        return perm
    if name == "permute":
        dims, _ = spelled_out(node, "dims")
        return [norm_dim(d, ndim) for d in dims]
    if name == "t":
        return list(reversed(range(ndim)))
    if name == "movedim" and all(isinstance(a, int) for a in node.args[1:3]):
        source, destination = norm_dim(node.args[1], ndim), norm_dim(node.args[2], ndim)
        perm = [d for d in range(ndim) if d != source]
        perm.insert(destination, source)
        return perm
    if name == "getattr" and node.args[1] in ("T", "mT"):  # Falcon's ``x @ self.weight.T``
        perm = list(range(ndim))
        if node.args[1] == "T":
            return list(reversed(perm))
        perm[-1], perm[-2] = perm[-2], perm[-1]
        return perm
    return None
