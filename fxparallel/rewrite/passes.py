"""The rewrite stage: an explicit, ordered list of passes over one ``PassContext``.

The captured graph is rewritten in place, from full shapes to this rank's local code. The
solver's ``GraphPlan`` is keyed by the captured nodes; the passes before ``bind`` never erase
a planned node, so the plan stays valid through them (``bind`` erases the placeholders, and
the report reads only names and the final graph after it).

    outputs              placement and per-rank sizes of each graph output, and the KV cache layout
    redistribute         collectives and local slices between placements; nodes made local
    dropout_sites        dropouts left replicated take the same form as the sharded ones (rewrite/dropout_masks.py)
    gradient_reductions  copy_to_tp on replicated values used on shards
    sequence_parallel    all-reduces -> reduce-scatter / all-gather along the sequence (opt-in)
    context_parallel     sdpa -> attention over the cp group's chunks (with a cp group)
    coalesce_collectives a LoRA adapter's collectives join its base layer's (rewrite/coalesce_collectives.py)
    bind                 parameters, buffers and sizes bound; the graph becomes runnable
    expert_exchange      grouped products of experts spread over dp ranks exchange rows (with an ep group)
    dropout_mode         every dropout site reads the module's ``training`` flag (rewrite/dropout_masks.py)
    device_kernels       integer histograms chosen on meta counted in float on CPU (rewrite/device_kernels.py)
    split_by_layer       one piece of code per decoder layer (FSDP units), root code calls them

Skip a pass by name (``run_passes(ctx, skip=...)``); add one by adding a row to ``PASSES``.
With ``FXPARALLEL_DEBUG=1`` the graph is linted after every pass.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch
import torch.fx as fx

from ..capture.graph import CapturedGraph
from ..group import TPGroup
from ..plan.placement import Placement
from ..plan.solver import GraphPlan
from .bind import bind_inputs
from .coalesce_collectives import coalesce_adapter_collectives
from .context_parallel import apply_context_parallel
from .device_kernels import float_histograms_on_cpu
from .dropout_masks import bind_training_flag, cut_sequence_chunks, replicated_sites
from .editor import GraphEditor
from .expert_exchange import exchange_expert_rows, one_exchange_per_block
from .gradient_reductions import insert_gradient_reductions
from .split_by_layer import generate_layered_forward
from .redistribute import insert_redistributions
from .sequence_parallel import SequenceParallelReport, apply_sequence_parallel


@dataclass
class PassContext:
    """What the passes share. Inputs first; the rest is filled in by the passes, in order."""

    captured: CapturedGraph
    gplan: GraphPlan
    group: TPGroup
    device: torch.device
    sequence_parallel: bool = False
    cp: Optional[TPGroup] = None  # the context-parallel group, if any
    ep: Optional[TPGroup] = None  # the expert-parallel group over data-parallel ranks, if any
    expert_weights: frozenset = frozenset()  # HF names of the stacked expert weights (for ``expert_exchange``)
    # filled in by the passes
    output_placements: dict = field(default_factory=dict)  # output name -> Placement
    state_layout: dict = field(default_factory=dict)  # KV cache argument -> (full shape, Placement, dtype)
    output_sizes: dict = field(default_factory=dict)  # output name -> per-rank sizes along its sharded dim
    sharded_consumers: dict = field(default_factory=dict)  # replicated value -> consumers that use it on shards
    reduced: list = field(default_factory=list)  # values whose gradient is all-reduced
    passed_up: set = field(default_factory=set)  # values whose gradient reduction moved to their source
    sequence_report: Optional[SequenceParallelReport] = None
    attributes: dict = field(default_factory=dict)  # attributes the code reads besides parameters/buffers
    forward: Optional[Callable] = None  # the generated code
    code: str = ""
    pieces: object = None  # LayerPieces, when split by layer
    timings: dict = field(default_factory=dict)  # seconds per stage (api.plan_graph)

    @property
    def graph(self) -> fx.Graph:
        return self.captured.gm.graph


def record_outputs(ctx: PassContext) -> None:
    """How each output is placed (and split), and each KV cache argument, before the graph changes."""
    for node in ctx.graph.nodes:
        if node.op == "placeholder" and node.name in ctx.captured.state:
            value = node.meta["example_value"]
            # None: the batch (dim 0 of every cache tensor), also where it was captured as the constant 1
            full = (None,) + tuple(int(s) for s in value.shape[1:]) if value.dim() else ()
            ctx.state_layout[ctx.captured.state[node.name]] = (full, ctx.gplan.placements.get(node), value.dtype)
    out = next(n for n in ctx.graph.nodes if n.op == "output")
    layout = ctx.gplan.layout
    for name, value in zip(ctx.captured.outputs, out.args[0]):
        p = ctx.gplan.placements.get(value) if isinstance(value, fx.Node) else None
        ctx.output_placements[name] = p
        if isinstance(p, Placement) and p.is_shard and not p.segments:
            full = int(value.meta["example_value"].shape[p.dim])  # gathering it, or naming this rank's range
            ctx.output_sizes[name] = layout.sizes(full) if layout else None


def redistribute(ctx: PassContext) -> None:
    editor = GraphEditor(ctx.graph, ctx.group, ctx.gplan.layout, ctx.gplan.placements)
    ctx.sharded_consumers = insert_redistributions(ctx.graph, ctx.gplan, editor)


def dropout_sites(ctx: PassContext) -> None:
    replicated_sites(ctx.graph)


def gradient_reductions(ctx: PassContext) -> None:
    ctx.reduced += insert_gradient_reductions(ctx.graph, ctx.sharded_consumers, ctx.group.handle, ctx.gplan,
                                              ctx.passed_up)


def sequence_parallel(ctx: PassContext) -> None:
    ctx.sequence_report = apply_sequence_parallel(ctx.graph, ctx.captured, ctx.group, ctx.gplan.placements)
    ctx.reduced += ctx.sequence_report.reduced


def context_parallel(ctx: PassContext) -> None:
    cut_sequence_chunks(ctx.graph, ctx.captured, ctx.cp)  # dropout masks: this rank's chunks
    apply_context_parallel(ctx.graph, ctx.cp)


def coalesce_collectives(ctx: PassContext) -> None:
    coalesce_adapter_collectives(ctx.graph, ctx.captured.params)


def bind(ctx: PassContext) -> None:
    bind_inputs(ctx.graph, ctx.captured, ctx.device, ctx.attributes)


def expert_exchange(ctx: PassContext) -> None:
    exchange_expert_rows(ctx.graph, ctx.expert_weights, ctx.ep.handle)
    one_exchange_per_block(ctx.graph)


def dropout_mode(ctx: PassContext) -> None:
    bind_training_flag(ctx.graph)


def device_kernels(ctx: PassContext) -> None:
    float_histograms_on_cpu(ctx.graph, ctx.device)


def split_by_layer(ctx: PassContext) -> None:
    ctx.forward, ctx.code, ctx.pieces = generate_layered_forward(ctx.graph, ctx.captured.params.values())


def _generate_whole(ctx: PassContext) -> None:
    """Code of the whole graph, when ``split_by_layer`` is skipped."""
    ctx.forward, ctx.code, ctx.pieces = generate_layered_forward(ctx.graph, ())


# (name, pass, runs when); the order is the order they run in
PASSES = (
    ("outputs", record_outputs, lambda ctx: True),
    ("redistribute", redistribute, lambda ctx: True),
    ("dropout_sites", dropout_sites, lambda ctx: True),
    ("gradient_reductions", gradient_reductions, lambda ctx: True),
    ("sequence_parallel", sequence_parallel, lambda ctx: ctx.sequence_parallel and ctx.group.size > 1),
    ("context_parallel", context_parallel, lambda ctx: ctx.cp is not None),
    ("coalesce_collectives", coalesce_collectives, lambda ctx: ctx.group.size > 1),
    ("bind", bind, lambda ctx: True),
    ("expert_exchange", expert_exchange, lambda ctx: ctx.ep is not None),
    ("dropout_mode", dropout_mode, lambda ctx: True),
    ("device_kernels", device_kernels, lambda ctx: True),
    ("split_by_layer", split_by_layer, lambda ctx: True),
)
OPTIONAL = ("sequence_parallel", "context_parallel", "split_by_layer")  # the passes one may skip


def _lint(graph: fx.Graph) -> None:
    """FX's structural checks. After ``bind`` the attributes live on the parallel module, not on
    Dynamo's, so the check that get_attr targets exist is left out (no owning module)."""
    owner = graph._owning_module
    graph._owning_module = None
    try:
        graph.lint()
    finally:
        graph._owning_module = owner


def run_passes(ctx: PassContext, skip=()) -> PassContext:
    unknown = set(skip) - set(OPTIONAL)
    if unknown:
        raise ValueError(f"skip_passes: {sorted(unknown)} cannot be skipped; optional passes: {list(OPTIONAL)}")
    debug = os.environ.get("FXPARALLEL_DEBUG", "") not in ("", "0")
    for name, apply, runs in PASSES:
        if name in skip or not runs(ctx):
            continue
        apply(ctx)
        if debug:
            _lint(ctx.graph)
    if ctx.forward is None:
        _generate_whole(ctx)
    return ctx
