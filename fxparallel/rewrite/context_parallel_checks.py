"""Refusals for context parallelism: what the rewrite in ``context_parallel.py`` would get wrong.

That rewrite drops the model's own attention mask and runs every other op on the local
chunks, so it is exact only for plain causal sdpa attention with positions from
``position_ids``, ops that act token by token elsewhere, and a loss that takes the labels
as given. ``check_config`` refuses what the config says (before any capture),
``check_graph`` what the captured graph shows (before solving).
"""
from __future__ import annotations

import torch.fx as fx
import torch.nn.functional as F

from ..plan.op_traits import ACTIVATION_PRODUCTS, SEQUENCE_MIXING, op_name
from ..errors import ContextParallelError
from .fx_nodes import SDPA, node_arg


def check_config(config) -> None:
    """Refuse configs whose attention is more than plain causal attention (before any capture)."""
    kind = getattr(config, "model_type", type(config).__name__)
    problems = []
    layer_types = getattr(config, "layer_types", None)
    if layer_types:
        other = sorted({t for t in layer_types if t != "full_attention"})
        if other:
            problems.append(f"layer_types {other}")
    elif getattr(config, "sliding_window", None) is not None:
        problems.append(f"sliding-window attention (config.sliding_window={config.sliding_window})")
    for field in ("attention_chunk_size", "attn_logit_softcapping"):
        if getattr(config, field, None) is not None:
            problems.append(f"config.{field}={getattr(config, field)}")
    if getattr(config, "alibi", False) or getattr(config, "position_embedding_type", None) == "alibi":
        problems.append("ALiBi position biases")
    if problems:
        raise ContextParallelError(f"{kind}: context parallelism supports plain causal attention only; this model "
                                   f"has {', '.join(problems)}")


def _depends_on(graph: fx.Graph, sources: set) -> set:
    """Nodes whose value is computed from any of ``sources`` (inclusive)."""
    found = set(sources)
    for node in graph.nodes:
        if node not in found and any(i in found for i in node.all_input_nodes):
            found.add(node)
    return found


_LABEL_VIEWS = {"view", "reshape", "to", "contiguous", "long", "flatten"}


def _op_name(node: fx.Node) -> str:
    """The op's canonical name (``plan/op_traits.py``); a spelling the table does not list (or a custom
    op) goes by its own name, so that any alias of a sequence-mixing op is still refused."""
    name = op_name(node)
    if (name is not None and "::" not in name) or node.op not in ("call_function", "call_method"):
        return name or ""
    return str(node.target) if node.op == "call_method" else getattr(node.target, "__name__", str(node.target))


_BATCHED = frozenset({"bmm", "baddbmm"})  # products that pair their operands' rows along dim 0, and only so
_CASTS = frozenset({"to", "contiguous", "float", "type_as"})


def _with_casts(graph: fx.Graph, is_seed) -> set:
    """The nodes ``is_seed`` picks and the casts of them (a view could move the dim that matters: not followed)."""
    found = set()
    for node in graph.nodes:
        if is_seed(node) or (_op_name(node) in _CASTS and node.args and node.args[0] in found):
            found.add(node)
    return found


def _rows_of_stacked_weights(graph: fx.Graph, tokens: set) -> set:
    """Matrices picked per row from a stack of weights by ids computed from the tokens, and their casts:
    transformers' batched_mm experts, ``gate_up_proj[expert_ids]`` ([experts, a, b] indexed by a 1-d id per routed
    row). They depend on the tokens through the ids only, one matrix per row, so a batched product with the rows
    multiplies each row by its own matrix: token by token, not two activations mixed (MoE blocks run under context
    parallelism)."""
    def picked_per_row(node) -> bool:
        if _op_name(node) != "getitem" or len(node.args) != 2:
            return False
        stack, ids = node.args
        return isinstance(stack, fx.Node) and isinstance(ids, fx.Node) and stack not in tokens and ids in tokens \
            and getattr(stack.meta.get("example_value"), "ndim", 0) >= 3 \
            and getattr(ids.meta.get("example_value"), "ndim", 0) == 1

    return _with_casts(graph, picked_per_row)


