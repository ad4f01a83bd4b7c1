"""Checks that run before anything is captured or read: can the model be split over tp ranks?

For now each split must be even: tp must divide the attention heads, the key/value
heads, the MLP width and the vocabulary. The error names the config field and the
parameters whose dimension it is.
"""
from __future__ import annotations

from ..errors import ShardingError

_FIELDS = (
    ("num_attention_heads", "attention heads"),
    ("num_key_value_heads", "key/value heads"),
    ("intermediate_size", "MLP intermediate size"),
    ("vocab_size", "vocabulary"),
)
# Fewer key/value heads than ranks is fine when tp is a multiple of them: every rank then
# needs whole kv heads that other ranks need too, and the planner computes them replicated.


def _head_dim(config) -> int:
    hd = getattr(config, "head_dim", None)
    if hd:
        return int(hd)
    return int(config.hidden_size) // int(config.num_attention_heads)


def check_divisible(config, tp: int, meta_model=None) -> None:
    if tp < 1:
        raise ShardingError(f"tp size must be >= 1, got {tp}")
    problems = []
    for field_name, what in _FIELDS:
        value = getattr(config, field_name, None)
        if not isinstance(value, int) or value % tp == 0:
            continue
        if field_name == "num_key_value_heads" and tp % value == 0:
            continue
        extent = value
        if field_name in ("num_attention_heads", "num_key_value_heads"):
            extent = value * _head_dim(config)
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
        problems.append(f"tp size {tp} does not divide {field_name}={value} ({what}){where}")
    if problems:
        raise ShardingError(
            "cannot split the model evenly: " + "; ".join(problems)
            + ". Choose a tp size that divides these (uneven splits are not supported yet)."
        )
