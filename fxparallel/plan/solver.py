"""Choose a placement for every value and parameter of the captured graph.

Problem. Each matrix parameter (linear or embedding weight) is split on one of
its dimensions or replicated; every op then runs by one of the strategies its
rule offers, and every mismatch between a value's placement and what its
consumer needs costs a collective. Minimise, lexicographically:

1. bytes of matrix parameters left replicated (tensor parallelism exists to
   split the weights and their FLOPs; a matrix that cannot be split stays
   replicated and the plan says why). A matrix under 1% of its layer's matrix
   bytes (a MoE router [experts, hidden], Qwen2-MoE's [1, hidden] shared-expert
   gate) does not count here: splitting it saves nothing worth a collective, so
   communication alone decides it;
2. bytes communicated per token, forward and backward: a partial sum is charged
   its all-reduce where it is reduced (ops linear in it may carry it there, e.g.
   a MoE block's combine), a shard its all-gather where a consumer needs it
   whole, and a replicated value that requires grad and is used on shards its
   backward all-reduce, once, where the rewrite puts it (slices of one tensor
   read by several layers share the reduction of that tensor).

Search. Parameters of the same layer pattern (``model.layers.*.mlp.up_proj``)
are tied: one decision serves every layer, so the decision variables are the
patterns (about ten for a decoder), not the parameters. The solver walks the
graph in topological order; at the first use of an undecided pattern it
branches over the placements the op's rule allows (depth-first, preferred
first); everywhere else it takes the cheapest strategy given the placements
upstream. A branch is cut as soon as its running cost reaches the best complete
plan found (costs only grow along the walk). Identical layers therefore get
identical decisions by construction, and each explored branch costs one pass
over the remaining nodes: planning time is linear in depth.

Ops without a rule, or whose rule has no strategy for their inputs' placements,
run on replicated inputs: always correct, and recorded as a fallback.
"""
from __future__ import annotations

import logging
import operator
import re
from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.fx as fx

from ..capture.spec import EXAMPLE_BATCH, EXAMPLE_SEQ
from ..capture.graph import CapturedGraph
from .grad_reduction import hoisted_point, reduction_point, whole_segment_region
from .op_traits import SHAPE_QUERIES, op_name
from .placement import R, Placement, is_sharded
from .rules import RuleContext, Strategy, expert_rows, rule_for, tensor_inputs
from .rules.base import LocalOp, requires_block, requires_grad, requires_whole
from .rules.conv import depthwise_conv_reading
from .layout import ShardLayout  # noqa: I001 (kept apart from the imports above to keep merges clean)

log = logging.getLogger("fxparallel")

INFEASIBLE = float("inf")
_LAYER_INDEX = re.compile(r"\.(\d+)(?=\.|$)")  # model.layers.3.mlp, and a layer itself: model.layers.3
MAX_BRANCHES = 100  # complete plans evaluated at most (deterministic: every rank stops at the same one)
# node steps of the search at most, in passes over the graph: branches cut part-way are not complete plans,
# and a graph with many undecided patterns (DeepSeek-V4, HY-V4) could walk them for hours. Past it, each
# open branch point keeps the branch it is on and the walk finishes greedily (deterministic too). 500
# passes left Qwen3.5-MoE at 26 forward collectives where 2000 find 8 (tiny config, TP=2; 31 s to plan,
# DeepSeek-V4 46 s): a plan is made once (the graph cache keeps it), its collectives cost every step
MAX_PASSES = 2000
NEGLIGIBLE_SHARE = 0.01  # a matrix below this share of its layer's matrix bytes is decided by communication


def state_name(argument: str) -> str:
    """The dotted name a cache tensor is planned under: past_3_keys -> past_key_values.3.keys (its
    layer pattern groups the layers, as for parameters)."""
    _, layer, field = argument.split("_", 2)
    return f"past_key_values.{layer}.{field}"


def layer_pattern(name: str) -> str:
    """model.layers.3.mlp.up_proj.weight -> model.layers.*.mlp.up_proj.weight"""
    return _LAYER_INDEX.sub(".*", name)


