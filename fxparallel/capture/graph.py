"""What capture hands to the planner: one FX graph and how its inputs map back to the model."""
from __future__ import annotations

import dataclasses
import operator
import re
from collections import Counter
from dataclasses import dataclass, field
from typing import Iterable, Optional

import torch.fx as fx


@dataclass
class CapturedGraph:
    gm: fx.GraphModule
    # placeholder name -> what it stands for
    params: dict[str, str]  # -> canonical parameter name
    buffers: dict[str, str]  # -> buffer name
    inputs: dict[str, str]  # -> forward argument name (input_ids, labels, ..., past_<layer>_<field>)
    symbols: dict[str, tuple[str, int]]  # symbolic size placeholder -> (argument, dim)
    outputs: tuple[str, ...]  # names of the graph outputs, e.g. ("loss", "logits")
    # shape guards that must hold for this graph to be valid: (sympy expr, {symbol: (argument, dim)})
    guards: list = field(default_factory=list)
    symbol_sources: dict = field(default_factory=dict)  # sympy Symbol -> (argument, dim)
    # (argument, dim) -> the size captured as a constant; (argument, "ndim") -> its number of dims
    static_sizes: dict = field(default_factory=dict)
    # placeholder name -> argument name, for the KV cache tensors among the inputs: state the solver
    # places like a parameter and the graph writes in place (capture/static_cache.py)
    state: dict = field(default_factory=dict)
    # the graph of the first few decoder layers this one repeats (capture/repeat_layers.py): solved first
    few_layers: Optional["CapturedGraph"] = None

    def shape_guards(self) -> "ShapeGuards":
        return ShapeGuards(tuple(self.guards), dict(self.symbol_sources), dict(self.static_sizes))

    def copy(self) -> "CapturedGraph":
        """A copy whose graph the rewrite passes can change while this one stays as captured (the nodes are
        new, with the same names; their meta dicts are shallow copies), to plan one capture more than one way."""
        graph = fx.Graph()
        graph.output(graph.graph_copy(self.gm.graph, {}))
        return dataclasses.replace(self, gm=fx.GraphModule(self.gm, graph), guards=list(self.guards),
                                   few_layers=self.few_layers.copy() if self.few_layers is not None else None)


@dataclass(frozen=True)
class ShapeGuards:
    """The shapes a captured graph is valid for: all the code needs of the capture once it exists."""

    guards: tuple  # sympy expressions over the size symbols
    symbol_sources: dict  # sympy Symbol -> (argument, dim)
    static_sizes: dict  # (argument, dim) -> constant size; (argument, "ndim") -> number of dims

    def holds_for(self, shapes: dict[str, tuple[int, ...]]) -> bool:
        """Do the shape guards captured with this graph hold for these argument shapes?"""
        for (arg, dim), size in self.static_sizes.items():
            shape = shapes.get(arg)
            if shape is None or (len(shape) if dim == "ndim" else (shape[dim] if dim < len(shape) else None)) != size:
                return False
        values = {}
        for sym, (arg, dim) in self.symbol_sources.items():
            if arg not in shapes or dim >= len(shapes[arg]):
                return False
            values[sym] = shapes[arg][dim]
        for expr in self.guards:
            if not bool(expr.xreplace(values)):
                return False
        return True


_ROOT = re.compile(r"^[A-Za-z_]+\[[^\]]*\]\.?")


def module_path(node) -> str:
    """The Hugging Face module a graph node came from, e.g. model.layers.0.self_attn.o_proj."""
    stack = node.meta.get("nn_module_stack") if node is not None else None
    if not stack:
        return "<top>"
    path = list(stack.values())[-1][0]
    path = _ROOT.sub("", path)
    path = re.sub(r"\[(\d+)\]", r".\1", path).replace("._modules['", ".").replace("']", "")
    return path or "<top>"


def mutates_in_place(node: fx.Node) -> bool:
    """Does the node write into one of its inputs (``x.scatter_(...)``, ``x += y``)? Its result
    may be unused while the mutation is read later (DeepSeek-style routing builds its group
    mask with ``scatter_``), so dead-code elimination must keep it; FX counts method calls
    as pure."""
    if node.op not in ("call_method", "call_function"):
        return False
    name = node.target if isinstance(node.target, str) else getattr(node.target, "__name__", "")
    if name.startswith("__"):
        return name in ("__setitem__", "__iadd__", "__isub__", "__imul__", "__itruediv__")
    return name.endswith("_") or node.target in _INPLACE_OPERATORS or node.target is operator.setitem


def writes_data(node: fx.Node) -> bool:
    """Does the node write into the data of its first argument (``requires_grad_`` only flags it)?"""
    return mutates_in_place(node) and bool(node.args) and node.target != "requires_grad_"


_INPLACE_OPERATORS = {getattr(operator, n) for n in ("iadd", "isub", "imul", "itruediv", "ifloordiv", "imod", "ipow",
                                                      "imatmul", "iand", "ior", "ixor", "ilshift", "irshift")}


def sets_interpreter_state(node: fx.Node) -> bool:
    """Does the node enter or leave a functorch transform (``torch.vmap`` traced inline, as in Mamba's
    associative scan: ``_vmap_increment_nesting`` ... ``_vmap_decrement_nesting``)? Its result is
    unused, but the batched ops between the two need the level it opens; FX counts it as pure."""
    name = getattr(node.target, "__name__", "") if node.op == "call_function" else ""
    return name.startswith("_vmap_") and name.endswith("_nesting")


def eliminate_dead_code(graph: fx.Graph) -> None:
    """FX's dead-code elimination, keeping the nodes that write into their inputs or set functorch's
    transform state."""
    graph.eliminate_dead_code(is_impure_node=lambda n: n.is_impure() or mutates_in_place(n)
                              or sets_interpreter_state(n))


def layer_container(names: Iterable[str]) -> Optional[str]:
    """The module path whose numbered children are the decoder layers, or None."""
    counts = Counter()
    for name in names:
        parts = name.split(".")
        for i in range(1, len(parts) - 1):
            if parts[i].isdigit():
                counts[".".join(parts[:i])] += 1
    if not counts:
        return None
    # most parameters; on a tie the outermost (shortest) prefix
    return max(counts, key=lambda prefix: (counts[prefix], -len(prefix)))
