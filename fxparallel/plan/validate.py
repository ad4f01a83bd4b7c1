"""Checks that run before anything is captured or read: can the model be split over tp ranks?

tp need not divide the heads, the MLP width or the vocabulary: those split unevenly in
whole units (``layout.py``). What stays impossible, each refused here naming the config
field and the parameters whose dimension it is:

* fewer attention heads, MLP columns or vocabulary rows than ranks (a rank would hold nothing).

More ranks than key/value heads is fine: the kv heads are replicated, each rank using
the ones its query heads need (expanded to one per query head, then sliced).
"""
from __future__ import annotations

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
        extent = value
        if field_name == "num_attention_heads":
            extent = value * (head_dim_of(config) or 1)
        where = ""
        if meta_model is not None:
            hits = []
            for name, p in meta_model.named_parameters():
                dims = [d for d, s in enumerate(p.shape) if s == extent]
                if dims and p.dim() >= 2:
                    hits.append(f"{name} (dim {dims[0]})")
            if hits:
                shown = hits[:3] + ([f"... {len(hits) - 3} more"] if len(hits) > 3 else [])
                where = "; it is the size of " + ", ".join(shown)
        problems.append(why + where)
    if problems:
        raise ShardingError(
            f"cannot split the model over tp={tp} ranks: " + "; ".join(problems)
            + ". Uneven splits are supported (whole heads, columns, rows), but not these."
        )