def redistribute_bytes(src: Placement, dst: Placement, nbytes: float) -> float:
    """Bytes a collective moves to turn ``src`` into ``dst`` (partial sums were charged when made)."""
    if dst is None or src == dst:
        return 0.0
    if dst.is_partial or dst.is_expert_rows:
        return INFEASIBLE
    if src.is_replicate:
        return 0.0  # a local slice
    return nbytes  # partial or expert rows -> all-reduce; shard -> replicate or other shard: all-gather


@dataclass
class GraphPlan:
    """The solver's answer for one graph: a placement per node and the strategy that makes it."""

    placements: dict = field(default_factory=dict)  # fx.Node -> Placement | tuple | None
    strategies: dict = field(default_factory=dict)  # fx.Node -> Strategy (absent: runs as is)
    params: dict = field(default_factory=dict)  # parameter name -> Placement
    reasons: dict = field(default_factory=dict)  # parameter name -> why
    fallbacks: list = field(default_factory=list)  # (op, why) gathered to replicated
    patterns: dict = field(default_factory=dict)  # layer pattern -> Placement (the decisions)
    grad_reduced: set = field(default_factory=set)  # parameters / gathered copies whose grad is all-reduced
    grad_paid: dict = field(default_factory=dict)  # reduction point -> its all-reduce's bytes charged so far
    redistributed: set = field(default_factory=set)  # (partial value, placement) reduced, shared by consumers
    replicated_bytes: float = 0.0
    comm_bytes: float = 0.0
    explored: int = 0  # complete plans evaluated
    layout: Optional[ShardLayout] = None  # how sharded sizes divide among ranks (set by solve)

    @property
    def cost(self):
        return (self.replicated_bytes, self.comm_bytes)

    def copy(self) -> "GraphPlan":
        return GraphPlan(dict(self.placements), dict(self.strategies), dict(self.params), dict(self.reasons),
                         list(self.fallbacks), dict(self.patterns), set(self.grad_reduced), dict(self.grad_paid),
                         set(self.redistributed), self.replicated_bytes, self.comm_bytes, self.explored)


