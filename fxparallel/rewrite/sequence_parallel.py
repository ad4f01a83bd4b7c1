"""Sequence parallelism: keep activations between attention and MLP sharded along the sequence.

Runs on the local graph after the tensor-parallel passes (``rewrite/passes.py``), before
inputs are bound. In plain TP each row-parallel output (and the vocab-parallel embedding)
is all-reduced, and the replicated result feeds token-wise ops (residual adds, norms,
dropout) and then, through a ``copy_to_tp`` (backward all-reduce), the next column layers.
Here:

* each such forward ``all_reduce`` of a [.., batch, seq, ..] activation becomes a
  ``reduce_scatter_seq`` (this rank keeps seq / tp tokens);
* the shard flows through the ops that are verified token-wise from the graph (op by op, the ops
  named in ``plan/op_traits.py``:
  elementwise with operands that do not vary along the sequence, reductions and norms
  over other dims, dropout (its mask: this rank's tokens of the logical one,
  ``ops/dropout_kernels.py``), slices, views that keep or merge batch and sequence, and ``linear`` whose
  weights are whole on every rank: a LoRA adapter's A on a column-parallel layer, B on a row-parallel one);
* where it reaches a ``copy_to_tp``, that op becomes ``gather_seq_to_tp`` (all-gather
  forward, reduce-scatter backward: the reduce-scatter replaces the all-reduce);
* ``x.size()`` of a shard is the full size (computed, no communication), so the graph's
  shape arithmetic and views stay in full sizes; views divide their sequence entry.

Replicated parameters used on shards (norm weights and biases, biases of row layers, those adapter matrices) get
partial gradients (only this rank's tokens): their gradient is all-reduced (a
``copy_to_tp`` on the parameter, as TP does for Qwen3's q/k norms). An activation rather than
a parameter gets it where the parameters behind it are shared with other uses.

Any other consumer of a shard would need an all-gather whose gradient is a plain slice,
i.e. one collective more than plain TP. So a connected group of shards (a *region*) that
reaches one stays plain TP: its all-reduces are kept and the reason is recorded. The
communication of the result is plain TP's, call for call (reduce-scatter + all-gather =
all-reduce in a ring), by construction.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.fx as fx

from ..errors import ShardingError
from ..plan import op_traits
from ..plan.op_traits import op_name
from ..plan.rules.base import arg, norm_dim, requires_grad
from ..ops import collectives
from ..ops.dropout_kernels import logical_dropout
from .dropout_masks import add_cut
from .fx_nodes import same_size
from .gradient_reductions import insert_copy_to_tp



@dataclass(frozen=True)
class TokenDim:
    """Where a shard's tokens are: ``dim`` holds the sequence, or (``flat``) batch x sequence."""

    dim: int
    flat: bool = False


@dataclass
class SequenceParallelReport:
    regions: int  # regions turned sequence-parallel
    kept: list  # ["where: reason"] regions left plain TP
    reduced: list  # values (parameters) whose gradient is now all-reduced


def _key(node: fx.Node):
    """What a call node runs: a function, or a method name."""
    return node.target if node.op in ("call_function", "call_method") else None


def _value(node):
    v = node.meta.get("example_value") if isinstance(node, fx.Node) else None
    return v if isinstance(v, torch.Tensor) else None


