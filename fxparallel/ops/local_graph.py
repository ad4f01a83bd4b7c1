"""What the module keeps of one rewritten graph: its generated code and what calling it needs."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Optional

from ..capture.spec import GraphSpec


@dataclass
class LocalGraph:
    spec: GraphSpec  # what the graph computes (its arguments, the options it was captured with)
    forward: Callable  # generated code; called with the module as ``self``
    outputs: tuple  # output names
    output_placements: dict  # name -> Placement
    guards: object  # ShapeGuards: the argument shapes the code is valid for
    attributes: dict  # attributes the code reads besides parameters and buffers (custom autograd bodies)
    code: str
    output_sizes: dict = field(default_factory=dict)  # name -> per-rank sizes along its sharded dim
    state: dict = field(default_factory=dict)  # KV cache argument -> (full shape, local shape, dtype)
    pieces: Optional[object] = None  # LayerPieces: per-layer pieces the root code calls (ops/layer_units.py)

    @property
    def arguments(self) -> tuple:
        return self.spec.arguments

    @property
    def cache_length(self) -> Optional[int]:
        return self.spec.cache_length