class Solver:
    def __init__(self, captured: CapturedGraph, tp: int, fixed: Optional[dict] = None,
                 layout: Optional[ShardLayout] = None, experts: frozenset = frozenset(), trains: bool = True):
        self.captured = captured
        self.backward_weight = 1.0 if trains else 0.0  # of the gradient reductions' bytes in a plan's cost
        self.tp = tp
        self.fixed = dict(fixed or {})
        self.layout = layout or ShardLayout(tp)
        self.nodes = [n for n in captured.gm.graph.nodes if n.op != "output"]
        self.param_nodes = {}
        for n in self.nodes:
            if n.op == "placeholder" and n.name in captured.params:
                self.param_nodes[n] = captured.params[n.name]
            elif n.op == "placeholder" and n.name in captured.state:  # KV cache: placed like a parameter
                self.param_nodes[n] = state_name(captured.state[n.name])
        self.ctx = RuleContext(tp=tp, tokens=EXAMPLE_BATCH * EXAMPLE_SEQ, layout=self.layout,
                               experts=frozenset(n for n, name in self.param_nodes.items() if name in experts),
                               states=frozenset(n for n in self.param_nodes if n.name in captured.state))
        self.depthwise = depthwise_weights(self.param_nodes)
        # whole experts per rank: every stacked expert weight holds its experts, however small (the expert rows
        # rules need the whole block on the same experts)
        self.negligible = negligible_matrices(self.param_nodes, self.depthwise) - self.ctx.experts
        self.best: Optional[GraphPlan] = None
        self.explored = 0
        self.steps = 0  # nodes walked, over all branches

    # ---- search --------------------------------------------------------------
    def solve(self) -> GraphPlan:
        start = GraphPlan()
        for name, placement in self.fixed.items():
            start.params[name] = placement
            start.patterns[layer_pattern(name)] = placement
        self._walk(0, start)
        plan = self.best
        for node, name in self.param_nodes.items():
            if name not in plan.params:
                plan.params[name] = plan.patterns.get(layer_pattern(name), R)
            plan.placements[node] = plan.params[name]
        plan.explored = self.explored
        log.debug("solver: %d complete plans, %.1f passes over %d nodes", self.explored,
                  self.steps / max(1, len(self.nodes)), len(self.nodes))
        plan.layout = self.layout
        return plan

    def _over_budget(self) -> bool:
        return self.steps >= MAX_PASSES * len(self.nodes)

    def _walk(self, i: int, plan: GraphPlan) -> None:
        while i < len(self.nodes):
            node = self.nodes[i]
            self.steps += 1
            options = self._options(node, plan)
            if options is None:  # handled in place (placeholders, replicated fast path)
                i += 1
                continue
            branches = self._branches(options)
            if len(branches) > 1 and self.explored < MAX_BRANCHES and not self._over_budget():
                for n, (key, strategy) in enumerate(branches):
                    if n and self.best is not None and self._over_budget():
                        break
                    child = plan.copy()
                    self._apply(node, strategy, key, child)
                    if self.best is None or child.cost < self.best.cost:
                        self._walk(i + 1, child)
                return
            key, strategy = options[0]
            self._apply(node, strategy, key, plan)
            if self.best is not None and plan.cost >= self.best.cost:
                return
            i += 1
        self._charge_unpaid_reductions(plan)
        self.explored += 1
        if self.best is None or plan.cost < self.best.cost:
            self.best = plan

    def _charge_unpaid_reductions(self, plan: GraphPlan) -> None:
        """A complete plan pays what the uses of a shared gradient reduction left unpaid (``_grad_share``): the
        slices of a tensor used on shards by some layers only still reduce the whole tensor. Charged at the end,
        the walk's running cost stays a lower bound."""
        unpaid = sum(max(0.0, self.ctx.bytes_per_token(point) - paid) for point, paid in plan.grad_paid.items())
        plan.comm_bytes += unpaid * self.backward_weight

    def _branches(self, options):
        """Best option per distinct decision on undecided matrix patterns."""
        seen = {}
        for key, strategy in options:
            decision = key[3]
            if decision and decision not in seen:
                seen[decision] = (key, strategy)
        return list(seen.values()) if len(seen) > 1 else []

    # ---- one node ------------------------------------------------------------
    def _options(self, node, plan: GraphPlan):
        if node.op == "placeholder":
            name = self.param_nodes.get(node)
            if name is not None:
                decided = plan.params.get(name) or plan.patterns.get(layer_pattern(name))
                plan.placements[node] = decided or R
            else:
                plan.placements[node] = R if isinstance(node.meta.get("example_value"), torch.Tensor) else None
            return None
        value = node.meta.get("example_value")
        if node.op == "call_function" and node.target is operator.getitem and isinstance(
            plan.placements.get(node.args[0]), tuple
        ):
            plan.placements[node] = plan.placements[node.args[0]][node.args[1]]
            return None
        ins = tensor_inputs(node)
        undecided = [i for i in ins if i in self.param_nodes and not self._decided(i, plan)]
        in_pl = {i: (self._placement_of_param(i, plan) or R) if i in self.param_nodes else plan.placements.get(i, R)
                 for i in ins}
        if not undecided and all(p is None or p.is_replicate for p in in_pl.values()):
            for i in ins:  # a parameter whole by its layer pattern, read whole here: it stays whole (a later reader
                # that wants a shard slices it; recording that shard instead would split what this op read whole:
                # DeepSeek-V2's latent cache, written whole, then read by a row-parallel kv_b_proj)
                if i in self.param_nodes:
                    plan.params.setdefault(self.param_nodes[i], R)
            plan.placements[node] = _replicated_like(value)
            return None
        if not _has_tensor(value) and op_name(node) != "setitem":  # setitem returns nothing but writes a tensor
            return [((0.0, 0.0, 0, ()), self._non_tensor(node, plan, ins, in_pl))]
        rule = rule_for(node)
        if any(p is not None and p.is_expert_rows for p in in_pl.values()):  # only rows-aware strategies
            rule = expert_rows.strategies
        self.ctx.placed = plan.placements.get  # this branch's placements, for rules that look ahead
        self.ctx.undecided = frozenset(undecided)
        strategies = rule(node, in_pl, self.ctx) if rule else []
        if not getattr(rule, "handles_blocks", False):  # a rule unaware of blocked shards must not get one
            strategies = [s for s in strategies if not requires_block(s)]
        if not getattr(rule, "handles_whole", False):  # nor of whole segments
            strategies = [s for s in strategies if not requires_whole(s)]
        options = []
        for index, s in enumerate(strategies):
            key = self._cost(s, plan, in_pl, index, node)
            if key is not None:
                options.append((key, s))
        if not options:
            s = Strategy({i: R for i in ins}, R, note="no sharding rule: inputs gathered", name="fallback")
            options = [(self._cost(s, plan, in_pl, 0, node), s)]
        options.sort(key=lambda o: o[0][:3])
        return options

    def _decided(self, param_node, plan) -> bool:
        name = self.param_nodes[param_node]
        return name in plan.params or layer_pattern(name) in plan.patterns

    def _placement_of_param(self, param_node, plan):
        name = self.param_nodes[param_node]
        return plan.params.get(name) or plan.patterns.get(layer_pattern(name))

    def _non_tensor(self, node, plan, ins, in_pl) -> Strategy:
        """Size queries read only shapes; anything else (item(), ...) reads data and needs it whole. ``x.size()``
        of a shard whose sharded dim is static is answered full (``ops/shapes.py``). ``x.size(d)`` of the sharded
        dim, or of a symbolic one (a sequence shard), needs the value whole: Dynamo folds a static ``x.size(d)``
        into a constant, so a query left in the graph is of a symbolic size."""
        shape_only, local = op_name(node) in SHAPE_QUERIES, None
        if shape_only and node.target == "size":
            x = node.args[0]
            p = in_pl.get(x)
            if p is not None and p.is_shard:
                shape = x.meta["example_value"].shape
                dim = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim")
                if dim is None:
                    shape_only = isinstance(shape[p.dim], int)
                    local = LocalOp.of("full_shape") if shape_only else None
                elif not isinstance(dim, int) or dim % len(shape) == p.dim:
                    shape_only = False
        if shape_only:
            return Strategy({i: None for i in ins}, None, name="shape", local=local)
        return Strategy({i: R for i in ins}, _replicated_like(node.meta.get("example_value")),
                        note="reads a sharded value as a whole: gathered", name="fallback")

    def _cost(self, s: Strategy, plan, in_pl, index, node):
        """(replicated matrix bytes, communication bytes, preference, decision) of a strategy, or None."""
        replicated = 0.0
        # a strategy that leaves a partial sum communicates nothing yet: its reduction is charged where it happens
        comm = 0.0 if _partial_output(s.output) else s.own_bytes
        decision = []
        out_sharded = is_sharded(s.output)
        for i, req in s.inputs.items():
            if req is None:
                continue
            if i in self.param_nodes:
                fake = i.meta["example_value"]
                current = self._placement_of_param(i, plan)
                if current is not None:
                    if current.is_replicate and req.is_shard:
                        # a whole weight read by shards: sliced locally (free), its gradient then partial: reduced
                        if fake.requires_grad and i not in plan.grad_reduced:
                            comm += self._grad_bytes(i) * self.backward_weight
                    elif current != req:
                        if s.name != "fallback":
                            return None
                        # an op without a rule reads a weight already split: gather it
                        comm += redistribute_bytes(current, req, self._grad_bytes(i))
                else:
                    if req.is_replicate and fake.dim() >= 2 and i not in self.negligible:
                        replicated += fake.numel() * fake.element_size()
                    if fake.dim() >= 2:
                        decision.append((layer_pattern(self.param_nodes[i]), req))
                if req.is_replicate and out_sharded and fake.requires_grad and i not in plan.grad_reduced:
                    comm += self._grad_bytes(i) * self.backward_weight
                continue
            cost = redistribute_bytes(in_pl[i], req, self.ctx.bytes_per_token(i))
            if cost == INFEASIBLE:
                return None
            if (i, req) not in plan.redistributed:  # the rewriter reduces each partial sum once per placement
                comm += cost
            if in_pl[i] is not None and in_pl[i].is_replicate and (out_sharded or (req is not None and req.is_shard)):
                if requires_grad(i):
                    comm += self._grad_share(i, plan)[1] * self.backward_weight
            elif _made_whole_for_shards(in_pl[i], req, out_sharded) and requires_grad(i) \
                    and (i, R) not in plan.grad_reduced:
                # the gathered / reduced copy's gradient is partial: all-reduced
                comm += self.ctx.bytes_per_token(i) * self.backward_weight
        return (replicated, comm, index, tuple(sorted(decision)))

    def _grad_share(self, value, plan: GraphPlan):
        """(point, bytes per token) of the gradient all-reduce of a replicated ``value`` used on shards that this
        use is charged: the reduction runs once, at the point the rewrite hoists it to (a reduction hoisted onto a
        smaller tensor, a MoE block's rows ``x[perm // top_k]`` reduced as ``x``, costs the smaller). Where that
        point has several users, each use pays at most what reducing its own value would cost, until the point's
        reduction is paid, and a complete plan pays what is left (``_charge_unpaid_reductions``): layers reading
        slices of one tensor (Gemma's per-layer inputs) share its reduction. Charged all to the first layer, it
        made gathering the layer's own shard look cheaper to the greedy walk. A whole segment's gradient is
        summed at its weight, and so is the gradient of a value made only from whole segments
        (``whole_segment_region``): point None, nothing charged."""
        def replicated(n):
            return isinstance(plan.placements.get(n), Placement) and plan.placements[n].is_replicate

        point = hoisted_point(value, replicated)
        if whole_segment_region(value, replicated, lambda n: _whole_segment(n, plan)) is not None:
            return None, 0.0
        left = self.ctx.bytes_per_token(point) - plan.grad_paid.get(point, 0.0)
        if len(point.users) > 1:  # one reduction for several uses: each pays at most what its own value would
            left = min(left, self.ctx.bytes_per_token(reduction_point(value, replicated)))
        return point, max(0.0, left)

    def _grad_bytes(self, param_node) -> float:
        fake = param_node.meta["example_value"]
        return fake.numel() * fake.element_size() / self.ctx.tokens

    def _reason(self, param_node, s: Strategy, req: Placement) -> str:
        reason = s.note or ("replicated" if req.is_replicate else "sharded")
        if req.is_replicate and param_node in self.negligible:
            small = "a depthwise convolution weight" if param_node in self.depthwise \
                else f"under {NEGLIGIBLE_SHARE:.0%} of its layer"
            reason += f" ({small}: chosen by communication)"
        return reason

    def _apply(self, node, s: Strategy, key, plan: GraphPlan) -> None:
        plan.replicated_bytes += key[0]
        plan.comm_bytes += key[1]
        out_sharded = is_sharded(s.output)
        for i, req in s.inputs.items():
            if req is None:
                continue
            if i in self.param_nodes:
                name = self.param_nodes[i]
                if name not in plan.params:
                    plan.params[name] = req
                    plan.placements[i] = req
                    plan.reasons[name] = self._reason(i, s, req)
                    if i.meta["example_value"].dim() >= 2:
                        plan.patterns.setdefault(layer_pattern(name), req)
                elif name not in plan.reasons and plan.params[name] == req:  # fixed beforehand: why it fits
                    plan.reasons[name] = self._reason(i, s, req)
            cur = plan.placements.get(i)
            if isinstance(cur, Placement) and cur.is_partial and cur != req:
                plan.redistributed.add((i, req))
            if cur is not None and cur.is_replicate and (out_sharded or req.is_shard) and requires_grad(i):
                if i in self.param_nodes:
                    plan.grad_reduced.add(i)
                else:
                    point, share = self._grad_share(i, plan)
                    if point is not None:
                        plan.grad_paid[point] = plan.grad_paid.get(point, 0.0) + share
            elif _made_whole_for_shards(cur, req, out_sharded) and requires_grad(i) and i not in self.param_nodes:
                plan.grad_reduced.add((i, R))
        if s.name == "fallback" and any(
            p is not None and not p.is_replicate for p in (plan.placements.get(i) for i in s.inputs)
        ):
            plan.fallbacks.append((describe(node), s.note or "no sharding rule: inputs gathered"))
        plan.strategies[node] = s
        plan.placements[node] = s.output


