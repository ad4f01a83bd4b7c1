"""Turn the solver's answer and the rewritten graph into a ShardingPlan (data)."""
from __future__ import annotations

import re
from collections import OrderedDict

import torch

from ..rewrite import collectives
from ..rewrite.functional import vocab_parallel_cross_entropy
from .layout import uneven_split
from .placement import Placement
from .plan import UNUSED, CollectivePlan, ParamPlan, ShardingPlan
from .rules.base import bytes_per_token
from .solver import GraphPlan, layer_pattern

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


def _gradient_consumers(node):
    """The ops whose input gradient a copy_to_tp reduces (through values it was passed up from)."""
    for user in node.users:
        if user.meta.get("fxparallel_passes_grad_reduction"):
            yield from _gradient_consumers(user)
        else:
            yield user


def _where(node, direction: str = "forward") -> str:
    """Name the module whose value a collective acts on, as a layer pattern: for the backward
    collective of a value used on shards the modules that consume it, otherwise the module
    that produced it."""
    if node.target in (collectives.copy_to_tp, collectives.sum_grad_rows) or (
            direction == "backward" and node.target in collectives.GRADIENT_OF_CONSUMERS):
        if node.args[0].op in ("placeholder", "get_attr"):
            return f"gradient of parameter {layer_pattern(str(node.args[0].target))}"
        users = sorted({layer_pattern(module_path(u)) for u in _gradient_consumers(node)})
        return "gradient of the input of " + ", ".join(users)
    source = node.args[0] if node.args and hasattr(node.args[0], "meta") else node
    while source is not None and source.op == "call_function" and source.target in (
        collectives.COLLECTIVE_OPS + (collectives.local_chunk,)
    ):
        source = source.args[0]
    if source is not None and source.op in ("placeholder", "get_attr"):
        return f"parameter {layer_pattern(str(source.target))}"
    return layer_pattern(module_path(source))


def collect_collectives(graph, tokens: int, tp: int) -> list:
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
        source = node.args[0]
        if source.op in ("placeholder", "get_attr"):  # a parameter: fixed size per call
            value = source.meta["example_value"]
            per_token, per_call = 0.0, float(value.numel() * value.element_size())
            if fn is collectives.sum_grad_rows:  # only the rows of its whole segments
                dim, ranges = node.args[1], node.args[2]
                per_call *= sum(stop - start for start, stop in ranges) / value.shape[dim]
        else:
            per_token, per_call = bytes_per_token(source, tokens), 0.0
        for direction, kind in (("forward", fn.FORWARD), ("backward", fn.BACKWARD)):
            if kind:
                key = (kind, direction, _where(node, direction), per_token, per_call)
                counts[key] = counts.get(key, 0) + 1
    return [CollectivePlan(kind=k[0], direction=k[1], where=k[2], bytes_per_token=k[3], count=n, bytes_per_call=k[4])
            for k, n in counts.items()]


def build_plan(model, captured, gplan: GraphPlan, graph, reduced_values, tp: int, dtype: torch.dtype,
               tokens: int, sequence_parallel=None) -> ShardingPlan:
    """``sequence_parallel``: the SequenceParallelReport when that pass ran."""
    aliases = OrderedDict()
    for name, p in model.named_parameters(remove_duplicate=False):
        aliases.setdefault(id(p), []).append(name)
    node_of_param = {captured.params[n.name]: n for n in captured.placeholders() if n.name in captured.params}
    reduced_names = {captured.params.get(v.name) for v in reduced_values if v.op == "placeholder"}
    on_sequence = {captured.params.get(v.name) for v in getattr(sequence_parallel, "reduced", [])
                   if v.op == "placeholder"}
    params = []
    for names in aliases.values():
        canonical = next((n for n in names if n in node_of_param), names[0])
        others = tuple(n for n in names if n != canonical)
        shape = tuple(dict(model.named_parameters(remove_duplicate=False))[canonical].shape)
        if canonical not in gplan.params:
            placement, reason = "R", UNUSED
        else:
            placement = str(gplan.params[canonical])
            reason = gplan.reasons.get(canonical, "replicated")
            if placement == "R" and reason.startswith(("column", "row", "vocab", "hidden")):
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
        collectives=collect_collectives(graph, tokens, tp) if tp > 1 else [],
        fallbacks=fallbacks,
        dtype=str(dtype).replace("torch.", ""),
        sequence_parallel=sequence_parallel is not None,
        sequence_parallel_kept=list(getattr(sequence_parallel, "kept", [])),
        uneven=dict(gplan.layout.uneven) if gplan.layout is not None else {},
    )


def _split(placement: str, shape: tuple, layout) -> tuple:
    """Per segment, each rank's size along the sharded dim if the split is uneven; () if even."""
    p = Placement.parse(placement)
    return (uneven_split(p, shape[p.dim], layout) or ()) if p.is_shard else ()
