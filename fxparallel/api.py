"""``parallelize``: the lifecycle, one function per stage, data flowing one way.

    resolve source -> check splits -> capture (meta model, Dynamo graph; a deep model's alike layers
      captured once and repeated, capture/repeat_layers.py; the graph without labels cut from the
      training capture, capture/derive.py)
      -> solve (GraphPlan: a placement and strategy per node, pure data)
      -> rewrite (rewrite/passes.py: outputs, redistribute, dropout_sites, gradient_reductions,
         sequence_parallel, context_parallel, bind, dropout_mode, split_by_layer)
      -> report (ShardingPlan) -> compare plans across ranks -> load weights into this rank's shards.

What a graph computes is one ``GraphSpec`` (capture/spec.py), how it is planned one ``PlanOptions``
(plan/options.py); ``GraphFactory`` plans a spec for the module, which holds its graphs in a ``GraphSet``.
Capture, solve, rewrite and report run once per graph key: ``planned_graph`` reads a graph planned
before (this launch or an earlier one) from the graph cache (``graph_cache/``), or, under
``FXPARALLEL_PLANNING=first``, receives it from group rank 0 (``graph_cache/first_rank.py``). A saved plan
(``plan=``) fixes every parameter's placement before the solve (``plan/saved.py``).
Timings of each stage are kept on the returned module (``model.timings``).
"""
from __future__ import annotations

import dataclasses
import functools
import inspect
import logging
import socket
import time
from typing import Optional, Union

import torch
import torch.distributed as dist

from .capture import adapters, build_meta_model, capture
from .capture.dynamo import one_token_prompts
from .capture.derive import without_labels
from .capture.expert_counts import experts_modules
from .capture.router_logits import load_balancing_of, takes_router_logits
from .capture.repeat_layers import capture_layers_once
from .capture.spec import EXAMPLE_BATCH, EXAMPLE_SEQ, GraphSpec
from .capture.generation_inputs import inputs_beyond_tokens
from .capture.static_cache import keeps_states
from .graph_cache import PlannedGraph, graph_key
from .graph_cache.first_rank import planned_for_group
from .errors import GroupError, ShardingError
from .group import TPGroup, choose_device, fake_group, resolve_group, resolve_tp_group, shared_devices, uses_nccl
from .load import (initialize, load_from_files, load_from_state_dict, resolve_checkpoint,
                   resolve_source)
from .load.adapter_weights import load_adapter_weights, without_adapters
from .load.expert_runs import runs_of
from .load.coordinate import exchange
from .load.dtype import resolve_dtype
from .model_facts import ModelFacts
from .module import ParallelCausalLM
from .ops.local_graph import LocalGraph
from .plan.layout import ShardLayout, expert_parameters, text_config
from .plan.adapter_placements import adapter_placements, expert_adapter_rows
from .plan.expert_choice import ExpertChoice, choose_experts, experts_line, saved_whole_experts, settle
from .plan.options import PlanOptions
from .plan.experts_over_dp import check_experts_over_dp, stacked_expert_weights
from .plan.saved import check_applied, fixed_placements, read_plan
from .plan.solver import check_layer_symmetry, solve
from .plan.validate import check_splittable
from .plan_agreement import check_plans_agree
from .report import build_plan
from .ops.context_parallel_attention import resolve_cp_group
from .rewrite import PassContext, context_parallel_checks, run_passes

log = logging.getLogger("fxparallel")

TRAINING_ARGUMENTS = ("input_ids", "labels")
CONTEXT_PARALLEL_TRAINING_ARGUMENTS = ("input_ids", "position_ids", "labels")  # global positions per token


def _choose_device(group: TPGroup, device, cp=None) -> torch.device:
    """This rank's device (``group.choose_device``: ``device=`` where given, else from the group's backend
    and LOCAL_RANK, made the current CUDA device), after checking over each NCCL group (tp, cp) that no two
    ranks of one host share a CUDA device (an agreement point: every rank of the group enters it)."""
    device = choose_device(group, device)
    for name, g in (("tp_group", group), ("cp_group", cp)):
        if g is None or g.size == 1 or not uses_nccl(g):
            continue
        mine = [socket.gethostname(), device.index if device.type == "cuda" else None]  # JSON-able
        everyone = exchange(g.process_group, mine, f"checking that the ranks of {name} have their own CUDA devices",
                            step=f"devices of {name}")
        problem = shared_devices(everyone, list(dist.get_process_group_ranks(g.process_group)), name)
        if problem:
            raise GroupError(problem)
    return device