def _whole_segment(node, plan: GraphPlan) -> bool:
    """Is ``node`` a whole segment taken out of a fused projection (``fused[..., a:b]`` or a split's
    item)? Its gradient may stay partial: the rewrite sums it at the weight, not per token."""
    if node.op != "call_function" or node.target is not operator.getitem:
        return False
    source = node.args[0]
    if isinstance(plan.placements.get(source), tuple):
        source = source.args[0]
    p = plan.placements.get(source)
    return isinstance(p, Placement) and bool(p.whole)


def depthwise_weights(param_nodes: dict) -> frozenset:
    """The parameters a depthwise convolution reads as its weight (``[channels, 1, kernel]``: no matmul)."""
    return frozenset(node for node in param_nodes if depthwise_conv_reading(node) is not None)


def negligible_matrices(param_nodes: dict, depthwise: frozenset) -> set:
    """Matrix parameters that communication alone decides: those under NEGLIGIBLE_SHARE of the matrix bytes of
    their layer (same layer index), and the ``depthwise`` convolution weights."""
    totals, sizes = {}, {}
    for node, name in param_nodes.items():
        fake = node.meta["example_value"]
        if fake.dim() < 2 or node in depthwise:
            continue
        match = _LAYER_INDEX.search(name)
        layer = name[:match.end()] if match else ""
        sizes[node] = (layer, fake.numel() * fake.element_size())
        totals[layer] = totals.get(layer, 0) + sizes[node][1]
    small = {node for node, (layer, nbytes) in sizes.items() if nbytes < NEGLIGIBLE_SHARE * totals[layer]}
    return set(depthwise) | small