class _Pass:
    def __init__(self, graph: fx.Graph, captured, group, placements: dict):
        self.graph, self.group, self.tp, self.placements = graph, group, group.size, placements
        seq = batch = None
        for sym, (name, dim) in captured.symbol_sources.items():
            if name == "input_ids" and dim == 1:
                seq = sym
            if name == "input_ids" and dim == 0:
                batch = sym
        if seq is None:
            raise ShardingError("sequence parallelism needs a sequence length of at least 2 (the graph was "
                                "captured for a sequence of 1)")
        self.seq = seq
        ids = next((n for n in graph.nodes if n.op == "placeholder" and captured.inputs.get(n.name) == "input_ids"),
                   None)
        example = _value(ids) if ids is not None else None
        self.batch = batch if batch is not None else (int(example.shape[0]) if example is not None else None)
        self.ids = ids
        self._batch_node = None

    # ---- where the tokens are ----------------------------------------------------------------
    def _is_seq(self, size) -> bool:
        return same_size(size, self.seq)

    def _is_flat(self, size) -> bool:
        return self.batch is not None and same_size(size, self.batch * self.seq)

    def _tok(self, dim: int, flat: bool) -> TokenDim:
        """With a batch of 1, batch x sequence is the sequence: keep one spelling."""
        return TokenDim(dim, flat and self.batch != 1)

    def _is_batch(self, size) -> bool:
        return self.batch is not None and same_size(size, self.batch)

    def seed_dim(self, node) -> Optional[TokenDim]:
        v = _value(node)
        if v is None:
            return None
        seq = [d for d, s in enumerate(v.shape) if self._is_seq(s)]
        flat = [d for d, s in enumerate(v.shape) if self._is_flat(s)] if self.batch != 1 else []
        if len(seq) == 1 and not flat:
            return TokenDim(seq[0])
        if len(flat) == 1 and not seq:
            return TokenDim(flat[0], True)
        return None

    def _holds(self, node, t: TokenDim) -> bool:
        v = _value(node)
        if v is None or t.dim >= v.dim():
            return False
        return self._is_flat(v.shape[t.dim]) if t.flat else self._is_seq(v.shape[t.dim])

    # ---- token-wise rules: the output's TokenDim, or a reason ----------------------------------
    def out_dim(self, node: fx.Node, dims: dict):
        key, name = _key(node), op_name(node)
        sharded = [n for n in node.all_input_nodes if n in dims]
        first = sharded[0]
        if name in op_traits.TOKEN_WISE or key is logical_dropout or \
                (name == "dropout" and self._identity_dropout(node)):
            return self._elementwise(node, dims, sharded)
        if name in op_traits.TOKEN_WISE_REDUCTIONS and node.all_input_nodes[0] is first and len(sharded) == 1:
            return self._reduction(node, dims[first])
        if name in op_traits.NORMALIZED_SHAPE_ARG and node.all_input_nodes[0] is first and len(sharded) == 1:
            shape = arg(node, op_traits.NORMALIZED_SHAPE_ARG[name], "normalized_shape")
            t = dims[first]
            count = len(shape) if isinstance(shape, (tuple, list, torch.Size)) else 1
            if count >= _value(first).dim() - t.dim:
                return "normalizes over the sequence"
            return self._checked(node, t, "norm")
        if name in op_traits.SIZED_VIEWS and node.args[0] is first and len(sharded) == 1:
            return self._view(node, first, dims[first])
        if name in op_traits.TOKEN_WISE_PRODUCTS and node.args[0] is first and len(sharded) == 1:
            return self._product(node, dims[first])
        if name == "getitem" and node.args[0] is first and len(sharded) == 1:
            return self._getitem(node, dims[first])
        return f"{getattr(key, '__name__', key)} is not known to be token-wise"

    def _checked(self, node, t: TokenDim, what: str):
        return t if self._holds(node, t) else f"{what}: output does not keep the token dim"

    @staticmethod
    def _identity_dropout(node) -> bool:
        p = arg(node, 1, "p", 0.5)
        training = arg(node, 2, "training", True)
        return training is False or p == 0

    def _elementwise(self, node, dims, sharded):
        out = _value(node)
        if out is None:
            return "output is not a tensor"
        kinds = {dims[n].flat for n in sharded}
        rights = {_value(n).dim() - dims[n].dim for n in sharded}
        if len(kinds) != 1 or len(rights) != 1:
            return "operands sharded along different dims"
        t = TokenDim(out.dim() - rights.pop(), kinds.pop())
        for other in node.all_input_nodes:
            v = _value(other)
            if other in dims or v is None:
                continue
            pos = v.dim() - (out.dim() - t.dim)
            if 0 <= pos < v.dim() and not same_size(v.shape[pos], 1):
                return f"operand {other.name} varies along the sequence"
        return self._checked(node, t, "elementwise")

    def _product(self, node, t: TokenDim):
        """``linear(x, weight, bias)`` of a shard: its tokens' rows, where every weight is whole on every rank."""
        if t.dim == _value(node.args[0]).dim() - 1:
            return "linear contracts the sequence"
        for weight in node.all_input_nodes[1:]:
            placement = self.placements.get(weight)
            if not (hasattr(placement, "is_replicate") and placement.is_replicate):
                return f"linear of weight {weight.name} split across ranks"
        return self._checked(node, t, "linear")

    def _reduction(self, node, t: TokenDim):
        src = _value(node.args[0])
        dim = arg(node, 1, "dim")
        keepdim = arg(node, 2, "keepdim", False)
        if dim is None:
            return "reduces over every dim"
        dims = [norm_dim(d, src.dim()) for d in (dim if isinstance(dim, (tuple, list)) else [dim])]
        if t.dim in dims:
            return "reduces over the sequence"
        out = t if keepdim else TokenDim(t.dim - sum(d < t.dim for d in dims), t.flat)
        return self._checked(node, out, "reduction")

    def _view(self, node, src_node, t: TokenDim):
        src, out = _value(src_node), _value(node)
        if out is None:
            return "view output is not a tensor"
        prefix = list(src.shape[:t.dim])
        # keeps the tokens where they are: [.., T, rest] -> [.., T, rest']
        if self._holds(node, t) and _same_dims(prefix, out.shape[:t.dim]):
            return t
        # merges batch and sequence: [.., B, S, rest] -> [.., B*S, rest']
        if not t.flat and t.dim >= 1 and self._is_batch(src.shape[t.dim - 1]) and out.dim() > t.dim - 1 and \
                self._is_flat(out.shape[t.dim - 1]) and _same_dims(prefix[:-1], out.shape[:t.dim - 1]):
            return self._tok(t.dim - 1, True)
        # splits them again: [.., B*S, rest] -> [.., B, S, rest']
        if (t.flat or self.batch == 1) and out.dim() > t.dim + 1 and self._is_batch(out.shape[t.dim]) and \
                self._is_seq(out.shape[t.dim + 1]) and _same_dims(prefix, out.shape[:t.dim]):
            return TokenDim(t.dim + 1)
        return "view moves data across tokens"

    def _getitem(self, node, t: TokenDim):
        index = node.args[1]
        index = index if isinstance(index, tuple) else (index,)
        if any(not (isinstance(i, slice) or i is Ellipsis) for i in index) or sum(i is Ellipsis for i in index) > 1:
            return "indexing other than slices"
        ndim = _value(node.args[0]).dim()
        if Ellipsis in index:
            at = index.index(Ellipsis)
            index = index[:at] + (slice(None),) * (ndim - len(index) + 1) + index[at + 1:]
        if t.dim < len(index):
            s = index[t.dim]
            if s.start not in (None, 0) or s.stop is not None or s.step not in (None, 1):
                return "slices the sequence"
        return self._checked(node, t, "slice")

    # ---- planning ----------------------------------------------------------------------------
    def propagate(self, seeds: dict):
        """Token dims of every shard reachable from ``seeds``; regions; gathers that would be needed."""
        dims, region, parent = {}, {}, {}

        def find(r):
            while parent[r] != r:
                parent[r] = parent[parent[r]]
                r = parent[r]
            return r

        blocked = []  # (region root, consumer, reason)
        for node in self.graph.nodes:
            if node in seeds:
                dims[node], region[node], parent[node] = seeds[node], node, node
                continue
            if node.op not in ("call_function", "call_method"):
                continue
            sharded = [n for n in node.all_input_nodes if n in dims]
            if not sharded:
                continue
            roots = {find(region[n]) for n in sharded}
            root = roots.pop()
            for r in roots:
                parent[r] = root
            if node.target is collectives.copy_to_tp:
                continue  # becomes gather_seq_to_tp
            if op_name(node) == "size" and len(sharded) == 1 and node.args[0] is sharded[0]:
                continue  # full size, computed
            result = self.out_dim(node, dims)
            if isinstance(result, TokenDim):
                dims[node], region[node] = result, root
            else:
                blocked.append((root, node, result))
        for node in self.graph.nodes:
            if node.op == "output":
                for n in node.all_input_nodes:
                    if n in dims:
                        blocked.append((find(region[n]), node, "graph output"))
        bad = {}
        for root, node, reason in blocked:
            bad.setdefault(find(root), (node, reason))
        regions = {find(r) for r in region.values()}
        return dims, {n: find(r) for n, r in region.items()}, regions, bad

    def plan(self):
        seeds = {}
        for node in self.graph.nodes:
            if node.op == "call_function" and node.target is collectives.all_reduce:
                t = self.seed_dim(node)
                if t is not None:
                    seeds[node] = t
        kept = []
        while True:
            dims, region, regions, bad = self.propagate(seeds)
            if not bad:
                return dims, seeds, len(regions), kept
            for root, (node, reason) in bad.items():
                members = [s for s in seeds if region.get(s) == root]
                kept.append(f"{_where(members[0].args[0])} .. {_where(node)}: {node.name} ({reason}); "
                            f"{len(members)} all-reduce(s) kept")
                for s in members:
                    del seeds[s]

    # ---- rewriting ---------------------------------------------------------------------------
    def batch_arg(self, t: TokenDim):
        """The batch size as the graph knows it (a constant, or read from input_ids)."""
        if not t.flat:
            return None
        if isinstance(self.batch, int):
            return self.batch
        if self._batch_node is None:
            last = [n for n in self.graph.nodes if n.op == "placeholder"][-1]
            with self.graph.inserting_after(last):
                self._batch_node = self.graph.call_function(torch.ops.aten.sym_size.int, (self.ids, 0))
        return self._batch_node

    def rewrite(self, dims: dict, seeds: dict) -> list:
        g, handle = self.graph, self.group.handle
        for node, t in seeds.items():
            with g.inserting_before(node):
                rs = g.call_function(collectives.reduce_scatter_seq, (node.args[0], t.dim, handle, self.batch_arg(t)))
            rs.meta["example_value"] = node.meta.get("example_value")
            node.replace_all_uses_with(rs)
            g.erase_node(node)
            dims[rs] = dims.pop(node)
        partial = {}  # replicated value -> consumers on shards
        for node in list(g.nodes):
            if node in dims:
                if node.target is collectives.reduce_scatter_seq:
                    continue  # its input is the partial sum, not a replicated value
                if op_name(node) in op_traits.SIZED_VIEWS:
                    self._local_view(node, dims[node])
                if _key(node) is logical_dropout:  # this rank's tokens of the logical mask
                    t = dims[node]
                    add_cut(node, ("even", t.dim, self.tp, self.group.rank, self.batch_arg(t)))
                for other in node.all_input_nodes:
                    if other not in dims and _value(other) is not None and requires_grad(other):
                        partial.setdefault(other, []).append(node)
                continue
            shard = next((n for n in node.all_input_nodes if n in dims), None)
            if shard is None:
                continue
            t = dims[shard]
            if node.target is collectives.copy_to_tp:
                with g.inserting_before(node):
                    gathered = g.call_function(collectives.gather_seq_to_tp, (shard, t.dim, handle, self.batch_arg(t)))
                gathered.meta["example_value"] = node.meta.get("example_value")
                node.replace_all_uses_with(gathered)
                g.erase_node(node)
            elif op_name(node) == "size":
                index = tuple(node.args[1:]) + ((node.kwargs["dim"],) if "dim" in node.kwargs else ())
                node.target, node.op = full_size, "call_function"
                node.args, node.kwargs = (shard, t.dim, self.tp, t.flat, *index), {}
        return self._reduce_partial_gradients(partial)

    def _local_view(self, node, t: TokenDim):
        method = node.target if isinstance(node.target, str) else "reshape"
        shape = node.args[1] if len(node.args) == 2 else tuple(node.args[1:])
        node.op, node.target = "call_function", local_view
        node.args, node.kwargs = (node.args[0], method, shape, t.dim, self.tp), {}

    def _reduce_partial_gradients(self, partial: dict) -> list:
        """Each rank sums the gradient over its tokens only: all-reduce it, as close to the
        parameters as the graph allows (a parameter's gradient is a fixed size per step)."""
        g, handle = self.graph, self.group.handle
        order = {n: i for i, n in enumerate(g.nodes)}
        reduced, pending = [], set(partial)
        while pending:  # consumers before producers: every use of a value is known when it is reached
            value = max(pending, key=order.get)
            pending.remove(value)
            users = partial[value]
            inputs = value.all_input_nodes
            movable = (value.op in ("call_function", "call_method")
                       and value.target not in collectives.COLLECTIVE_OPS
                       and set(value.users) <= set(users)
                       and all(_value(n) is not None or not isinstance(n.meta.get("example_value"), (tuple, list))
                               for n in inputs))
            if movable:
                for n in inputs:
                    if _value(n) is not None and requires_grad(n):
                        partial.setdefault(n, []).append(value)
                        pending.add(n)
                continue
            insert_copy_to_tp(g, value, users, handle)
            reduced.append(value)
        return reduced


