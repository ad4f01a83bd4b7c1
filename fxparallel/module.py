"""The module ``parallelize`` returns: this rank's parameter shards under their
Hugging Face names, and the local graph(s) that run them.

One graph is captured per set of arguments given (labels or not, attention mask
or not, ...). A graph stays valid while the shape guards recorded at capture
hold (e.g. batch and sequence >= 2); a call outside them captures a new graph for
its shapes. Every graph reads the same parameter objects: nothing is
re-materialized.
"""
from __future__ import annotations

import dataclasses
import logging
import operator
from dataclasses import dataclass
from typing import Optional

import torch
from torch import nn
from transformers import PreTrainedModel
from transformers.generation import GenerationMixin
from transformers.modeling_outputs import CausalLMOutputWithPast

from . import (dcp_optimizer, fused_head, optimizer_checks, parallel_models, trainer_context_parallel,
               trainer_predictions)
from .data_parallel_guard import RefusesDistributedDataParallel
from .dcp_state import describe_state_dict
from .dtensor_parameters import dtensor_views
from .full_state_loading import shard_full_values
from .adapter_methods import AdapterMethods
from .capture.own_caches import padding_runs_through_states
from .capture.spec import GraphSpec
from .errors import ArgumentError, CacheNotCarried, PromptLengthFixed, ShardingError
from .graph_set import GraphSet
from .hf_methods import HuggingFaceMethods, refuse_arguments, refuse_inherited
from .inputs import ARGUMENTS, check_arguments, options_code
from .items_in_batch import check_items_in_batch, loss_over_items
from .model_facts import ModelFacts
from .router_outputs import (expert_counts_asked, loss_without_aux, router_logits_asked, split_router_logits,
                             whole_sequence_balancing, whole_sequence_counts)
from .shard_parameter import ShardParameter
from .trainer_counts import follow_trainer_tokens
from .uncalled_modules import parent_of
from .ops import collectives, context_parallel_attention
from .ops.local_graph import LocalGraph
from .ops.layer_units import install_layer_units

log = logging.getLogger("fxparallel")

# the output field holding the KV cache: ``cache`` from transformers 5.24 on (its ``past_key_values`` then logs a
# deprecation warning on every first use), ``past_key_values`` before
CACHE_FIELD = "cache" if "cache" in CausalLMOutputWithPast.__dataclass_fields__ else "past_key_values"


@dataclass
class ParallelCausalLMOutput(CausalLMOutputWithPast):
    """CausalLMOutputWithPast plus this rank's logits shard.

    ``logits`` holds the complete logits when they were gathered (the default when
    no labels are given, or with ``gather_logits=True``); otherwise it is None and
    ``local_logits`` holds this rank's vocabulary slice ``vocab_range``.
    """

    local_logits: Optional[torch.FloatTensor] = None
    vocab_range: Optional[tuple] = None
    aux_loss: Optional[torch.FloatTensor] = None  # with output_router_logits (router_outputs.py)
    router_logits: Optional[tuple] = None
    tokens_per_expert: Optional[torch.LongTensor] = None  # with output_tokens_per_expert: [MoE layers, experts]