def _histograms(graph: fx.Graph) -> set:
    """Counts per bin (``histc``, ``bincount``) and their casts: a cumulative sum over them runs along the bins, not
    the sequence (transformers' grouped_mm experts: ``cumsum`` of the tokens per expert gives each expert's offset
    among this chunk's rows)."""
    return _with_casts(graph, lambda node: _op_name(node) in ("histc", "bincount"))


def check_graph(captured, kind: str) -> None:
    """Refuse a captured graph that context parallelism would compute wrongly."""
    graph = captured.gm.graph
    by_argument = {captured.inputs[n.name]: n for n in graph.nodes
                   if n.op == "placeholder" and n.name in captured.inputs}
    sdpa = [n for n in graph.nodes if n.op == "call_function" and n.target in SDPA]
    if not sdpa:
        raise ContextParallelError(f"{kind}: context parallelism replaces scaled_dot_product_attention, and this "
                                   "model's graph has none (eager attention?); load it with attn_implementation='sdpa'")
    positions = by_argument.get("position_ids")
    if positions is None:
        raise ContextParallelError(f"{kind}: the graph does not read position_ids, so its positions cannot be the "
                                   "global ones under context parallelism")
    tokens = _depends_on(graph, {by_argument["input_ids"]})
    positioned = _depends_on(graph, {positions})
    for node in sdpa:  # attention dropout is supported: ops/dropout_kernels.py
        if node_arg(node, 0, "query") not in positioned:
            raise ContextParallelError(f"{kind}: the queries of {node.name} do not depend on position_ids (no rotary "
                                       "or learned positions?), so context parallelism cannot place them")
        mask = node_arg(node, 3, "attn_mask")
        if isinstance(mask, fx.Node) and mask in tokens:
            raise ContextParallelError(f"{kind}: the mask of {node.name} depends on the tokens (a bias such as "
                                       "ALiBi or a padding mask); only plain causal attention is supported")
        if mask is None and not node_arg(node, 5, "is_causal", False):
            raise ContextParallelError(f"{kind}: attention {node.name} is not causal")
    per_row, histograms = _rows_of_stacked_weights(graph, tokens), _histograms(graph)
    for node in graph.nodes:
        name = _op_name(node)
        if node not in tokens or node.op not in ("call_function", "call_method"):
            continue
        if name in SEQUENCE_MIXING and not (node.args and node.args[0] in histograms):
            raise ContextParallelError(f"{kind}: {name} ({node.name}) may mix tokens along the sequence, which a "
                                       "context-parallel chunk cannot compute")
        operands = [i for i in node.all_input_nodes if i in tokens and not (name in _BATCHED and i in per_row)]
        if name in ACTIVATION_PRODUCTS and len(operands) >= 2:
            raise ContextParallelError(f"{kind}: {name} ({node.name}) multiplies two activations (attention outside "
                                       "scaled_dot_product_attention?); context parallelism cannot split it")
    labels = by_argument.get("labels")
    if labels is not None:
        _check_labels_unshifted(graph, labels, kind)


def _check_labels_unshifted(graph: fx.Graph, labels: fx.Node, kind: str) -> None:
    """The loss must read the labels as given (captured as shift_labels), not shift them itself."""
    losses = [n for n in graph.nodes if n.op == "call_function" and n.target is F.cross_entropy]
    if not losses:
        raise ContextParallelError(f"{kind}: the loss is not a cross_entropy of the labels; context parallelism "
                                   "cannot check that labels are used unshifted")
    for loss in losses:
        node = node_arg(loss, 1, "target")
        while isinstance(node, fx.Node) and node is not labels:
            if node.op != "call_method" or node.target not in _LABEL_VIEWS:
                raise ContextParallelError(
                    f"{kind}: the loss transforms the labels ({_op_name(node) or node.op} at {node.name}) instead of "
                    "taking transformers' shift_labels; context parallelism needs labels used as given")
            node = node.args[0]
        if node is not labels:
            raise ContextParallelError(f"{kind}: the loss target of {loss.name} does not come from labels")