def _same_dims(a, b) -> bool:
    return len(a) == len(b) and all(same_size(x, y) for x, y in zip(a, b))


def _where(node) -> str:
    from ..capture.graph import module_path
    from ..plan.solver import layer_pattern

    return layer_pattern(module_path(node))


def full_size(x: torch.Tensor, dim: int, tp: int, flat: bool, *index):
    """``x.size(*index)`` of the whole (unsharded) value: the token dim times tp."""
    size = list(x.shape)
    size[dim] *= tp
    size = torch.Size(size)
    return size[index[0]] if index else size


def local_view(x: torch.Tensor, method: str, shape, dim: int, tp: int):
    """``x.view(shape)`` where ``shape`` is in full sizes: its token entry ``dim`` is divided by tp."""
    shape = list(shape)
    if shape[dim] != -1:
        shape[dim] //= tp
    return getattr(x, method)(shape)


def apply_sequence_parallel(graph: fx.Graph, captured, group, placements: dict) -> SequenceParallelReport:
    """Rewrite ``graph`` (after the TP passes, before binding inputs) to sequence parallelism (``placements``:
    the plan's, node -> Placement)."""
    sp = _Pass(graph, captured, group, placements)
    dims, seeds, regions, kept = sp.plan()
    reduced = sp.rewrite(dims, seeds) if seeds else []
    return SequenceParallelReport(regions=regions if seeds else 0, kept=kept, reduced=reduced)