class ParallelCausalLM(RefusesDistributedDataParallel, AdapterMethods, HuggingFaceMethods, PreTrainedModel,
                       GenerationMixin):
    """This rank's shards and the graphs that run them; the Hugging Face model methods it has (and the
    ones it refuses, saying what to do instead) are listed in ``hf_methods.py``."""

    def __init__(self, config, plan, group, device, dtype, factory=None, facts: ModelFacts = ModelFacts(),
                 first_graph: Optional[LocalGraph] = None, cp_group=None, ep_group=None,
                 expert_runs: Optional[dict] = None):
        """``factory``: captures new graphs (api.GraphFactory, from its meta model; None: a module of weights
        only); ``facts``: what the module needs to know of the model (model_facts.py); ``first_graph``: the
        training graph, planned with ``plan``; ``cp_group``: inputs are then this rank's chunks of each sequence
        (runtime/context_parallel_batches.py); ``ep_group`` and ``expert_runs``: the experts over data-parallel ranks
        and the run of each stacked expert weight this rank holds (load/expert_runs.py)."""
        nn.Module.__init__(self)  # not PreTrainedModel's: there is no single-device model behind this one
        self.config = config
        self.plan = plan
        self.tp_group = group
        self.cp_group = cp_group
        self.ep_group = ep_group
        self.expert_runs = dict(expert_runs or {})
        self.device_ = torch.device(device)
        self.dtype_ = dtype
        for name in (f.name for f in dataclasses.fields(facts)):  # see model_facts.py
            setattr(self, name, getattr(facts, name))
        self._graph_set = GraphSet(factory)  # every graph of this module (graph_set.py)
        # decoder layers as modules the graphs call, so FSDP can make each one a unit
        self._layer_paths, self._no_layer_units = install_layer_units(self, plan.params, parent_of)
        for p in plan.params:
            self._add_shard(p)
        # state_dict() handed to torch.distributed.checkpoint saves full-shape tensors (dcp_state.py)
        self.register_state_dict_post_hook(describe_state_dict)
        # load_state_dict of complete tensors (transformers' state dict, Trainer's resume): this rank's shards;
        # counted, and the count compared across the tp ranks at each call (inputs.py: a load on some ranks only)
        self._weights_loaded = 0
        self._balancing_checked = False  # the load-balancing function checked against the graph (router_outputs.py)
        self.register_load_state_dict_pre_hook(shard_full_values)
        # optimizers over its parameters: no whole-tensor optimizer or whole-shape state on the shards
        # (optimizer_checks.py), optimizer.state_dict() to DCP as full-shape state (dcp_optimizer.py)
        parallel_models.register(self)
        optimizer_checks.install_hook()
        dcp_optimizer.install_hook()
        # eval mode, as transformers' from_pretrained: the model's dropout applies after model.train()
        # (every graph reads self.training per call: ops/dropout_kernels.py)
        self.eval()
        if factory is not None:
            self.set_buffers(factory.meta.fxparallel_buffers)
        if first_graph is not None:
            self.add_graph(first_graph)

    def _replace_graphs(self, factory, planned, keep_plan: bool = False) -> None:
        """Drop every graph (their pieces in the layer modules too) for ``planned`` (a PlannedGraph of
        ``factory``'s training graph) and its plan: the model's graphs after a re-plan (an adapter attached or
        merged). ``keep_plan``: the parameters stay those of the current plan (an adapter disabled or enabled)."""
        self._graph_set.drop(factory)
        for path in self._layer_paths:
            getattr(self.get_submodule(path), "_pieces", {}).clear()
        if not keep_plan:
            self.plan = planned.plan
        self.add_graph(planned.local)

    def _add_shard(self, p) -> None:
        """Register this rank's shard of the planned parameter ``p`` (a ParamPlan) under each of its names."""
        group = self.tp_group
        kind = ShardParameter if group.size > 1 else nn.Parameter  # refuses per-rank clipping and inf checks
        shape = p.local_shape(group.size, group.rank)
        run = self.expert_runs.get(p.name)
        if run is not None:  # this rank's run of its shard's experts (dim 0)
            shape = (run[1],) + tuple(shape[1:])
        param = kind(torch.empty(shape, device=self.device_, dtype=self.dtype_))
        param._fxparallel = p  # type: ignore[attr-defined]
        if run is not None:  # (full tensors gather the runs over the ep group: runtime/dtensor.py, export.py)
            param._fxparallel_expert_run = run
            param._fxparallel_expert_group = self.ep_group
        for name in p.names:
            module, leaf = parent_of(self, name)
            module.register_parameter(leaf, param)

    # ---- graphs --------------------------------------------------------------
    def add_graph(self, graph: LocalGraph, shapes: Optional[dict] = None) -> None:
        """Add ``graph`` (captured for a call of ``shapes``, argument name -> shape, where given)."""
        self._check_pieces(graph)
        self._register_attributes(graph)
        if graph.pieces is not None:
            for path, forward in graph.pieces.forward.items():
                self.get_submodule(path).add_piece(graph.pieces.key, forward)
        self._graph_set.add(graph, shapes)

    def _check_pieces(self, graph: LocalGraph) -> None:
        if graph.pieces is None:
            from torch.distributed.fsdp import FSDPModule

            wrapped = [p for p in self._layer_paths if isinstance(self.get_submodule(p), FSDPModule)]
            if wrapped:
                raise ShardingError(
                    f"a new graph for arguments {graph.arguments} could not be split by decoder layer, but the "
                    f"layers ({wrapped[0]}, ...) are FSDP units that only its per-layer pieces can run")
            if self.is_gradient_checkpointing:
                raise ShardingError(
                    f"a new graph for arguments {graph.arguments} could not be split by decoder layer, so its layers "
                    f"cannot be recomputed: call model.gradient_checkpointing_disable() before this call")
            return
        unknown = sorted(set(graph.pieces.forward) - set(self._layer_paths))
        if unknown:
            raise ShardingError(f"graph pieces for {unknown} have no layer module (layers: {self._layer_paths})")

    def fsdp_units(self) -> list:
        """The decoder-layer modules FSDP wraps one by one (runtime/fsdp.py); [] when a graph is
        not split by layer (then only the root is a unit)."""
        if self._no_layer_units:
            log.warning("FSDP: root unit only: %s", self._no_layer_units)
            return []
        return self.layer_units()

    def layer_units(self, required_by: Optional[str] = None) -> list:
        """The decoder-layer modules every graph calls, in order; [] when a graph is not split by layer
        (an error naming ``required_by`` when given)."""
        if not len(self._graph_set) or any(g.pieces is None for g in self._graph_set):
            if required_by:
                why = self._no_layer_units or "its graph did not split by decoder layer (see parallelize's warning)"
                raise ShardingError(f"{required_by} works on decoder layers one by one, but this model has none: {why}")
            return []
        return [self.get_submodule(p) for p in self._layer_paths]

    def _register_attributes(self, graph: LocalGraph) -> None:
        for name, value in graph.attributes.items():
            object.__setattr__(self, name, value)  # not submodules: they hold no parameters of ours

    def graphs(self) -> list:
        return list(self._graph_set)

    def _graph_for(self, args: dict, cache=None, logits_to_keep: int = 0, unpadded: bool = False,
                   router_logits: bool = False, expert_counts: bool = False, token_mask: bool = False) -> LocalGraph:
        """The graph for these arguments (and KV cache, logits kept, a mask without padding, MoE outputs),
        captured on first use of an argument set or a shape outside every graph's guards; a shape seen before costs
        a dictionary lookup."""
        shapes = {k: tuple(v.shape) for k, v in args.items()}
        spec = GraphSpec(tuple(n for n in ARGUMENTS if n in args), shapes["input_ids"],
                         labels_shifted=self.cp_group is not None, logits_to_keep=logits_to_keep, unpadded=unpadded,
                         cache_length=cache.length if cache is not None else None, router_logits=router_logits,
                         expert_counts=expert_counts, token_mask=token_mask)
        if cache is not None and self.recurrent_cache and not cache.started:  # the recurrent states start here
            spec = dataclasses.replace(spec, fresh_cache=True)
        if cache is not None and self._graph_set.cache_refused is not None:
            raise self._graph_set.cache_refused
        if cache is not None and not cache.layout:  # its layout is that of any graph of its length
            known = self._graph_set.with_cache_length(cache.length)
            if known is None:
                known = self._cache_graph(dataclasses.replace(spec, unpadded=False))
                self.add_graph(known)
            cache.layout = dict(known.state)
        if cache is not None:  # the cache is checked at its full (captured) shapes
            batch = shapes["input_ids"][0]
            for name, (full, _, _) in cache.layout.items():
                shapes[name] = tuple(batch if s is None else s for s in full)
        graph = self._graph_set.find(spec, shapes)
        if graph is None and cache is not None and spec.shape[1] > 1 and \
                self._graph_set.fixes_prompt_length(spec, shapes) and \
                (self.recurrent_cache or getattr(self._graph_set.factory, "one_token_prompts", False)):
            # the graph of another prompt length does not serve this one, its guards fixing the length (Mamba's
            # scan, Jamba's): this and every later prompt goes token by token rather than get a graph per length
            raise PromptLengthFixed(f"{self.config.model_type}: a graph for {spec.shape[1]} tokens with a cache")
        if graph is None:
            graph = self._graph_set.factory(spec) if cache is None else self._cache_graph(spec)
            self.add_graph(graph, shapes)
        return graph

    def _tokens_one_at_a_time(self, args: dict, cache, logits_to_keep: int, router: bool, counts: bool):
        """A forward of several tokens with a cache whose code fixes their number (a graph per prompt length
        otherwise: Mamba's scan, xLSTM's chunks, Jamba's and MiniMax's prompts): the tokens one at a time, as
        transformers' decode steps continue the states. Two one-token graphs per cache length serve every prompt
        (the first token's on a fresh cache, the next ones'); the prompt fills the cache from slot 0 (a cache
        continued by several tokens, xLSTM's, reads no mask). A padding token's input must change no state, as
        the prompt's forward zeroes it (except where that forward runs padding through the states as any token,
        RecurrentGemma's: ``own_caches.padding_runs_through_states``; its steps then do too):

        * layers that need no mask over the cache (Mamba, xLSTM; capture/dynamo.py, ``one_token_prompts``): each
          token is given its own column of the attention mask (``GraphSpec.token_mask``), which the graph applies;
        * attention beside the recurrent layers (Jamba, Zamba, MiniMax): each token runs the decode step's graph
          with the whole mask, and a padding token's step leaves the recurrent states as they were (on a row
          padded on the left, as the prompt's forward leaves them: zero). Padding must then lead each row.

        Returns (the last graph, the outputs: the logits of every token, or of the last ``logits_to_keep``)."""
        ids, mask = args["input_ids"], args.get("attention_mask")
        asked = [name for name, on in (("labels", "labels" in args), ("output_router_logits", router),
                                       ("output_tokens_per_expert", counts)) if on]
        if asked:
            raise ArgumentError(
                f"{', '.join(asked)} on a forward of {ids.shape[1]} tokens with a cache: the code of "
                f"{self.config.model_type} fixes the number of tokens of such a forward, so the parallel model runs "
                f"them one at a time and returns their logits only; call it without the cache (use_cache=False)")
        by_column = mask is not None and self._graph_set.factory.one_token_prompts
        through = padding_runs_through_states(self.config.model_type)
        if through and mask is not None:
            _check_padding_through_states(mask[:, :ids.shape[1]], self.config)
        padded = [] if mask is None or by_column or through else \
            _padded_positions(mask[:, :ids.shape[1]], self.config.model_type)
        logits = []
        for p in range(ids.shape[1]):
            fresh = self.recurrent_cache and not cache.started
            step = {"input_ids": ids[:, p:p + 1]}
            if "position_ids" in args:
                step["position_ids"] = args["position_ids"][:, p:p + 1]
            if mask is not None:  # the fresh cache's graph takes the token's column of the whole mask itself
                step["attention_mask"] = mask[:, p:p + 1] if by_column and not fresh else mask
            graph = self._graph_for(step, cache, token_mask=by_column and not fresh)
            if not cache.allocated:  # (its layout is known once a graph with a cache is)
                cache.allocate(ids.shape[0], self.device_)
            states = cache.states() if p in padded else {}
            before = {name: tensor.clone() for name, (tensor, _) in states.items()}
            logits.append(self._run_graph(graph, step, cache)["logits"])
            cache.started = True
            token = mask[:, p] != 0 if states else None
            for name, (tensor, dim) in states.items():  # the padding rows' states as they were
                shape = [1] * tensor.dim()
                shape[dim] = -1
                tensor.copy_(torch.where(token.view(shape), tensor, before[name]))
        return graph, {"logits": torch.cat(logits[-logits_to_keep:] if logits_to_keep else logits, dim=1)}

    def _run_graph(self, graph: LocalGraph, args: dict, cache, compile_config=None) -> dict:
        """Run ``graph`` on ``args`` (and the cache's tensors, allocated for the batch on first use; ``args`` takes
        them); returns its outputs by name."""
        if cache is not None:
            if not cache.allocated:
                cache.allocate(args["input_ids"].shape[0], self.device_)
            args.update(cache.tensors)
        self._graph_set.last = graph
        run = graph.forward if compile_config is None else self._graph_set.compiled(graph, compile_config)
        return dict(zip(graph.outputs, run(self, **graph.read(args))))

    def _cache_graph(self, spec: GraphSpec) -> LocalGraph:
        """A new graph with a cache; a cache it cannot carry is refused once and remembered (each generate then
        recomputes without one at once: generation/recompute.py)."""
        try:
            return self._graph_set.factory(spec)
        except CacheNotCarried as err:
            self._graph_set.cache_refused = err
            raise

    @property
    def cache_refusal(self) -> Optional[str]:
        """Why this model cannot use a cache (``generate`` then recomputes the sequence at each step), once a
        generation or ``use_cache=True`` call has found it; None otherwise."""
        refused = self._graph_set.cache_refused
        return None if refused is None else str(refused)

    def _logits_to_keep(self, logits_to_keep, labels) -> int:
        """``logits_to_keep`` as the int the graphs are keyed by (None / False: 0, all positions), or why not."""
        if isinstance(logits_to_keep, torch.Tensor):
            raise TypeError("logits_to_keep as a tensor of positions is not supported by the parallel model: pass an "
                            "int k (the last k positions) and index out.logits for other positions")
        if logits_to_keep is None or logits_to_keep is False:
            return 0
        try:
            keep = operator.index(logits_to_keep) if logits_to_keep is not True else -1
        except TypeError:
            keep = -1
        if keep < 0:
            raise TypeError(f"logits_to_keep must be an int >= 0 (the last k positions; 0: all), got "
                            f"{logits_to_keep!r}")
        if keep and not self.takes_logits_to_keep:
            raise TypeError(f"logits_to_keep: the forward of {self.config.model_type} has no logits_to_keep argument; "
                            f"slice out.logits[:, -{keep}:] instead")
        if keep and self.cp_group is not None:
            raise ShardingError("logits_to_keep is not supported under context parallelism (cp_group): each cp rank "
                                "holds a chunk of the sequence, and the last positions are on the last cp rank")
        if keep and labels is not None:
            raise TypeError("logits_to_keep with labels: the loss needs the logits of every position; leave "
                            "logits_to_keep at 0 when passing labels")
        return keep

    def set_buffers(self, buffers: dict) -> None:
        for name, value in buffers.items():
            module, leaf = parent_of(self, name)
            module.register_buffer(leaf, value.to(self.device_), persistent=False)

    # ---- forward -------------------------------------------------------------
    def forward(self, input_ids=None, attention_mask=None, position_ids=None, labels=None, gather_logits=None,
                past_key_values=None, use_cache=None, return_dict=None, check_inputs=True, compile_config=None,
                logits_to_keep=0, num_items_in_batch=None, fused_lm_head=False, output_router_logits=None,
                output_tokens_per_expert=False, **unsupported):
        """The model's forward on this rank's shards: same arguments and outputs as the Hugging Face model
        (see docs/reference.md, "Output conventions"). ``use_cache=True`` (or a ``past_key_values`` from an
        earlier call) runs with a static KV cache sharded by heads (``generation/parallel_cache.py``) and returns
        it as ``past_key_values``; ``check_inputs=False`` skips the per-call checks (``inputs.py``), and with
        them the reading of an attention mask that could show it holds no padding (the graph then applies it)
        and the exchange that raises one rank's refusal on every rank (a refusal is then raised at once, on
        the rank given the argument alone);
        ``compile_config`` (transformers' ``CompileConfig``) runs the graph ``torch.compile``d with its options,
        compiled once per graph (``generate`` passes it for its decode steps); ``logits_to_keep=k`` (an int, as in
        transformers) computes the logits of the last k positions only (a graph of its own; 0: all);
        ``num_items_in_batch`` (transformers.Trainer's): the loss is the sum of this call's token losses divided
        by it, as transformers' loss computes it under gradient accumulation; ``fused_lm_head=True`` (with
        ``labels`` or ``shift_labels``), once TRL's ``add_fused_lm_head`` was applied: TRL's per-token outputs,
        computed across the vocabulary shards (``fused_head.py``); ``output_router_logits`` (None: the config's, as
        in transformers) on a mixture of experts: the loss holds the load-balancing term, ``aux_loss`` and
        ``router_logits`` are returned (``router_outputs.py``); ``output_tokens_per_expert=True``: the tokens routed
        to each expert of every MoE layer, ``tokens_per_expert`` [layers, experts], for any router."""
        # (shift_labels, TRL's, is read from the keywords: a parameter named like a label would make Trainer take it
        # for one of the model's label names, which every evaluation batch must then hold)
        shift_labels = unsupported.pop("shift_labels", None)
        if self.cp_group is not None or trainer_context_parallel.cut_by_torch():  # Trainer's cp step, or ours
            labels, shift_labels = trainer_context_parallel.step_labels(
                self, labels, shift_labels, fused_lm_head, in_trainer=dtensor_views(self) is not None,
                predicting=trainer_predictions.predicting(self.training, labels, gather_logits))
        if self.training and self.tp_group.size > 1:  # Trainer's token count, once per tp group (trainer_counts.py)
            follow_trainer_tokens(self.tp_group.size)
        if fused_lm_head or shift_labels is not None:
            return fused_head.forward_of(self)(
                input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, labels=labels,
                shift_labels=shift_labels, num_items_in_batch=num_items_in_batch, check_inputs=check_inputs,
                past_key_values=past_key_values, use_cache=use_cache, logits_to_keep=logits_to_keep,
                gather_logits=gather_logits, compile_config=compile_config, return_dict=return_dict, **unsupported)
        # Trainer's evaluate / predict read the output's fields as predictions: complete logits (trainer_predictions.py)
        predicting = trainer_predictions.predicting(self.training, labels, gather_logits)
        gather = predicting or ((labels is None) if gather_logits is None else bool(gather_logits))
        # the checks of this rank's own arguments: an error is raised only after the exchange in check_arguments,
        # so that an argument given to one rank only never leaves the others waiting in a collective (inputs.py)
        refused, cache, args, router, counts = None, None, {}, False, False
        try:
            refuse_arguments(unsupported)  # naming each and what to do instead (hf_methods.py)
            router = router_logits_asked(self, output_router_logits)
            counts = expert_counts_asked(self, output_tokens_per_expert)
            if not isinstance(input_ids, torch.Tensor):
                raise TypeError("input_ids is required" if input_ids is None else
                                f"input_ids must be a tensor of token ids, got {type(input_ids).__name__}")
            logits_to_keep = self._logits_to_keep(logits_to_keep, labels)
            check_items_in_batch(num_items_in_batch, labels)
            cache = self._cache_for(past_key_values, use_cache, input_ids, attention_mask)
            args = {k: v for k, v in (("input_ids", input_ids), ("attention_mask", attention_mask),
                                      ("position_ids", position_ids), ("labels", labels)) if v is not None}
            for name, value in args.items():
                if not isinstance(value, torch.Tensor):
                    raise TypeError(f"{name} must be a tensor, got {type(value).__name__}")
            args = {k: v.to(self.device_) for k, v in args.items()}
        except Exception as err:  # noqa: BLE001 - raised below, after the other ranks have heard of it
            if not check_inputs:
                raise
            refused, cache, logits_to_keep, router, counts = err, None, 0, False, False
        dropout = bool(self.dropout_rates) and self.training and cache is None
        unpadded = False  # an attention mask of all ones: attention as without one (capture/causal_mask.py)
        if check_inputs:
            unpadded = check_arguments(args, self.tp_group, self.vocab_rows, self.label_classes, dropout=dropout,
                                       mask_length=cache.length if cache is not None else None,
                                       options=options_code(gather, dropout, logits_to_keep,
                                                            cache.length if cache is not None else None, self.dtype_,
                                                            router, counts),
                                       refused=refused, device=self.device_, loads=self._weights_loaded)
            unpadded = unpadded and cache is None and self.cp_group is None
        if self.sequence_parallel and cache is None and input_ids.shape[-1] % self.tp_group.size:
            raise ShardingError(f"sequence_parallel: the sequence length {input_ids.shape[-1]} of input_ids "
                                f"{tuple(input_ids.shape)} does not divide by the tp size {self.tp_group.size}; "
                                f"pad the batch to a multiple of {self.tp_group.size}")
        if self.cp_group is not None:
            args = context_parallel_attention.prepare_arguments(args, self.cp_group, self.plan.model_type)
        graph, results = None, None
        if cache is not None and input_ids.shape[-1] > 1 and self._graph_set.prompt_by_token:
            graph, results = self._tokens_one_at_a_time(args, cache, logits_to_keep, router, counts)
        else:
            try:
                graph = self._graph_for(args, cache, logits_to_keep, unpadded, router, counts)
            except PromptLengthFixed:  # (every rank captures alike: all of them come here)
                self._graph_set.prompt_by_token = True
                graph, results = self._tokens_one_at_a_time(args, cache, logits_to_keep, router, counts)
        if results is None:
            results = self._run_graph(graph, args, cache, compile_config)
        if router and self.cp_group is not None:  # the load-balancing term of the whole sequences
            results = whole_sequence_balancing(self, results, input_ids.shape[0])
        if cache is not None:  # written: its recurrent states (if any) are continued from now on
            cache.started = True
        logits = results["logits"]
        placement = graph.output_placements.get("logits")
        local_logits, vocab_range = None, None
        if placement is not None and placement.is_shard:
            local, rank = logits.shape[placement.dim], self.tp_group.rank
            sizes = graph.output_sizes.get("logits")  # per-rank vocabulary sizes (uneven when tp does not divide it)
            start = sum(sizes[:rank]) if sizes else rank * local
            vocab_range = (start, start + local)
            uneven = (tuple(sizes),) if sizes and len(set(sizes)) > 1 else None
            local_logits = logits
            logits = collectives.all_gather(logits, placement.dim, self.tp_group.handle, None, uneven) if gather else None
            if predicting:  # transformers' fields only
                local_logits, vocab_range = None, None
        loss, aux_loss = results.get("loss"), results.get("aux_loss")
        if num_items_in_batch is not None and loss is not None and labels is not None:
            # transformers normalizes the language-model loss by the items and adds the load-balancing term after
            aux = 0.0 if aux_loss is None else self.router_aux_loss_coef * aux_loss
            loss = loss_over_items(loss_without_aux(loss, aux_loss, self.router_aux_loss_coef), args["labels"],
                                   num_items_in_batch, shifted=self.cp_group is not None) + aux
        out = ParallelCausalLMOutput(loss=loss, logits=logits, local_logits=local_logits,
                                     vocab_range=vocab_range, aux_loss=aux_loss,
                                     router_logits=split_router_logits(results.get("router_logits"),
                                                                       graph.output_placements.get("router_logits")),
                                     tokens_per_expert=whole_sequence_counts(results.get("tokens_per_expert"),
                                                                             self.cp_group),
                                     **{CACHE_FIELD: cache})
        return out if return_dict is not False else self._as_tuple(out, labels, gather_logits)

    @staticmethod
    def _as_tuple(out: "ParallelCausalLMOutput", labels, gather_logits) -> tuple:
        """``return_dict=False``: transformers' tuple, (loss, logits, cache) without the ones that are None, so
        that each position holds what it holds for the transformers model. Logits that were not gathered are
        refused: this rank's vocabulary shard must never sit where the logits are read."""
        if out.logits is None:
            why = ("with labels the logits stay sharded by default" if labels is not None and gather_logits is None
                   else "gather_logits=False leaves them sharded")
            raise ArgumentError(
                "return_dict=False returns transformers' tuple (loss, logits, ...), but this call's logits were not "
                f"gathered ({why}; each rank holds its vocabulary shard): pass gather_logits=True for the complete "
                "logits in the tuple, or leave return_dict unset and read the ParallelCausalLMOutput's .loss and "
                ".local_logits (this rank's vocabulary rows .vocab_range)")
        return tuple(v for v in (out.loss, out.aux_loss, out.logits, getattr(out, CACHE_FIELD), out.router_logits,
                                 out.tokens_per_expert) if v is not None)

    def _cache_for(self, past_key_values, use_cache, input_ids, attention_mask):
        """The KV cache of this call: the one given, a new one (``use_cache=True``), or None."""
        from .generation.parallel_cache import ParallelCache, cache_length

        if past_key_values is not None:
            if not isinstance(past_key_values, ParallelCache):
                raise TypeError(f"past_key_values must be the ParallelCache an earlier call returned (or that "
                                f"model.new_cache() makes), got {type(past_key_values).__name__}")
            if use_cache is False:
                raise TypeError("past_key_values was given with use_cache=False")
            if past_key_values.started and self.recurrent_cache and input_ids.shape[-1] > 1:
                raise ShardingError(
                    f"a forward of {input_ids.shape[-1]} tokens on a cache already written, whose linear-attention / "
                    f"state-space layers keep recurrent states ({self.config.model_type}): the parallel model "
                    f"continues those states one token at a time only; pass the tokens one per call, or all "
                    f"of them in the cache's first forward")
            return past_key_values
        if not use_cache:
            return None
        if self.cp_group is not None:
            raise ShardingError("use_cache is not supported under context parallelism (cp_group)")
        if attention_mask is not None and attention_mask.shape[-1] != input_ids.shape[-1]:
            return ParallelCache(attention_mask.shape[-1])  # the mask spans the cache: its length is the cache's
        return ParallelCache(cache_length(input_ids.shape[-1]))

    def new_cache(self, length: int):
        """A static KV cache of ``length`` tokens for ``forward(..., past_key_values=cache)``; the attention
        mask of every call with it must then span the whole cache ([batch, length]: 1 for tokens to attend
        to, positions not yet written included)."""
        from .generation.parallel_cache import ParallelCache

        return ParallelCache(length)

    def output_sizes(self, name: str):
        """Per-rank sizes along the sharded dim of output ``name`` of the last call (uneven splits)."""
        last = self._graph_set.last
        return last.output_sizes.get(name) if last is not None else None

    # ---- Hugging Face model behaviour (the rest: hf_methods.py) ----------------
    def gradient_checkpointing_enable(self, gradient_checkpointing_kwargs=None, mode: str = "full",
                                      every_n_layers: int = 1, offload: bool = False):
        """Recompute each decoder layer in the backward pass (training mode only, as in transformers);
        ``mode="selective"`` keeps the layers' matrix products: ``runtime/activation_checkpointing.py``.
        ``every_n_layers=n`` (transformers 5's) checkpoints layers 0, n, 2n, ... only."""
        from .runtime import activation_checkpointing

        activation_checkpointing.enable(self, mode, gradient_checkpointing_kwargs, every_n_layers, offload)

    def activation_checkpointing_enable(self, activation_checkpointing_kwargs=None, every_n_layers: int = 1,
                                        offload: bool = False, mode: str = "full"):
        """transformers 5's name (and arguments, as ``Trainer`` passes them) of ``gradient_checkpointing_enable``."""
        self.gradient_checkpointing_enable(activation_checkpointing_kwargs, mode, every_n_layers, offload)

    def gradient_checkpointing_disable(self):
        from .runtime import activation_checkpointing

        activation_checkpointing.disable(self)

    activation_checkpointing_disable = gradient_checkpointing_disable

    @property
    def is_gradient_checkpointing(self) -> bool:
        return any(getattr(self.get_submodule(p), "checkpoint", None) is not None for p in self._layer_paths)

    is_activation_checkpointing = is_gradient_checkpointing  # transformers 5's name

    def generate(self, input_ids=None, attention_mask=None, generation_config=None, streamer=None, **kwargs):
        """transformers' ``generate`` for decoder-only models (greedy search and sampling) on the parallel
        model, with a static KV cache sharded by heads: see ``generation/loop.py``. Every rank returns the
        same tokens."""
        from .generation.loop import generate

        return generate(self, input_ids, attention_mask=attention_mask, generation_config=generation_config,
                        streamer=streamer, **kwargs)

    @property
    def cp_size(self) -> int:
        return 1 if self.cp_group is None else self.cp_group.size


