"""What an op rule is, and the registry that maps graph ops (by canonical name, ``op_traits.py``) to rules.

A rule looks at one FX node and the current placements of its tensor inputs and
returns the ways the op can run locally (``Strategy``), cheapest-first by
preference. The solver picks one; the rewrite applies it. A strategy is data: where
the node itself must change, it names a ``LocalOp`` that ``rewrite/local_ops.py``
carries out. An op without a rule runs on replicated inputs (the always-correct fallback).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional, Union

import torch
import torch.fx as fx

from .. import op_traits
from ..layout import ShardLayout
from ..placement import Placement

PlacementOut = Union[Placement, tuple]


@dataclass
class Strategy:
    """One way to run a node on local shards.

    inputs: required placement of each tensor input (``None``: any, the value is not
    read as data, e.g. only its dtype). Parameter inputs that are still undecided take
    their required placement as the decision.
    """

    inputs: dict  # fx.Node -> Placement | None
    output: PlacementOut
    note: str = ""
    own_bytes: float = 0.0  # communication the op itself performs (bytes per token)
    local: Optional["LocalOp"] = None  # how the rewrite makes the node local, if it must change it
    name: str = ""


@dataclass(frozen=True)
class LocalOp:
    """What the rewrite must change in a node to run it on local shards, as data: ``kind`` names
    an entry of ``rewrite/local_ops.py``'s table, ``args`` its parameters (sizes, placements).

    Kinds: ``vocab_parallel_embedding``, ``vocab_parallel_cross_entropy``, ``bias_after_reduce``
    (bias_index, dense), ``local_split_sizes`` (placement), ``mean_of_full`` (parts),
    ``local_view_size`` (dim, full, segmented), ``block_view_size`` (dim, block),
    ``segment_slice`` (placement, position, segment), ``dropout_on_shards`` (placement),
    ``attention_with_dropout`` (placement), ``local_groups`` (channels), ``expert_gather`` (experts),
    ``owned_item`` (dim, position, item), ``mask_foreign_rows`` (lead), ``local_output_size`` (full),
    ``full_shape`` (a shape query of a shard answering the full sizes)."""

    kind: str
    args: tuple = ()  # (name, value) pairs, so the op is hashable and compares by value

    @classmethod
    def of(cls, kind: str, **args) -> "LocalOp":
        return cls(kind, tuple(sorted(args.items())))

    def kwargs(self) -> dict:
        return dict(self.args)


def splits_in_proportion(split_sizes, a, b) -> bool:
    """True if dims of ``a`` and ``b`` elements both split, each rank's parts in the ratio ``a : b``: a view
    between them (a merge, a split, a repeat) keeps every rank's elements its own."""
    parts_a, parts_b = split_sizes(a), split_sizes(b)
    return parts_a is not None and parts_b is not None and len(parts_a) == len(parts_b) \
        and all(i * b == j * a for i, j in zip(parts_a, parts_b))


@dataclass
class RuleContext:
    """What a rule may ask about the graph."""

    tp: int
    tokens: int = 1  # batch x sequence of the example used at capture
    layout: Optional[ShardLayout] = None  # uneven splits (whole heads, columns, rows); None: even only
    experts: frozenset = frozenset()  # placeholders of the expert-stacked parameters, with expert parallelism
    states: frozenset = frozenset()  # placeholders of a generation graph's cache tensors (keys, values, states)
    # the placements decided so far on the solver's branch (None before the walk): a weight's first reader may
    # look at the activation the weight will meet further on (a depthwise conv weight, squeezed first)
    placed: Optional[Callable[[fx.Node], Optional[Placement]]] = None
    undecided: frozenset = frozenset()  # the node's parameter (and cache) inputs whose placement is still open

    def placement_of(self, node) -> Optional[Placement]:
        """The placement decided for ``node`` upstream on this branch, or None (not yet placed)."""
        value = self.placed(node) if self.placed is not None and isinstance(node, fx.Node) else None
        return value if isinstance(value, Placement) else None

    def split_sizes(self, size) -> Optional[tuple]:
        """Each rank's part of a dimension of ``size`` (evenly or in whole units), or None if it cannot be split."""
        return (self.layout or ShardLayout(self.tp)).sizes(size)

    def can_split(self, size) -> bool:
        return self.split_sizes(size) is not None

    def splits_in_proportion(self, a, b) -> bool:
        """See ``splits_in_proportion``, with this context's splits."""
        return splits_in_proportion(self.split_sizes, a, b)

    @property
    def head_dim(self) -> Optional[int]:
        return self.layout.head_dim if self.layout is not None else None

    @property
    def shared_widths(self) -> tuple:
        return self.layout.shared_widths if self.layout is not None else ()

    def fake(self, node) -> Optional[torch.Tensor]:
        if isinstance(node, fx.Node):
            value = node.meta.get("example_value")
            if isinstance(value, torch.Tensor):
                return value
        return None

    def ndim(self, node) -> int:
        return self.fake(node).dim()

    def size(self, node, dim) -> Union[int, torch.SymInt]:
        return self.fake(node).shape[dim]

    def bytes_per_token(self, node) -> float:
        return bytes_per_token(node, self.tokens)


