"""Parameters stored under other names or layouts: transformers' checkpoint conversion mapping.

transformers 5 loads several architectures through ``conversion_mapping.py``: renames (GPT-NeoX stores
``lm_head.weight`` as ``embed_out.weight``, Mixtral ``mlp`` as ``block_sparse_moe``) and converters that
build one parameter from many stored tensors (per-expert 2-D weights stacked into a 3-D
``experts.gate_up_proj``, gate and up concatenated along dim 1). ``save_pretrained`` writes the stored
layout back, so such checkpoints never hold the parameters under their own names.

Which stored tensors feed which parameter is decided by transformers' own transform objects, applied to
the checkpoint's names exactly as ``from_pretrained`` applies them. Their operations are then replayed
symbolically: a parameter becomes a tree of stack / cat / narrow / transpose nodes over stored tensors,
from which any slice of the parameter is a list of (stored tensor, slice, destination view) pieces. Only
those pieces are ever read. transformers' reverse mapping (what ``save_pretrained`` writes) names the
stored tensors each parameter needs, so an absent one is reported under its name on disk.
"""
from __future__ import annotations

import logging
import math
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Optional

import torch

log = logging.getLogger("fxparallel")


class ConversionError(Exception):
    """The stored tensors of a converted parameter cannot be combined (message names them)."""


# ---- symbolic tensors ---------------------------------------------------------------
def _dim(dim: int, ndim: int) -> int:
    return dim + ndim if dim < 0 else dim


class Stored:
    """A tensor of the checkpoint, read as is."""

    def __init__(self, name: str, shape: tuple):
        self.name, self.shape = name, tuple(shape)

    def pieces(self, index: tuple, out: torch.Tensor):
        """(stored name, index into it, destination view) for ``self[index]`` written into ``out``.

        ``index``: (start, stop) per dimension; ``out``: a view shaped like that piece."""
        yield self.name, tuple(slice(a, b) for a, b in index), out

    def leaves(self) -> list:
        return [self.name]


class Stack:
    """``torch.stack(children, dim)``: e.g. per-expert weights merged into one 3-D parameter."""

    def __init__(self, children: list, dim: int):
        shapes = [c.shape for c in children]
        if not children or any(s != shapes[0] for s in shapes):
            raise ConversionError("cannot stack tensors of shapes " + _listing(children))
        self.children, self.dim = children, _dim(dim, len(shapes[0]) + 1)
        self.shape = shapes[0][:self.dim] + (len(children),) + shapes[0][self.dim:]

    def pieces(self, index, out):
        a, b = index[self.dim]
        rest = index[:self.dim] + index[self.dim + 1:]
        for i in range(a, b):
            yield from self.children[i].pieces(rest, out.select(self.dim, i - a))

    def leaves(self):
        return [n for c in self.children for n in c.leaves()]


class Cat:
    """``torch.cat(children, dim)``: e.g. gate and up halves of ``gate_up_proj`` (gate first)."""

    def __init__(self, children: list, dim: int):
        if not children:
            raise ConversionError("nothing to concatenate")
        ndim = len(children[0].shape)
        self.children, self.dim = children, _dim(dim, ndim)
        other = [c.shape[:self.dim] + c.shape[self.dim + 1:] for c in children]
        if any(len(c.shape) != ndim for c in children) or any(o != other[0] for o in other):
            raise ConversionError(f"cannot concatenate along dim {self.dim} tensors of shapes " + _listing(children))
        self.shape = children[0].shape[:self.dim] + (sum(c.shape[self.dim] for c in children),) + other[0][self.dim:]

    def pieces(self, index, out):
        a, b = index[self.dim]
        offset = 0
        for child in self.children:
            n = child.shape[self.dim]
            lo, hi = max(a, offset), min(b, offset + n)
            if lo < hi:
                sub = index[:self.dim] + ((lo - offset, hi - offset),) + index[self.dim + 1:]
                yield from child.pieces(sub, out.narrow(self.dim, lo - a, hi - lo))
            offset += n

    def leaves(self):
        return [n for c in self.children for n in c.leaves()]


class Narrow:
    """``child.narrow(dim, start, length)``: one output of a chunk or split."""

    def __init__(self, child, dim: int, start: int, length: int):
        self.child, self.dim, self.start = child, _dim(dim, len(child.shape)), start
        self.shape = child.shape[:self.dim] + (length,) + child.shape[self.dim + 1:]

    def pieces(self, index, out):
        a, b = index[self.dim]
        sub = index[:self.dim] + ((a + self.start, b + self.start),) + index[self.dim + 1:]
        yield from self.child.pieces(sub, out)

    def leaves(self):
        return self.child.leaves()


