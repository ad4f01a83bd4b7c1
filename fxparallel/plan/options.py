"""How a graph is planned and rewritten, apart from what it computes (``capture/spec.py``): one frozen
object, part of the graph cache's key."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Optional


@dataclass(frozen=True)
class PlanOptions:
    """``fixed``: parameter name -> Placement decided before the solve (a saved plan, or the first graph's
    placements for every later graph). ``cp``: the context-parallel group (a TPGroup) or None.
    ``sequence_parallel``: activations outside attention and MLP sharded along the sequence (not for
    generation graphs). ``expert_parallel``: whole experts per rank (plan/rules/expert_rows.py); ``experts_why``:
    the report's line on how the experts are split and why (plan/expert_choice.py; not part of the graph cache's
    key: the same graph whether chosen or asked for).
    ``skip_passes``: rewrite passes left out (rewrite/passes.py). ``ep``: the expert-parallel group over
    data-parallel ranks (a TPGroup) or None (ops/expert_exchange.py)."""

    fixed: dict = field(default_factory=dict)
    cp: Optional[object] = None
    sequence_parallel: bool = False
    expert_parallel: bool = False
    experts_why: str = ""
    skip_passes: tuple = ()
    ep: Optional[object] = None

    def __post_init__(self):
        object.__setattr__(self, "fixed", dict(self.fixed or {}))
        object.__setattr__(self, "skip_passes", tuple(self.skip_passes))

    def with_fixed(self, fixed: dict) -> "PlanOptions":
        return dataclasses.replace(self, fixed=fixed)

    def for_cache(self, cache_length) -> "PlanOptions":
        """A generation graph (``cache_length`` set) runs without sequence parallelism: decode steps have one
        token."""
        return self if cache_length is None else dataclasses.replace(self, sequence_parallel=False)

    def to_dict(self) -> dict:
        cp = self.cp
        return {"fixed": {name: repr(p) for name, p in sorted(self.fixed.items())},
                "cp": None if cp is None else [cp.size, cp.rank, cp.handle],
                "sequence_parallel": bool(self.sequence_parallel), "expert_parallel": bool(self.expert_parallel),
                "skip_passes": sorted(self.skip_passes),
                "ep": None if self.ep is None else [self.ep.size, self.ep.rank, self.ep.handle]}