Strategies = Callable[[fx.Node, dict, RuleContext], list]


@dataclass(frozen=True)
class Rule:
    """A registered rule: the strategies of an op, and which shard layouts (``placement.py``) they keep right.

    ``handles_blocks``: it passes a blocked shard on whole (``with_dim``) or converts it knowingly;
    ``handles_whole``: it keeps the whole segments of a segmented shard right. The solver offers
    such an input only to a rule that handles it; any other rule reads it gathered."""

    strategies: Optional[Strategies]
    handles_blocks: bool = False
    handles_whole: bool = False
    first: Optional[Strategies] = None  # offered before ``strategies`` (partial sums, ``partial.py``)

    def __call__(self, node: fx.Node, placements: dict, ctx: RuleContext) -> list:
        found = self.first(node, placements, ctx) if self.first is not None else []
        return found + (self.strategies(node, placements, ctx) if self.strategies is not None else [])


_RULES: dict = {}  # canonical op name (op_traits.py) -> Rule
_FIRST: dict = {}  # canonical op name -> strategies offered before its rule's


def _names(names) -> list:
    out = [n for n in names if n is not None]
    unknown = [n for n in out if not isinstance(n, str) or not op_traits.is_known(n)]
    if unknown:
        raise KeyError(f"register ops by their canonical name in plan/op_traits.py, not {unknown}")
    return out


def register(*names, blocks: bool = False, whole: bool = False):
    """Register a rule for ops by canonical name (``op_traits.SPELLINGS``; a custom op by its qualified
    name "namespace::op", so that the op need not be registered yet). ``blocks`` / ``whole``: see ``Rule``."""

    def wrap(fn: Strategies) -> Strategies:
        for name in _names(names):
            if name in _RULES:  # one rule per op, so that the registry does not depend on import order
                raise ValueError(f"{name} has a rule already: {_RULES[name].strategies.__qualname__}")
            _RULES[name] = Rule(fn, blocks, whole)
        return fn

    return wrap


def register_first(*names):
    """Register strategies offered before each op's own rule, whichever module is imported first."""

    def wrap(fn: Strategies) -> Strategies:
        for name in _names(names):
            if _FIRST.setdefault(name, fn) is not fn:
                raise ValueError(f"{name} has strategies registered first already")
        return fn

    return wrap


def requires_block(strategy: "Strategy") -> bool:
    return any(isinstance(p, Placement) and p.block is not None for p in strategy.inputs.values())


def requires_whole(strategy: "Strategy") -> bool:
    return any(isinstance(p, Placement) and p.whole for p in strategy.inputs.values())


def rule_for(node: fx.Node) -> Optional[Rule]:
    """The rule of a node's op: its own strategies, with those registered first in front."""
    name = op_traits.op_name(node)
    own, first = _RULES.get(name), _FIRST.get(name)
    if first is None:
        return own
    if own is None:
        return Rule(None, first=first)
    return Rule(own.strategies, own.handles_blocks, own.handles_whole, first)


def tensor_inputs(node: fx.Node) -> list:
    """The distinct FX nodes among a node's arguments whose value is a tensor."""
    seen = []
    for n in node.all_input_nodes:
        if isinstance(n.meta.get("example_value"), torch.Tensor) and n not in seen:
            seen.append(n)
    return seen


def norm_dim(dim: int, ndim: int) -> int:
    return dim + ndim if dim < 0 else dim


def arg(node: fx.Node, index: int, name: str, default=None):
    """Positional-or-keyword argument of a call node."""
    if len(node.args) > index:
        return node.args[index]
    return node.kwargs.get(name, default)


# what costs assume for a size known only when the graph runs (``.tolist()`` of expert sizes, ``nonzero``)
UNBACKED_SIZE = 64


def size_hint(size) -> int:
    """A size at the capture's example shapes; a data-dependent (unbacked) size has no example value,
    and counts as UNBACKED_SIZE in costs."""
    if isinstance(size, torch.SymInt):
        hint = size.node.hint
        return int(hint) if hint is not None else UNBACKED_SIZE
    return int(size)


def bytes_per_token(node, tokens: int) -> float:
    """Bytes of a node's (full) value per token, at the example sizes used for capture."""
    value = node.meta.get("example_value") if isinstance(node, fx.Node) else None
    if not isinstance(value, torch.Tensor):
        return 0.0
    numel = 1
    for s in value.shape:
        numel *= size_hint(s)
    return numel * value.element_size() / tokens


def requires_grad(node) -> bool:
    """Does the node's value (per its capture-time example) require grad?"""
    value = node.meta.get("example_value") if isinstance(node, fx.Node) else None
    return isinstance(value, torch.Tensor) and value.requires_grad