refuse_inherited(ParallelCausalLM)


def _check_padding_through_states(prompt_mask: torch.Tensor, config) -> None:
    """A padded prompt of a model whose prompt forward runs padding through its states (RecurrentGemma), run token
    by token: a padding token's query attends no key, and what attention gives it then enters the states of the
    recurrent blocks after that layer. SDPA gives such a row the same in the prompt's forward and in a step (checked
    at TP=2 against transformers, tests/test_coverage.py); eager attention averages the values of every key the
    forward holds, the prompt's later tokens included, which a step cannot know: refused by name (a host read of
    the mask, once per prompt)."""
    implementation = getattr(config, "_attn_implementation", None)
    if implementation != "sdpa" and bool((prompt_mask == 0).any()):
        raise ArgumentError(
            f"attention_mask: the prompt has padding, and {config.model_type} runs padding through its recurrent "
            f"states with attn_implementation={implementation!r}: the parallel model runs its prompts one token at a "
            f"time (its code fixes the number of tokens of a forward with a cache), where a padding token's attention "
            f"cannot give what the prompt's forward gives it (an average over every token of the prompt, later ones "
            f"included) and the recurrent blocks after it would take other states; use SDPA attention (transformers' "
            f"default; the config's attn_implementation), or generate each prompt unpadded")


def _padded_positions(prompt_mask: torch.Tensor, model_type: str) -> list:
    """The prompt's positions where some row is padding (0 in ``prompt_mask``, [batch, tokens]), read once per
    prompt; refused where a row's padding does not lead it (its tokens would be run as if the padding were not
    there, where the prompt's forward lets the states decay across it)."""
    present = prompt_mask != 0
    padding_after_token = (present[:, :-1] & ~present[:, 1:]).any(1)
    if bool(padding_after_token.any()):
        rows = torch.nonzero(padding_after_token).flatten().tolist()
        raise ArgumentError(
            f"attention_mask: row(s) {rows} of the prompt have padding after a token; the parallel model runs the "
            f"prompts of {model_type} (whose code fixes the number of tokens of a forward with a cache) one token at "
            f"a time, which takes padding on the left only (tokenizer.padding_side = 'left', as for generation)")
    return torch.nonzero((~present).any(0)).flatten().tolist()