def capture_model(meta_model, spec: GraphSpec):
    """The graph of ``spec``; a deep model with alike layers captured with a few and repeated
    (capture/repeat_layers.py)."""
    return capture_layers_once(meta_model, spec, capture) or capture(meta_model, spec)


def plan_graph(meta_model, spec: GraphSpec, group: TPGroup, device, options: PlanOptions = PlanOptions(),
               captured=None) -> PassContext:
    """Capture ``spec`` (what the graph computes: capture/spec.py), solve and rewrite it with ``options``
    (plan/options.py); returns the context after every pass (rewrite/passes.py). The seconds of each stage
    are in ``ctx.timings`` (capture, solve, rewrite).
    ``captured``: a graph captured (or derived) before, planned instead of capturing (a callable: gives it)."""
    t = time.perf_counter()
    captured = captured() if callable(captured) else captured if captured is not None else \
        capture_model(meta_model, spec)
    timings = {"capture": time.perf_counter() - t}
    options = options.for_cache(spec.cache_length)
    if options.cp is not None:
        kind = getattr(meta_model.config, "model_type", type(meta_model).__name__)
        context_parallel_checks.check_graph(captured, kind)
    # uneven splits by whole heads / columns / rows (and experts, with expert parallelism)
    experts = expert_parameters(meta_model) if options.expert_parallel else {}
    t = time.perf_counter()
    # a LoRA adapter's matrices follow their base layer's placement (plan/adapter_placements.py)
    adapted = adapter_placements(meta_model, options.fixed, experts)
    layout = ShardLayout.for_config(meta_model.config, group.size).add_embedding_rows(meta_model).add_experts(
        set(experts.values()), expert_adapter_rows(adapted))
    fixed = {**{name: placement for name, (placement, _) in adapted.items()}, **options.fixed}
    if captured.few_layers is not None:  # solved on the few layers; the walk over all of them follows it
        few = solve(captured.few_layers, group.size, fixed=fixed, layout=layout, experts=frozenset(experts))
        fixed = {**few.params, **fixed}
    gplan = solve(captured, group.size, fixed=fixed, layout=layout, experts=frozenset(experts),
                  trains=spec.cache_length is None)
    if captured.few_layers is not None:
        gplan.reasons.update(few.reasons)  # why each was chosen, not that it was given
    gplan.reasons.update({name: why for name, (_, why) in adapted.items()})
    for name, (placement, _) in adapted.items():  # an inactive adapter's: not in the graph, kept where they go
        gplan.params.setdefault(name, placement)
    timings["solve"] = time.perf_counter() - t
    t = time.perf_counter()
    ctx = PassContext(captured, gplan, group, device, sequence_parallel=options.sequence_parallel, cp=options.cp,
                      ep=options.ep, expert_weights=stacked_expert_weights(meta_model) if options.ep else frozenset())
    run_passes(ctx, skip=options.skip_passes)
    ctx.timings = dict(timings, rewrite=time.perf_counter() - t)
    return ctx


def local_graph(ctx: PassContext, spec: GraphSpec) -> LocalGraph:
    """What the module keeps of a rewritten graph: its code and what calling it needs."""
    return LocalGraph(spec=spec, forward=ctx.forward, outputs=ctx.captured.outputs,
                      output_placements=ctx.output_placements, guards=ctx.captured.shape_guards(),
                      attributes=ctx.attributes, code=ctx.code, output_sizes=ctx.output_sizes, pieces=ctx.pieces,
                      state=_state_shapes(ctx))


def _state_shapes(ctx: PassContext) -> dict:
    """KV cache argument -> (full shape, local shape, dtype); None stands for the batch dim."""
    shapes = {}
    for name, (full, placement, dtype) in ctx.state_layout.items():
        local = list(full)
        if placement is not None and placement.is_shard:
            local[placement.dim] = sum(placement.local_parts(lambda size: ctx.gplan.layout.local(size, ctx.group.rank))) \
                if placement.segments else ctx.gplan.layout.local(full[placement.dim], ctx.group.rank)
        shapes[name] = (tuple(full), tuple(local), dtype)
    return shapes