class Transposed:
    """``child.transpose(d0, d1)``."""

    def __init__(self, child, d0: int, d1: int):
        n = len(child.shape)
        self.child, self.d0, self.d1 = child, _dim(d0, n), _dim(d1, n)
        shape = list(child.shape)
        shape[self.d0], shape[self.d1] = shape[self.d1], shape[self.d0]
        self.shape = tuple(shape)

    def pieces(self, index, out):
        sub = list(index)
        sub[self.d0], sub[self.d1] = sub[self.d1], sub[self.d0]
        yield from self.child.pieces(tuple(sub), out.transpose(self.d0, self.d1))

    def leaves(self):
        return self.child.leaves()


class Unflattened:
    """``child.unflatten(dim, (-1, inner))``: one dim read as (outer, inner)."""

    def __init__(self, child, dim: int, inner: int):
        self.child, self.dim, self.inner = child, _dim(dim, len(child.shape)), inner
        n = child.shape[self.dim]
        if n % inner:
            raise ConversionError(f"cannot unflatten dim {self.dim} of shape {list(child.shape)} into rows of {inner}")
        self.shape = child.shape[:self.dim] + (n // inner, inner) + child.shape[self.dim + 1:]

    def pieces(self, index, out):
        (a, b), (c, d) = index[self.dim], index[self.dim + 1]
        for i in range(a, b):  # each outer row is one contiguous run of the child's dim
            sub = index[:self.dim] + ((i * self.inner + c, i * self.inner + d),) + index[self.dim + 2:]
            yield from self.child.pieces(sub, out.select(self.dim, i - a))

    def leaves(self):
        return self.child.leaves()


class Interleaved:
    """transformers' ``Interleave(dim)``: rows ``0, 2, 4, ...`` of ``child`` first, then ``1, 3, 5, ...``
    (``inverse``: the other way round). No two neighbouring rows of the result are neighbours in the
    checkpoint, so a slice is read row by row along ``dim`` (each row's own bytes, nothing more)."""

    def __init__(self, child, dim: int, inverse: bool):
        self.child, self.dim, self.inverse = child, _dim(dim, len(child.shape)), inverse
        self.shape = child.shape
        if self.shape[self.dim] % 2:
            raise ConversionError(f"cannot interleave an odd dim {self.dim} of shape {list(self.shape)}")

    def _source(self, i: int) -> int:
        half = self.shape[self.dim] // 2
        if self.inverse:
            return (i % 2) * half + i // 2
        return 2 * i if i < half else 2 * (i - half) + 1

    def pieces(self, index, out):
        a, b = index[self.dim]
        for i in range(a, b):
            j = self._source(i)
            sub = index[:self.dim] + ((j, j + 1),) + index[self.dim + 1:]
            yield from self.child.pieces(sub, out.narrow(self.dim, i - a, 1))

    def leaves(self):
        return self.child.leaves()


def _listing(nodes) -> str:
    return ", ".join(f"{list(n.shape)}" + (f" ({n.name!r})" if isinstance(n, Stored) else "") for n in nodes)


# ---- transformers' operations, replayed on symbolic tensors ---------------------------
def _one(values: dict):
    if len(values) != 1:
        raise ConversionError(f"expected one input, got {len(values)}")
    v = next(iter(values.values()))
    return v[0] if isinstance(v, list) else v


def _merge(op, values, sources, targets, **_):
    out = {}
    for pattern in list(values):
        v = values[pattern]
        out[op.get_target_pattern(len(values), pattern, targets)] = v if not isinstance(v, list) else Stack(v, op.dim)
    return out


def _concatenate(op, values, sources, targets, **_):
    parts = []
    for pattern in sources:  # the order of the source patterns, as transformers keeps it
        if pattern in values:
            v = values[pattern]
            parts.extend(v if isinstance(v, list) else [v])
    return {op.get_target_pattern(targets): Cat(parts, op.dim)}


def _chunk(op, values, sources, targets, config=None, **_):
    t = _one(values)
    names = op.get_target_patterns(targets, config=config)
    d = _dim(op.dim, len(t.shape))
    size = t.shape[d]
    step = math.ceil(size / len(names))  # torch.chunk's sizes
    return {name: Narrow(t, d, start, min(step, size - start)) for name, start in zip(names, range(0, size, step))}


def _split(op, values, sources, targets, full_layer_name="", shape_of=None, **_):
    t = _one(values)
    d = _dim(op.dim, len(t.shape))
    out, start = {}, 0
    for target in targets:
        n = shape_of(full_layer_name.replace(targets[0], target))[d]
        out[target] = Narrow(t, d, start, n)
        start += n
    return out


def _transpose(op, values, sources, targets, full_layer_name="", shape_of=None, **_):
    name = op.get_target_pattern(values, sources, targets)
    t = _one(values)
    if op.check_dims and tuple(t.shape) == tuple(shape_of(full_layer_name)):
        return {name: t}
    return {name: Transposed(t, op.dim0, op.dim1)}


def _interleave(op, values, sources, targets, **_):
    return {targets[0]: Interleaved(_one(values), op.dim, op.inverse)}


def _unpad_vocab(op, values, sources, targets, config=None, **_):
    """Inkling 2 stores its unembedding padded to ``vocab_size`` rows; the model keeps the first
    ``unpadded_vocab_size``."""
    t = _one(values)
    if op.inverse:
        raise ConversionError("Inkling2UnpadVocab(inverse=True) is the direction save_pretrained writes")
    return {targets[0]: Narrow(t, 0, 0, config.get_text_config().unpadded_vocab_size)}


def _merge_message_queries(op, values, sources, targets, **_):
    """Inkling 2 Loop stores its message queries as two (2 * loops, hidden) tensors, [query, mlp] and
    [key, value] of each loop layer; the model keeps (loops, 4, hidden): query, key, value, mlp."""
    if op.inverse:
        raise ConversionError("Inkling2LoopMergeMessageQueries(inverse=True) is the direction save_pretrained writes")
    if any(p not in values for p in sources):
        raise ConversionError(f"needs stored tensors for each of {sources}, found {sorted(values)}")
    queries, kv = (Unflattened(_one({p: values[p]}), 0, 2) for p in sources)
    return {targets[0]: Cat([Narrow(queries, 1, 0, 1), kv, Narrow(queries, 1, 1, 1)], 1)}


def _dequantize_experts(op, values, sources, targets, **_):
    """Only the unquantized form (one stored tensor, which the op passes through) is read in slices."""
    if len(values) != 1:
        raise ConversionError(f"transformers dequantizes {sorted(values)} through {type(op).__name__}, "
                              "which fxparallel cannot read in slices (store the experts unquantized)")
    return {targets[0]: _one(values)}


def _replayers() -> dict:
    from transformers import core_model_loading as cml

    replay = {cml.MergeModulelist: _merge, cml.Concatenate: _concatenate, cml.Chunk: _chunk, cml.Split: _split,
              cml.Transpose: _transpose}
    for name, fn in (("Interleave", _interleave), ("Inkling2UnpadVocab", _unpad_vocab),
                     ("Inkling2LoopMergeMessageQueries", _merge_message_queries),
                     ("Inkling2LoopDequantizeExperts", _dequantize_experts)):
        if hasattr(cml, name):  # newer transformers only
            replay[getattr(cml, name)] = fn
    return replay


# ---- which stored tensors feed which parameter -----------------------------------------
@dataclass
class Group:
    """The stored tensors that transformers collects for one renamed key (a converter's first target)."""

    key: str  # the renamed key (a model name)
    converter: object = None  # transformers WeightConverter, or None for a plain rename
    collected: dict = field(default_factory=lambda: defaultdict(list))  # source pattern -> stored names
    made: dict = field(default_factory=dict)  # model name -> symbolic tensor, once built
    error: Optional[Exception] = None  # why it could not be built

    @property
    def sources(self) -> list:
        return [n for names in self.collected.values() for n in names]

    def build(self, shape_of_stored, shape_of_param, config) -> dict:
        """Model name -> symbolic tensor, for every parameter this group makes."""
        if self.converter is None:
            name = self.sources[0]
            return {self.key: Stored(name, shape_of_stored(name))}
        values = {p: [Stored(n, shape_of_stored(n)) for n in names] for p, names in self.collected.items()}
        replay = _replayers()
        conv = self.converter
        for op in conv.operations:
            fn = replay.get(type(op))
            if fn is None:
                raise ConversionError(f"transformers stores it through the {type(op).__name__} conversion, "
                                      "which fxparallel cannot read in slices")
            values = fn(op, values, conv.source_patterns, conv.target_patterns, full_layer_name=self.key,
                        shape_of=shape_of_param, config=config)
        full = self.key.replace("*.", "0.")
        for pattern in values:  # the targets are named around the first one, as WeightConverter.convert does
            if pattern in full:
                prefix, _, suffix = full.partition(pattern)
                return {prefix + k + suffix: (v[0] if isinstance(v, list) else v) for k, v in values.items()}
        raise ConversionError(f"transformers' conversion gives {sorted(values)}, none of which names {self.key}")


@dataclass
class Conversions:
    """How the parameters missing under their own names are stored."""

    groups: dict  # model name -> Group that makes it (renamed key, and every output of one-to-many converters)
    expected: dict  # model name -> {stored name: shape} as save_pretrained writes it (may be empty)
    consumed: set  # stored names some group reads

    def absent(self, name: str, stored) -> list:
        """Stored names the parameter ``name`` needs that the checkpoint lacks (by their on-disk names)."""
        expected = self.expected.get(name, {})
        group = self.groups.get(name)
        if group is not None and not set(group.sources) & set(expected):
            return []  # stored in another layout than save_pretrained's: shapes will tell
        return [n for n in expected if n not in stored]


def _transforms(meta_model):
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import WeightConverter, WeightRenaming

    transforms = get_model_conversion_mapping(meta_model)
    renamings = [t for t in transforms if isinstance(t, WeightRenaming)]
    converters = [t for t in transforms if isinstance(t, WeightConverter)]
    return renamings, converters


def find_conversions(meta_model, needed: dict, model_names, stored, shape_of_stored, shape_of_param,
                     config) -> Optional[Conversions]:
    """Groups for the parameters in ``needed`` (name -> shape) from the names in ``stored``.

    ``model_names``: every parameter name of the model (aliases included). ``meta_model``: the
    transformers model on the meta device, for its conversion mapping. None if transformers has no
    conversion API (older or newer than the one this was written for)."""
    try:
        from transformers.core_model_loading import dot_natural_key, rename_source_key
        renamings, converters = _transforms(meta_model)
    except Exception as err:  # noqa: BLE001 - the API is internal to transformers
        log.debug("no checkpoint conversion mapping: %s", err)
        return None
    by_pattern = {p: c for c in converters for p in c.source_patterns}
    names = {n: True for n in model_names}  # rename_source_key looks names up with .get
    prefix = getattr(meta_model, "base_model_prefix", None) or None

    def forward(key: str):
        """The model name of a stored tensor, and the converter source pattern it matched (as from_pretrained)."""
        renamed, pattern = rename_source_key(key, renamings, converters, prefix, names)
        if renamed not in names and key in names:
            renamed, pattern = rename_source_key(key, [], [], base_model_prefix=prefix, meta_state_dict=names)
        return renamed, pattern

    raw = {}
    for key in sorted(stored, key=dot_natural_key):  # experts in numeric order, as transformers stacks them
        renamed, pattern = forward(key)
        if renamed not in names:
            continue
        if pattern is not None:
            group = raw.setdefault(renamed, Group(renamed, by_pattern[pattern]))
            group.collected[pattern].append(key)
        elif renamed not in raw and renamed != key:
            group = raw[renamed] = Group(renamed)
            group.collected[key].append(key)
    groups, consumed = {}, set()
    for group in raw.values():
        one_to_many = group.converter is not None and len(group.converter.target_patterns) > 1
        if group.key not in needed and not one_to_many:
            continue
        try:
            group.made = group.build(shape_of_stored, shape_of_param, config)
        except ConversionError as err:
            group.made, group.error = {group.key: None}, err
        if not any(n in needed for n in group.made):
            continue
        consumed.update(group.sources)
        for name in group.made:
            groups.setdefault(name, group)
    return Conversions(groups, _expected(meta_model, needed, forward), consumed)


def _expected(meta_model, needed: dict, forward) -> dict:
    """Model name -> {stored name: shape} that save_pretrained writes for it (transformers' reverse mapping)."""
    from transformers.core_model_loading import revert_weight_conversion

    try:
        reverted = revert_weight_conversion(meta_model, {n: torch.empty(s, device="meta") for n, s in needed.items()})
    except Exception as err:  # noqa: BLE001 - an operation without a reverse: names are then unknown
        log.debug("no reverse conversion mapping: %s", err)
        return {}
    out = defaultdict(dict)
    for key, tensor in reverted.items():
        target = forward(key)[0]
        if target in needed:
            out[target][key] = tuple(tensor.shape)
    return dict(out)
