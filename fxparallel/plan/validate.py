"""Checks that run before anything is captured or read: can the model be split over tp ranks?

tp need not divide the heads, the MLP width or the vocabulary: those split unevenly in
whole units (``layout.py``). What stays impossible, each refused here naming the config
field and the parameters whose dimension it is:

* fewer attention heads, MLP columns or vocabulary rows than ranks (a rank would hold nothing).

More ranks than key/value heads is fine: the kv heads are replicated, each rank using
the ones its query heads need (expanded to one per query head, then sliced).
"""
from __future__ import annotations

from typing import Optional

from ..errors import ShardingError
from .layout import config_int, head_dim_of, text_config

_FIELDS = (
    ("num_attention_heads", "attention heads"),
    ("intermediate_size", "MLP intermediate size"),
    ("vocab_size", "vocabulary"),
)


def _problem(field_name: str, what: str, value: int, tp: int):
    """Why ``value`` of ``field_name`` cannot be split over ``tp`` ranks, or None if it can."""
    if tp > value:
        return f"tp size {tp} is larger than {field_name}={value} ({what}): a rank would hold none"
    return None


def _heads_side(module):
    """For a linear layer (``nn.Linear``, transformers' ``Conv1D``): (dim of its weight that is its output, dim
    that is its input); None for anything else."""
    weight = getattr(module, "weight", None)
    if weight is None or weight.dim() != 2:
        return None
    if hasattr(module, "in_features") and hasattr(module, "out_features"):
        return 0, 1
    if hasattr(module, "nf"):  # Conv1D: weight [in, out]
        return 1, 0
    return None


# names transformers gives the projection out of the heads (to tell it from q / k / v when all are square)
_OUTPUT_PROJECTIONS = ("o_proj", "out_proj", "c_proj", "dense", "wo", "o", "out", "proj", "dense_out", "output_proj")


def split_by_heads(meta_model, heads: int, head_dim: int, hidden: Optional[int]) -> list:
    """[(parameter name, dim)] of the weights an attention head split cuts: in each attention module (a class
    named ``...Attention``), the projections into the heads along their output (q, and k / v where they have
    as many heads; fused qkv) and the projection back out of the heads along its input. Not every weight that
    happens to be heads x head_dim wide: the embedding width, a k_proj's input are the hidden size.

    Which linear layer is the way out: the one whose output alone is the hidden size; where that does not tell
    (square projections, hidden = heads x head_dim), the one named as transformers names it (``o_proj``,
    ``out_proj``, ``c_proj``, ``dense``, ...), else the last one registered."""
    extent = heads * head_dim
    found = []
    for path, module in meta_model.named_modules():
        if "Attention" not in type(module).__name__:
            continue
        linear = []  # (name, weight, out dim, in dim)
        for name, child in module.named_children():
            sides = _heads_side(child)
            if sides is not None:
                linear.append((name, child.weight, *sides))
        if not linear:
            continue
        role = {}
        for name, weight, out_dim, in_dim in linear:
            out_size, in_size = weight.shape[out_dim], weight.shape[in_dim]
            if out_size == hidden and in_size != hidden:
                role[name] = "out"
            elif out_size == hidden and in_size == hidden:
                role[name] = None  # square: told below
            else:
                role[name] = "in"
        undecided = [name for name, _, _, _ in linear if role[name] is None]
        if undecided:
            way_out = None
            if "out" not in role.values() and len(linear) > 1:
                named = [n for n in undecided if n in _OUTPUT_PROJECTIONS]
                way_out = named[0] if named else undecided[-1]
            for name in undecided:
                role[name] = "out" if name == way_out else "in"
        for name, weight, out_dim, in_dim in linear:
            dim = in_dim if role[name] == "out" else out_dim
            size = weight.shape[dim]
            if size == extent or (role[name] == "in" and size > extent and size % head_dim == 0):
                found.append((f"{path}.{name}.weight" if path else f"{name}.weight", dim))
    return found


def _sized(meta_model, extent: int) -> list:
    """[(parameter name, dim)] of the matrices with a dimension of ``extent`` (the MLP width, the vocabulary)."""
    found = []
    for name, p in meta_model.named_parameters():
        dims = [d for d, s in enumerate(p.shape) if s == extent]
        if dims and p.dim() >= 2:
            found.append((name, dims[0]))
    return found


def _listed(hits: list) -> str:
    """Names with their dim, identical layers as one (``model.layers.{0-31}.self_attn.q_proj.weight (dim 0)``)."""
    from ..summary import _INDEX, _ranges

    groups = {}
    for name, dim in hits:
        groups.setdefault((_INDEX.sub(".*", name), dim), []).append(name)
    shown = []
    for (pattern, dim), names in groups.items():
        if len(names) > 1:
            for values in zip(*[_INDEX.findall(n) for n in names]):
                pattern = pattern.replace(".*", "." + _ranges(int(v) for v in values), 1)
        else:
            pattern = names[0]
        shown.append(f"{pattern} (dim {dim})")
    return ", ".join(shown[:4] + ([f"... {len(shown) - 4} more"] if len(shown) > 4 else []))


def check_splittable(config, tp: int, meta_model=None) -> None:
    if tp < 1:
        raise ShardingError(f"tp size must be >= 1, got {tp}")
    config = text_config(config)
    problems = []
    for field_name, what in _FIELDS:
        value = config_int(config, field_name)
        if value is None or value < 1:
            continue
        why = _problem(field_name, what, value, tp)
        if why is None:
            continue
        where = ""
        if meta_model is not None:
            if field_name == "num_attention_heads":
                hits = split_by_heads(meta_model, value, head_dim_of(config) or 1, config_int(config, "hidden_size"))
                where = "; the heads split " + _listed(hits) if hits else ""
            else:
                hits = _sized(meta_model, value)
                where = "; it is the size of " + _listed(hits) if hits else ""
        problems.append(why + where)
    if problems:
        raise ShardingError(
            f"cannot split the model over tp={tp} ranks: " + "; ".join(problems)
            + ". Uneven splits are supported (whole heads, columns, rows), but not these."
        )