def _for_device(config, device: torch.device):
    """Model code that picks kernels by device type sees 'meta' at capture; choose for the real one.

    transformers' default MoE kernel (grouped_mm) takes an integer histogram path off CPU, which
    CPU cannot run: on CPU use its batched_mm kernel (same math)."""
    if device.type == "cpu" and getattr(config, "_experts_implementation", None) in (None, "grouped_mm"):
        import copy

        config = copy.deepcopy(config)  # harmless for models without experts
        config._experts_implementation = "batched_mm"
    return config


def _meta_model(source, tp: int, dtype, trust_remote_code: bool):
    """The meta model of ``source`` (with its LoRA adapters' layers, the active one computing, unless adapters are
    disabled: capture/adapters.py), after checking it can be split over ``tp`` ranks."""
    meta = build_meta_model(source.config, dtype=dtype, trust_remote_code=trust_remote_code,
                            model_class=source.model_class)
    check_splittable(source.config, tp, meta)
    if source.adapter is not None and source.adapter.enabled:
        attached = source.inactive_adapters + (source.adapter,)
        computing = [source.adapter.name, *source.co_active]
        meta = adapters.inject(meta, [(a.config, a.name) for a in attached], computing)
    return meta


class OneCapture:
    """One capture of ``spec`` for any number of plans of it (``captured``: a graph, or a callable giving it, planned
    instead of a capture). ``derived``: a dict that gets the graph without labels derived from a capture made here
    (``capture/derive.py``), by its spec, before any plan rewrites it. Each plan gets a copy (``copy``), the last
    the graph itself."""

    def __init__(self, meta, spec: GraphSpec, captured=None, derived=None):
        self.meta, self.spec, self.given, self.derived, self.graph = meta, spec, captured, derived, None

    def __call__(self, copy: bool):
        if self.graph is None:
            made = self.given is None or callable(self.given)
            self.graph = self.given() if callable(self.given) else self.given if self.given is not None else \
                capture_model(self.meta, self.spec)
            if made and self.derived is not None:
                without = without_labels(self.graph)
                if without is not None:
                    self.derived[self.spec.without_labels()] = without
        return self.graph.copy() if copy else self.graph


def planned_graph(meta, spec: GraphSpec, group: TPGroup, device, dtype, options: PlanOptions = PlanOptions(), *,
                  report: bool = False, captured=None, derived=None) -> PlannedGraph:
    """``plan_graph`` and what the module keeps of it, from the graph cache when this exact graph was
    planned before (``graph_cache``: same model, rank, spec, options and versions), or from group rank 0
    (``graph_cache/first_rank.py``). ``report``: also the ShardingPlan (the training graph's).
    ``captured`` / ``derived``: as ``OneCapture`` takes them (neither is part of the key: a derived graph
    is the one a capture of its spec gives)."""
    one = OneCapture(meta, spec, captured, derived)

    def build(rank: int, on: torch.device) -> PlannedGraph:  # rank: this one's (planned last) or another's
        mine = rank == group.rank
        ctx = plan_graph(meta, spec, group if mine else dataclasses.replace(group, rank=rank), on, options,
                         captured=lambda: one(copy=not mine))
        plan = None
        if report:
            asymmetric = check_layer_symmetry(ctx.gplan.params)
            if asymmetric:
                log.warning("layers with the same structure got different placements: %s", ", ".join(asymmetric))
            plan = build_plan(meta, ctx, dtype, tokens=EXAMPLE_BATCH * EXAMPLE_SEQ)
        return PlannedGraph(local_graph(ctx, spec), dict(ctx.gplan.params), plan, timings=ctx.timings)

    key = graph_key(meta, spec, group, device, dtype, options, report)
    return _with_experts_line(planned_for_group(key, group, device, build), meta, options.experts_why)


def _with_experts_line(planned: PlannedGraph, meta, why: str) -> PlannedGraph:
    """``planned`` whose report says how the experts are held and ``why`` (plan/expert_choice.py): said by this
    call, not by the graph cache's copy (the same graph serves a choice asked for and one the planner made)."""
    if planned.plan is None:
        return planned
    line = experts_line(planned.plan, why, expert_parameters(meta))
    return dataclasses.replace(planned, plan=dataclasses.replace(planned.plan, experts=line))


