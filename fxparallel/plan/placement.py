"""How one tensor is laid out over the tensor-parallel group.

Three layouts are enough for tensor parallelism:

* ``R``: every rank holds the whole tensor (replicated).
* ``S(d)``: every rank holds one contiguous chunk of dimension ``d`` (sharded).
* ``P``: every rank holds a full-shape tensor and the true value is their sum
  (partial, as after a row-parallel matmul).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional


@dataclass(frozen=True, order=True)
class Placement:
    kind: str  # "R", "S" or "P"
    dim: Optional[int] = None

    def __post_init__(self):
        if self.kind not in ("R", "S", "P"):
            raise ValueError(f"unknown placement kind {self.kind!r}")
        if (self.kind == "S") != (self.dim is not None):
            raise ValueError("only a shard placement has a dimension")

    @property
    def is_replicate(self) -> bool:
        return self.kind == "R"

    @property
    def is_shard(self) -> bool:
        return self.kind == "S"

    @property
    def is_partial(self) -> bool:
        return self.kind == "P"

    def __repr__(self) -> str:
        return f"S({self.dim})" if self.kind == "S" else self.kind

    __str__ = __repr__

    @staticmethod
    def parse(text: str) -> "Placement":
        text = text.strip()
        if text in ("R", "P"):
            return Placement(text)
        if text.startswith("S(") and text.endswith(")"):
            return Placement("S", int(text[2:-1]))
        raise ValueError(f"cannot parse placement {text!r}")


R = Placement("R")
P = Placement("P")


def S(dim: int) -> Placement:
    return Placement("S", dim)
