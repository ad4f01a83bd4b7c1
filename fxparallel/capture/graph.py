"""What capture hands to the planner: one FX graph and how its inputs map back to the model."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch.fx as fx


@dataclass
class CapturedGraph:
    gm: fx.GraphModule
    # placeholder name -> what it stands for
    params: dict[str, str]  # -> canonical parameter name
    buffers: dict[str, str]  # -> buffer name
    inputs: dict[str, str]  # -> forward argument name (input_ids, labels, ...)
    symbols: dict[str, tuple[str, int]]  # symbolic size placeholder -> (argument, dim)
    outputs: tuple[str, ...]  # names of the graph outputs, e.g. ("loss", "logits")
    # shape guards that must hold for this graph to be valid: (sympy expr, {symbol: (argument, dim)})
    guards: list = field(default_factory=list)
    symbol_sources: dict = field(default_factory=dict)  # sympy Symbol -> (argument, dim)
    attributes: dict = field(default_factory=dict)  # attributes the local graph reads besides parameters/buffers
    sequence_parallel: object = None  # SequenceParallelReport when the sequence-parallel pass ran

    def release(self) -> None:
        """Drop the graph (and the fake tensors in its metadata) once the local code exists;
        only the guards and attributes are needed to run it."""
        self.gm = None

    def placeholders(self) -> list[fx.Node]:
        return [n for n in self.gm.graph.nodes if n.op == "placeholder"]

    def holds_for(self, shapes: dict[str, tuple[int, ...]]) -> bool:
        """Do the shape guards captured with this graph hold for these argument shapes?"""
        values = {}
        for sym, (arg, dim) in self.symbol_sources.items():
            if arg not in shapes or dim >= len(shapes[arg]):
                return False
            values[sym] = shapes[arg][dim]
        for expr in self.guards:
            if not bool(expr.xreplace(values)):
                return False
        return True