def training_spec(cp) -> GraphSpec:
    """The graph ``parallelize`` captures first: the forward with labels (under context parallelism also the
    global positions of each token, and labels that arrive shifted)."""
    if cp is None:
        return GraphSpec(TRAINING_ARGUMENTS)
    return GraphSpec(CONTEXT_PARALLEL_TRAINING_ARGUMENTS, labels_shifted=True)


def _vocabulary(meta) -> tuple:
    """(embedding rows, logits) of the model: the ranges of token ids and labels."""
    def rows(module):
        weight = getattr(module, "weight", None)
        return int(weight.shape[0]) if isinstance(weight, torch.Tensor) and weight.dim() == 2 else None

    embeddings = meta.get_input_embeddings() if hasattr(meta, "get_input_embeddings") else None
    head = meta.get_output_embeddings() if hasattr(meta, "get_output_embeddings") else None
    return (rows(embeddings) if embeddings is not None else None), (rows(head) if head is not None else None)


def _position_limit(meta):
    """The positions a learned position table holds (GPT-2's wpe, OPT's embed_positions: another embedding
    table with max_position_embeddings rows, plus OPT's offset of 2), or None (rotary and the like)."""
    limit = getattr(text_config(meta.config), "max_position_embeddings", None)
    inputs = meta.get_input_embeddings() if hasattr(meta, "get_input_embeddings") else None
    if not isinstance(limit, int):
        return None
    for module in meta.modules():
        if isinstance(module, torch.nn.Embedding) and module is not inputs and 0 <= module.num_embeddings - limit <= 2:
            return limit
    return None


def _generation_config(source, config):
    """The checkpoint's generation_config.json where there is one (as transformers loads it), else the
    defaults the model config implies."""
    from transformers import GenerationConfig

    if source.checkpoint is not None:
        try:
            return GenerationConfig.from_pretrained(source.checkpoint, **source.hub_kwargs)
        except OSError:  # the checkpoint has none
            pass
    return GenerationConfig.from_model_config(config)


def embedding_modules(meta) -> dict:
    """{"input" / "output": (module path, class name, has a bias)} of the model's input embedding and
    output head (``get_input_embeddings`` / ``get_output_embeddings``); a missing one is left out."""
    paths = {id(module): path for path, module in meta.named_modules(remove_duplicate=False)}
    found = {}
    for kind in ("input", "output"):
        getter = getattr(meta, f"get_{kind}_embeddings", None)
        try:
            module = getter() if getter is not None else None
        except (AttributeError, NotImplementedError):  # transformers raises for models without one
            module = None
        weight = getattr(module, "weight", None)
        if module is not None and id(module) in paths and isinstance(weight, torch.Tensor) and weight.dim() == 2:
            found[kind] = (paths[id(module)], type(module).__name__, getattr(module, "bias", None) is not None)
    return found


