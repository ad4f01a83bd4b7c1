"""Stage 4, the report: the ShardingPlan (data) derived from the solver's plan and the final,
rewritten graph: every parameter's placement and why, every collective with its bytes."""
from __future__ import annotations

from collections import OrderedDict

import torch

from .capture import adapters
from .capture.graph import module_path
from .plan.layout import uneven_split
from .plan.placement import R, Placement
from .plan.plan import UNUSED, CollectivePlan, ParamPlan, ShardingPlan
from .plan.rules.base import bytes_per_token
from .plan.solver import layer_pattern
from .ops import collectives
from .ops.vocab_parallel import vocab_parallel_cross_entropy
from .rewrite.passes import PassContext

def _inserted(node) -> bool:
    """Was ``node`` put in by the rewrite (a collective, a local slice)? Those carry no module stack: the
    captured graph's own nodes all do (the causal LM's own ops with its root module only)."""
    return node.op == "call_function" and "nn_module_stack" not in node.meta


def _gradient_consumers(node, passed_up: set):
    """The ops whose input gradient a copy_to_tp reduces (through values it was passed up from, and through
    the ops the rewrite put in, such as the slice of a rank's heads out of k and v gathered whole)."""
    for user in node.users:
        if user in passed_up or _inserted(user):
            yield from _gradient_consumers(user, passed_up)
        else:
            yield user


def _where(node, direction: str, passed_up: set) -> str:
    """Name the module whose value a collective acts on, as a layer pattern: for the backward
    collective of a value used on shards the modules that consume it, otherwise the module
    that produced it."""
    if node.target in (collectives.copy_to_tp, collectives.sum_grad_rows) or (
            direction == "backward" and node.target in collectives.GRADIENT_OF_CONSUMERS):
        values = _sources(node)
        if values[0].op in ("placeholder", "get_attr"):
            names = ", ".join(dict.fromkeys(layer_pattern(str(v.target)) for v in values))
            return f"gradient of parameter{'s' if len(values) > 1 else ''} {names}"
        users = sorted({layer_pattern(adapters.hf_path(module_path(u))) for u in _gradient_consumers(node, passed_up)})
        return "gradient of the input of " + ", ".join(users)
    source = _sources(node)[0] if node.args else node
    source = source if hasattr(source, "meta") else node
    while source is not None and source.op == "call_function" and source.target in (
        collectives.COLLECTIVE_OPS + (collectives.local_chunk,)
    ):
        source = _sources(source)[0]
    if source is not None and source.op in ("placeholder", "get_attr"):
        return f"parameter {layer_pattern(str(source.target))}"
    return layer_pattern(adapters.hf_path(module_path(source)))


def _sources(node) -> tuple:
    """The values a collective acts on: its first argument, or each of them (``all_reduce_many``, the base
    layer's value first)."""
    first = node.args[0]
    return tuple(first) if isinstance(first, (tuple, list)) else (first,)


def collect_collectives(graph, tokens: int, tp: int, passed_up: set = frozenset()) -> list:
    counts: "OrderedDict[tuple, int]" = OrderedDict()
    for node in graph.nodes:
        if node.op != "call_function":
            continue
        fn = node.target
        if fn is vocab_parallel_cross_entropy:
            key = ("all_gather", "forward", "vocab-parallel cross-entropy statistics", 8.0 * tp, 0.0)
            counts[key] = counts.get(key, 0) + 1
            continue
        if fn not in collectives.COLLECTIVE_OPS:
            continue
        source, *others = _sources(node)
        if source.op in ("placeholder", "get_attr"):  # parameters: fixed size per call
            value = source.meta["example_value"]
            per_token = 0.0
            per_call = float(sum(v.numel() * v.element_size() for v in (value, *(o.meta["example_value"]
                                                                              for o in others))))
            if fn is collectives.sum_grad_rows:  # only the rows of its whole segments
                dim, ranges = node.args[1], node.args[2]
                per_call *= sum(stop - start for start, stop in ranges) / value.shape[dim]
        else:
            per_token, per_call = sum(bytes_per_token(s, tokens) for s in (source, *others)), 0.0
        for direction, kind in (("forward", fn.FORWARD), ("backward", fn.BACKWARD)):
            if kind:
                key = (kind, direction, _where(node, direction, passed_up), per_token, per_call)
                counts[key] = counts.get(key, 0) + 1
    return [CollectivePlan(kind=k[0], direction=k[1], where=k[2], bytes_per_token=k[3], count=n, bytes_per_call=k[4])
            for k, n in counts.items()]


def build_plan(model, ctx: PassContext, dtype: torch.dtype, tokens: int) -> ShardingPlan:
    """The report of one rewritten graph (``ctx`` after every pass) of ``model`` (the meta model)."""
    captured, gplan, tp = ctx.captured, ctx.gplan, ctx.group.size
    aliases = OrderedDict()
    named = dict(adapters.named_parameters(model))  # Hugging Face names, where an adapter wraps a layer
    for name, p in named.items():
        aliases.setdefault(id(p), []).append(name)
    # the passed values are nodes of the captured graph; bind erased the placeholders, their names stay
    reduced_names = {captured.params.get(v.name) for v in ctx.reduced if v.op == "placeholder"}
    sequence = ctx.sequence_report
    on_sequence = {captured.params.get(v.name) for v in (sequence.reduced if sequence else []) if v.op == "placeholder"}
    params = []
    for names in aliases.values():
        canonical = names[0]
        others = tuple(n for n in names if n != canonical)
        shape = tuple(named[canonical].shape)
        if canonical not in gplan.params:
            placement, reason = R, UNUSED
        else:
            placement = gplan.params[canonical]
            reason = gplan.reasons.get(canonical, "replicated")
            if placement.is_replicate and reason.startswith(("column", "row", "vocab", "hidden")):
                reason = "replicated"
            if canonical in on_sequence:
                reason += "; gradient all-reduced (used on sequence shards)"
            elif canonical in reduced_names:
                reason += "; gradient all-reduced (used on sharded activations)"
        params.append(ParamPlan(canonical, shape, placement, reason, others, _split(placement, shape, gplan.layout)))
    fallbacks = [f"{op}: {why}" for op, why in gplan.fallbacks]
    return ShardingPlan(
        model_type=getattr(model.config, "model_type", type(model).__name__),
        tp=tp,
        params=params,
        # with one rank every collective is the identity and sends nothing
        collectives=collect_collectives(captured.gm.graph, tokens, tp, ctx.passed_up) if tp > 1 else [],
        fallbacks=fallbacks,
        dtype=str(dtype).replace("torch.", ""),
        sequence_parallel=sequence is not None,
        sequence_parallel_kept=list(sequence.kept) if sequence else [],
        uneven=dict(gplan.layout.uneven) if gplan.layout is not None else {},
    )


def _split(p: Placement, shape: tuple, layout) -> tuple:
    """Per segment, each rank's size along the sharded dim if the split is uneven; () if even."""
    return (uneven_split(p, shape[p.dim], layout) or ()) if p.is_shard else ()