def _made_whole_for_shards(current, required, out_sharded: bool) -> bool:
    """Is a sharded or partial value gathered / all-reduced for an op whose output is sharded?
    The rewrite all-reduces the gradient of that whole copy (``copy_to_tp``), as for any
    replicated value used on shards."""
    return isinstance(current, Placement) and not current.is_replicate and required is not None \
        and required.is_replicate and out_sharded


def _partial_output(output) -> bool:
    return isinstance(output, Placement) and output.is_partial


def _has_tensor(value) -> bool:
    if isinstance(value, torch.Tensor):
        return True
    return isinstance(value, (tuple, list)) and any(isinstance(v, torch.Tensor) for v in value)


def _replicated_like(value):
    if isinstance(value, torch.Tensor):
        return R
    if isinstance(value, (tuple, list)) and any(isinstance(v, torch.Tensor) for v in value):
        return tuple(R if isinstance(v, torch.Tensor) else None for v in value)
    return None


def describe(node: fx.Node) -> str:
    target = node.target if isinstance(node.target, str) else getattr(node.target, "__name__", str(node.target))
    stack = node.meta.get("stack_trace") or ""
    lines = [ln.strip() for ln in stack.strip().splitlines() if ln.strip().startswith("File")]
    where = lines[-1] if lines else ""
    return f"{target} ({node.name}{'; ' + where if where else ''})"


def check_layer_symmetry(params: dict) -> list:
    """Parameters of the same layer pattern with different placements (should be none)."""
    seen, broken = {}, []
    for name, placement in params.items():
        pat = layer_pattern(name)
        if pat in seen and seen[pat] != placement:
            broken.append(pat)
        seen.setdefault(pat, placement)
    return sorted(set(broken))


def solve(captured: CapturedGraph, tp: int, fixed: Optional[dict] = None,
          layout: Optional[ShardLayout] = None, experts: frozenset = frozenset(), trains: bool = True) -> GraphPlan:
    """``experts``: the names of the parameters stacked by expert, with expert parallelism (rules/expert_rows.py).
    ``trains=False``: a graph that serves generation (a KV cache's): its plan still reduces every gradient, but
    the reductions of the backward it does not run cost nothing in the choice."""
    return Solver(captured, tp, fixed, layout, experts, trains).solve()