class GraphFactory:
    """Captures the graphs of a parallel module (``GraphSet.factory``): the training graph first, then one
    for a new set of arguments, a KV cache length, or shapes outside every graph's guards. It captures
    the meta model (in the module's dtype) with every parameter's placement fixed to the first plan's,
    so every graph reads the same shards. ``in_dtype`` gives the factory of another dtype
    (``model.to(dtype)``: a new meta model in that dtype, the same placements). ``derived``: graphs
    derived from the training capture (``capture/derive.py``) by spec, planned instead of a capture.
    ``plain``: the factory of the model without adapters whose placements this one's base layers follow."""

    def __init__(self, source, meta, dtype: torch.dtype, group: TPGroup, device, options: PlanOptions,
                 trust_remote_code: bool, derived=None):
        self.source, self.meta, self.dtype, self.group, self.device = source, meta, dtype, group, device
        self.options, self.trust_remote_code = options, trust_remote_code
        self.fixed = dict(options.fixed)  # grows with each graph's placements: they hold for every later graph
        self.derived = derived if derived is not None else {}
        self.usual_shapes = None  # the training graph's ShapeGuards
        self.trained: Optional[PlannedGraph] = None  # the training graph, planned once
        self.plain: Optional["GraphFactory"] = None
        self.pending_experts: Optional[ExpertChoice] = None  # whole experts, settled at the training graph

    @functools.cached_property
    def one_token_prompts(self) -> bool:
        """Can a forward of several tokens with a cache run one token at a time (capture/dynamo.py)? Asked of the
        meta model only once a graph with a cache exists: the question (transformers' prepare_inputs_for_generation)
        installs transformers' output hooks on it, and asked at parallelize, before the training graph's capture, it
        changed the router logits that graph returns (tried: Mixtral's, off by 0.57)."""
        return one_token_prompts(self.meta)

    def __call__(self, spec: GraphSpec) -> LocalGraph:
        planned = None
        usual = self.usual_shapes is not None and self.usual_shapes.holds_for(
            {a: spec.shape for a in training_spec(self.options.cp).arguments})
        if spec.cache_length is None and usual:
            # a shape the training graph takes: planned at the training capture's example shape, so the first
            # call's shape does not change the graph (nor its cache key); from the training capture if it was cut
            # (that derived graph computes every position's logits: kept for the call that asks for them)
            example = spec.at((EXAMPLE_BATCH, EXAMPLE_SEQ))
            derived = None if spec.logits_to_keep or spec.unpadded else self.derived.pop(example, None)
            planned = self._planned(example, captured=derived)
            if not planned.local.guards.holds_for({a: spec.shape for a in spec.arguments}):
                planned = None
        return (planned or self._planned(spec)).local

    def _planned(self, spec: GraphSpec, options: Optional[PlanOptions] = None, **planning) -> PlannedGraph:
        """``spec`` planned with every placement planned so far; ``options``: a candidate's instead of the
        factory's, whose placements are then not kept (``_keep``)."""
        planned = planned_graph(self.meta, spec, self.group, self.device, self.dtype,
                                (options or self.options).with_fixed(self.fixed), **planning)
        return planned if options is not None else self._keep(planned)

    def _keep(self, planned: PlannedGraph) -> PlannedGraph:
        for name, placement in planned.params.items():  # the first plan's placement holds for every later graph
            self.fixed.setdefault(name, placement)
        return planned

    def in_dtype(self, dtype: torch.dtype) -> "GraphFactory":
        """The factory of the same model in ``dtype`` (a meta model built in it, as ``parallelize`` builds)."""
        meta = _meta_model(self.source, self.group.size, dtype, self.trust_remote_code)
        return GraphFactory(self.source, meta, dtype, self.group, self.device, self.options.with_fixed(self.fixed),
                            self.trust_remote_code)

    def with_adapter(self, adapter, inactive: tuple = (), co_active: tuple = ()) -> "GraphFactory":
        """The factory of the same model with LoRA adapters (``load/adapter_files.AdapterSource``) injected,
        ``adapter`` the active one (None: without adapters), ``co_active`` the names of inactive ones that compute
        beside it, every placement planned so far kept."""
        source = dataclasses.replace(self.source, adapter=adapter, inactive_adapters=tuple(inactive),
                                     co_active=tuple(co_active))
        if self.options.ep is not None:
            base = self if self.source.adapter is None else self.plain  # (its meta model without adapters)
            check_experts_over_dp(base.meta, self.options.ep.size, tuple(a for a in (adapter, *inactive) if a))
        meta = _meta_model(source, self.group.size, self.dtype, self.trust_remote_code)
        factory = GraphFactory(source, meta, self.dtype, self.group, self.device, self.options.with_fixed(self.fixed),
                               self.trust_remote_code)
        factory.plain = self if self.source.adapter is None else self.plain
        return factory

    def without_adapters(self) -> "GraphFactory":
        """The factory of the model without adapters: the one whose plan the base layers follow where it is known
        (its training graph then planned already: ``merge_and_unload`` captures nothing new), else a new one."""
        return self.plain if self.plain is not None else self.with_adapter(None)

    def training_graph(self) -> PlannedGraph:
        """The training graph (and its ShardingPlan), which ``parallelize`` captures first."""
        # its capture also gives the graph without labels (capture/derive.py), for the first call without labels
        if self.trained is None:
            spec = training_spec(self.options.cp)
            if self.pending_experts is not None:
                self.trained = self._settle_experts(spec)
            else:
                self.trained = self._planned(spec, report=True, derived=self.derived)
            self.usual_shapes = self.trained.local.guards
        return self.trained

    def _settle_experts(self, spec: GraphSpec) -> PlannedGraph:
        """The planner's choice of whole experts (plan/expert_choice.py): the training graph planned with every
        expert split inside and with whole experts, from one capture; whole experts kept where they plan and cost
        no more collectives and bytes. Every later graph then follows the choice."""
        pending, self.pending_experts = self.pending_experts, None
        pristine = []

        def one_capture():  # the first planning captures; each gets its own copy to rewrite
            if not pristine:
                pristine.append(capture_model(self.meta, spec))
            return pristine[0].copy()

        def plan(whole: bool, **planning) -> PlannedGraph:
            options = dataclasses.replace(self.options, expert_parallel=whole, experts_why="")
            return self._planned(spec, options, report=True, captured=one_capture, **planning)

        split = plan(False, derived=self.derived)
        try:
            whole = plan(True)
        except Exception as err:  # noqa: BLE001 - e.g. experts' rows meet an op the expert rules do not follow:
            whole = err  # the split plan (the default before) serves, and the report names the error
        choice = settle(pending, whole.plan if isinstance(whole, PlannedGraph) else whole, split.plan,
                        expert_parameters(self.meta))
        self.options = dataclasses.replace(self.options, expert_parallel=choice.whole, experts_why=choice.why)
        return self._keep(_with_experts_line(whole if choice.whole else split, self.meta, choice.why))


