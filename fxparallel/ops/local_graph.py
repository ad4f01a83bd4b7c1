"""What the module keeps of one rewritten graph: its generated code and what calling it needs."""
from __future__ import annotations

import functools
import inspect
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

    @functools.cached_property
    def _reads(self) -> frozenset:
        return frozenset(inspect.signature(self.forward).parameters)

    def read(self, arguments: dict) -> dict:
        """The arguments the code reads (a decode step of a state-space model reads no attention mask: its
        graph has no such input)."""
        return {k: v for k, v in arguments.items() if k in self._reads}