def model_facts(meta, source, sequence_parallel: bool) -> ModelFacts:
    """What the parallel module needs to know of the model besides its shards and graphs (model_facts.py)."""
    forward_parameters = inspect.signature(meta.forward).parameters
    vocab_rows, label_classes = _vocabulary(meta)
    return ModelFacts(
        sequence_parallel=sequence_parallel, vocab_rows=vocab_rows, label_classes=label_classes,
        position_limit=_position_limit(meta), takes_position_ids="position_ids" in forward_parameters,
        takes_logits_to_keep="logits_to_keep" in forward_parameters,
        takes_router_logits=takes_router_logits(meta),
        hf_loss_type=getattr(meta, "loss_type", None), hf_class_name=type(meta).__name__,
        router_aux_loss_coef=float(getattr(meta, "router_aux_loss_coef", 0.0) or 0.0),
        load_balancing=load_balancing_of(meta) if takes_router_logits(meta) else None,
        moe_layers=len(experts_modules(meta)), recurrent_cache=keeps_states(meta.config),
        inputs_beyond_tokens=inputs_beyond_tokens(meta),
        generation_config=_generation_config(source, meta.config), embedding_modules=embedding_modules(meta),
        embedding_weights=tuple(f"{path}.weight" for path, m in meta.named_modules()
                                if isinstance(m, torch.nn.Embedding)),
        dropout_rates=dict(getattr(meta, "fxparallel_dropout", {})))


def _saved_placements(saved, source, meta, tp: int, dtype, trust_remote_code: bool) -> dict:
    """The base model's placements in ``saved`` (a ShardingPlan), checked against the model: with its adapter when
    the plan names the adapter's matrices (saved from a model with the adapter), else the base model (``meta``).
    The adapter's matrices follow their base layers (plan/adapter_placements.py); ``check_applied`` then compares
    them with the saved ones."""
    if source.adapter is None or not any(adapters.is_adapter_parameter(p.name) for p in saved.params):
        return fixed_placements(saved, meta, tp)
    fixed = fixed_placements(saved, _meta_model(source, tp, dtype, trust_remote_code), tp)
    return {name: p for name, p in fixed.items() if not adapters.is_adapter_parameter(name)}


def _first_graph(source, factory: GraphFactory) -> tuple:
    """(factory, PlannedGraph) of the training graph of ``source``, ``factory`` planning its base model. With a
    LoRA adapter the base model is planned first and the adapter's matrices follow the base layers' placements
    (plan/adapter_placements.py): the factory returned is then the one with the adapter."""
    planned = factory.training_graph()
    if source.adapter is not None:
        factory = factory.with_adapter(source.adapter, source.inactive_adapters)
        planned = factory.training_graph()
    return factory, planned


def plan_model(model, tp: int, *, dtype: Union[torch.dtype, str, None] = None, torch_dtype=None, revision=None,
               cache_dir=None, local_files_only=None, token=None, trust_remote_code: bool = False,
               sequence_parallel: bool = False, expert_parallel: Optional[bool] = None):
    """Plan only: capture, solve and rewrite for ``tp`` ranks without processes or weights.

    Returns (ShardingPlan, LocalGraph of rank 0). Only the config is read.
    """
    source = resolve_source(model, revision=revision, cache_dir=cache_dir, local_files_only=local_files_only,
                            token=token, trust_remote_code=trust_remote_code)
    dtype = resolve_dtype(dtype, torch_dtype, config=source.config)
    base = dataclasses.replace(source, adapter=None)
    meta = _meta_model(base, tp, dtype, trust_remote_code)
    experts = choose_experts(meta, tp, expert_parallel)
    options = PlanOptions(sequence_parallel=sequence_parallel, expert_parallel=experts.whole, experts_why=experts.why)
    factory = GraphFactory(base, meta, dtype, fake_group(tp), torch.device("cpu"), options, trust_remote_code)
    factory.pending_experts = experts if experts.pending else None
    _, planned = _first_graph(source, factory)
    return planned.plan, planned.local


def parallelize(model, tp_group, *, dtype: Union[torch.dtype, str, None] = None, torch_dtype=None, device=None,
                revision=None, cache_dir=None, local_files_only=None, token=None, trust_remote_code: bool = False,
                seed: int = 0, cp_group=None, sequence_parallel: bool = False, expert_parallel: Optional[bool] = None,
                skip_passes=(), plan=None, is_trainable: bool = False, ep_group=None) -> ParallelCausalLM:
    """Make a Hugging Face causal LM tensor-parallel over ``tp_group``.

    ``model``: hub id, local directory, PretrainedConfig or PreTrainedModel; or a PEFT LoRA adapter's
    directory or hub id (the base model from its ``base_model_name_or_path``; ``capture/adapters.py``), or a
    ``peft.PeftModel`` with one LoRA adapter: the
    base model is then frozen, and the adapter takes gradients with ``is_trainable=True`` (PEFT's
    ``PeftModel.from_pretrained`` argument; it is loaded for inference otherwise).
    ``dtype``: as transformers takes it (a torch.dtype, "bfloat16", "auto"; default: the
    checkpoint's); ``torch_dtype`` is its deprecated alias.
    ``tp_group``: ProcessGroup or 1-D DeviceMesh.
    ``cp_group``: optional context-parallel ProcessGroup or 1-D DeviceMesh (size > 1: each
    rank then takes its load-balanced chunks of every sequence and labels already
    shifted; see ``fxparallel/ops/context_parallel_attention.py``).
    Returns an nn.Module holding this rank's shards under the Hugging Face names,
    whose forward matches the single-device model; ``.plan`` is the ShardingPlan.
    ``sequence_parallel``: keep activations outside attention and MLP sharded along the
    sequence (same communication, less activation memory); the sequence length of every
    call must then divide by the tp size.
    ``expert_parallel``: True: each rank holds whole experts of every mixture-of-experts layer (experts
    [r*E/tp, (r+1)*E/tp) on rank r, the first ranks one more where tp does not divide E), reads only
    those, and computes them for every token routed to them; the block's one all-reduce sums them with
    the shared experts (``plan/rules/expert_rows.py``). With transformers' grouped_mm experts kernel (its
    default off CPU) a rank computes only its experts' rows; with batched_mm (on CPU) every rank computes
    every routed row, the others' with a stand-in expert, then masked. False: every expert split inside like
    a dense MLP. None (default): the planner chooses (``plan/expert_choice.py``: whole experts with grouped_mm
    where they plan at no more collectives and bytes than split experts, split inside otherwise) and
    ``model.plan.experts`` says which and why.
    ``ep_group``: optional ProcessGroup or 1-D DeviceMesh of data-parallel ranks (``fxparallel.runtime``'s
    ``mesh.ep_mesh``) over which the experts are spread: each holds its run of every stacked expert weight
    (after the tp split), and the rows routed to an expert travel to its rank and back by all-to-all
    (``ops/expert_exchange.py``; transformers' grouped_mm kernel; training with ``fxparallel.runtime``).
    ``skip_passes``: optional rewrite passes to leave out (``rewrite/passes.py``), e.g.
    ``("split_by_layer",)`` to run each graph as one piece (no per-layer FSDP units).
    ``plan``: a saved ShardingPlan (or the path of its JSON, from ``fxparallel plan --json`` or
    ``model.plan.save``) whose placements are applied instead of searched (``plan/saved.py``).

    Planned graphs are kept in the graph cache (``graph_cache/``) and read back by later calls and
    launches with the same model, rank, arguments and versions: then nothing is captured.
    """
    timings = {}
    t0 = time.perf_counter()
    group = resolve_tp_group(tp_group)
    cp = resolve_cp_group(cp_group)
    if cp is not None and sequence_parallel and group.size > 1:
        raise NotImplementedError("sequence_parallel together with context parallelism (cp_group) is not supported: "
                                  "use one of them")
    source = resolve_source(model, revision=revision, cache_dir=cache_dir, local_files_only=local_files_only,
                            token=token, trust_remote_code=trust_remote_code, is_trainable=is_trainable)
    dtype = resolve_dtype(dtype, torch_dtype, config=source.config)
    ep = resolve_group(ep_group, "ep_group", ShardingError) if ep_group is not None else None
    ep = ep if ep is not None and ep.size > 1 else None
    device = _choose_device(group, device, cp)
    source.config = source.config if ep is not None else _for_device(source.config, device)
    if cp is not None:
        context_parallel_checks.check_config(source.config)
    saved = read_plan(plan) if plan is not None else None
    base = dataclasses.replace(source, adapter=None)  # with an adapter: its base model is planned first
    meta = _meta_model(base, group.size, dtype, trust_remote_code)
    if ep is not None:
        check_experts_over_dp(meta, ep.size, tuple(a for a in (source.adapter, *source.inactive_adapters) if a))
    fixed = _saved_placements(saved, source, meta, group.size, dtype, trust_remote_code) if saved is not None else None
    experts = choose_experts(meta, group.size, expert_parallel, saved_whole_experts(meta, fixed))
    # resolve (download) the checkpoint before the capture, so a bad checkpoint fails early
    files = None
    if source.checkpoint is not None:
        files = resolve_checkpoint(source.checkpoint, source.hub_kwargs, group=group.process_group)
    timings["setup"] = time.perf_counter() - t0

    t = time.perf_counter()
    options = PlanOptions(fixed=fixed or {}, cp=cp, sequence_parallel=sequence_parallel,
                          expert_parallel=experts.whole, experts_why=experts.why, skip_passes=skip_passes, ep=ep)
    factory = GraphFactory(base, meta, dtype, group, device, options, trust_remote_code)
    factory.pending_experts = experts if experts.pending else None
    factory, planned = _first_graph(source, factory)
    sharding = planned.plan
    if saved is not None:
        check_applied(saved, sharding)
    timings.update(planned.timings)  # capture, solve, rewrite; or the graph cache's read
    timings["capture+plan+rewrite"] = time.perf_counter() - t

    # weights: everything that can fail on input runs before any shard is written
    runs = runs_of(sharding, stacked_expert_weights(meta), group.rank, group.size, ep) if ep is not None else None
    module = ParallelCausalLM(source.config, sharding, group, device, dtype, factory,
                              model_facts(factory.meta, source, sequence_parallel), planned.local, cp_group=cp,
                              ep_group=ep, expert_runs=runs)
    # each rank planned alone (its own graph cache and packages): refuse mismatched plans before reading weights
    t = time.perf_counter()
    check_plans_agree(sharding, (("tp_group", group), ("cp_group", cp), ("ep_group", ep)))
    timings["plan agreement"] = time.perf_counter() - t
    t = time.perf_counter()
    base_plan = without_adapters(sharding)  # the base model's parameters (all of them without an adapter)
    if files is not None:
        module.bytes_read = load_from_files(module, base_plan, files, group.rank, group.size, meta_model=meta)
    elif source.state_dict is not None:
        load_from_state_dict(module, base_plan, source.state_dict, group.rank, group.size)
    else:
        initialize(module, base_plan, source.config, group.rank, group.size, seed, dtype, source.model_class)
    if source.adapter is not None:  # the active one last: it sets which matrices take gradients
        for adapter in source.inactive_adapters + (source.adapter,):
            module.bytes_read = getattr(module, "bytes_read", 0) + load_adapter_weights(
                module, sharding, adapter, group.rank, group.size)
    timings["load"] = time.perf_counter() - t
    timings["total"] = time.perf_counter() - t0
    module.timings = timings
    return module
