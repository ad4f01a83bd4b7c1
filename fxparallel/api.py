"""``parallelize``: the lifecycle, one function per stage.

resolve source -> check splits -> capture (meta) -> solve -> rewrite -> plan -> load weights.
Timings of each stage are kept on the returned module (``model.timings``).
"""
from __future__ import annotations

import logging
import time
from typing import Optional

import torch
import torch.distributed as dist

from .capture import build_meta_model, capture
from .capture.dynamo import EXAMPLE_BATCH, EXAMPLE_SEQ
from .group import TPGroup, fake_group, resolve_tp_group
from .load import (default_dtype, initialize, load_from_files, load_from_state_dict, resolve_checkpoint,
                   resolve_source)
from .module import LocalGraph, ParallelCausalLM
from .plan.build import build_plan
from .plan.layout import ShardLayout
from .plan.solver import check_layer_symmetry, solve
from .plan.validate import check_divisible
from .rewrite import context_parallel, context_parallel_checks, localize, output_placements
from .rewrite.layer_units import generate_layered_forward
from .rewrite.local_graph import output_split_sizes

log = logging.getLogger("fxparallel")

TRAINING_ARGUMENTS = ("input_ids", "labels")
CONTEXT_PARALLEL_TRAINING_ARGUMENTS = ("input_ids", "position_ids", "labels")  # global positions per token


def _default_device(group: TPGroup) -> torch.device:
    pg = group.process_group
    if pg is not None and torch.cuda.is_available() and dist.get_backend(pg) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def plan_graph(meta_model, arguments, group: TPGroup, device, shape=(EXAMPLE_BATCH, EXAMPLE_SEQ), fixed=None,
               cp=None, sequence_parallel: bool = False):
    """Capture, solve and rewrite one graph. Returns (LocalGraph, GraphPlan, reduced values, captured).

    ``cp``: the context-parallel group (or None): labels arrive shifted and attention spans the cp ranks."""
    captured = capture(meta_model, arguments, shape=shape, labels_shifted=cp is not None)
    if cp is not None:
        kind = getattr(meta_model.config, "model_type", type(meta_model).__name__)
        context_parallel_checks.check_graph(captured, kind)
    # uneven splits by whole heads / columns / rows
    layout = ShardLayout.for_config(meta_model.config, group.size).add_embedding_rows(meta_model)
    gplan = solve(captured, group.size, fixed=fixed, layout=layout)
    placements = output_placements(captured, gplan)
    sizes = output_split_sizes(captured, gplan)
    reduced = localize(captured, gplan, group, device, sequence_parallel=sequence_parallel)
    if cp is not None:
        context_parallel.apply_context_parallel(captured.gm.graph, cp)
    forward, code, pieces = generate_layered_forward(captured.gm.graph, captured.params.values())
    local = LocalGraph(arguments=arguments, forward=forward, outputs=captured.outputs,
                       output_placements=placements, captured=captured, code=code, output_sizes=sizes,
                       pieces=pieces)
    return local, gplan, reduced, captured


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
    """The meta model of ``source``, after checking it can be split over ``tp`` ranks."""
    meta = build_meta_model(source.config, dtype=dtype, trust_remote_code=trust_remote_code,
                            model_class=source.model_class)
    check_divisible(source.config, tp, meta)
    return meta


def _plan_training_graph(meta, group: TPGroup, device, dtype, cp=None, sequence_parallel: bool = False):
    """Capture, solve and rewrite the training graph; returns (LocalGraph, GraphPlan, ShardingPlan)."""
    arguments = TRAINING_ARGUMENTS if cp is None else CONTEXT_PARALLEL_TRAINING_ARGUMENTS
    local, gplan, reduced, captured = plan_graph(meta, arguments, group, device, cp=cp,
                                                 sequence_parallel=sequence_parallel)
    asymmetric = check_layer_symmetry(gplan.params)
    if asymmetric:
        log.warning("layers with the same structure got different placements: %s", ", ".join(asymmetric))
    plan = build_plan(meta, captured, gplan, captured.gm.graph, reduced, group.size, dtype,
                      tokens=EXAMPLE_BATCH * EXAMPLE_SEQ, sequence_parallel=captured.sequence_parallel)
    captured.release()
    return local, gplan, plan


def plan_model(model, tp: int, *, dtype: Optional[torch.dtype] = None, revision=None, cache_dir=None,
               local_files_only=None, token=None, trust_remote_code: bool = False,
               sequence_parallel: bool = False):
    """Plan only: capture, solve and rewrite for ``tp`` ranks without processes or weights.

    Returns (ShardingPlan, LocalGraph of rank 0). Only the config is read.
    """
    source = resolve_source(model, revision=revision, cache_dir=cache_dir, local_files_only=local_files_only,
                            token=token, trust_remote_code=trust_remote_code)
    dtype = dtype or default_dtype(source.config)
    meta = _meta_model(source, tp, dtype, trust_remote_code)
    local, _, plan = _plan_training_graph(meta, fake_group(tp), torch.device("cpu"), dtype,
                                          sequence_parallel=sequence_parallel)
    return plan, local


def parallelize(model, tp_group, *, dtype: Optional[torch.dtype] = None, device=None, revision=None,
                cache_dir=None, local_files_only=None, token=None, trust_remote_code: bool = False,
                seed: int = 0, cp_group=None, sequence_parallel: bool = False) -> ParallelCausalLM:
    """Make a Hugging Face causal LM tensor-parallel over ``tp_group``.

    ``model``: hub id, local directory, PretrainedConfig or PreTrainedModel.
    ``tp_group``: ProcessGroup or 1-D DeviceMesh.
    ``cp_group``: optional context-parallel ProcessGroup or 1-D DeviceMesh (size > 1: each
    rank then takes its load-balanced chunks of every sequence and labels already
    shifted; see ``fxparallel/rewrite/context_parallel.py``).
    Returns an nn.Module holding this rank's shards under the Hugging Face names,
    whose forward matches the single-device model; ``.plan`` is the ShardingPlan.
    ``sequence_parallel``: keep activations outside attention and MLP sharded along the
    sequence (same communication, less activation memory); the sequence length of every
    call must then divide by the tp size.
    """
    timings = {}
    t0 = time.perf_counter()
    group = resolve_tp_group(tp_group)
    cp = context_parallel.resolve_cp_group(cp_group)
    if cp is not None and sequence_parallel and group.size > 1:
        raise NotImplementedError("sequence_parallel together with context parallelism (cp_group) is not supported: "
                                  "use one of them")
    source = resolve_source(model, revision=revision, cache_dir=cache_dir, local_files_only=local_files_only,
                            token=token, trust_remote_code=trust_remote_code)
    dtype = dtype or default_dtype(source.config)
    device = torch.device(device) if device is not None else _default_device(group)
    source.config = _for_device(source.config, device)
    if cp is not None:
        context_parallel_checks.check_config(source.config)
    meta = _meta_model(source, group.size, dtype, trust_remote_code)
    # resolve (download) the checkpoint before the capture, so a bad checkpoint fails early
    files = None
    if source.checkpoint is not None:
        files = resolve_checkpoint(source.checkpoint, source.hub_kwargs, group=group.process_group)
    timings["setup"] = time.perf_counter() - t0

    t = time.perf_counter()
    local, gplan, plan = _plan_training_graph(meta, group, device, dtype, cp, sequence_parallel)
    timings["capture+plan+rewrite"] = time.perf_counter() - t
    fixed = dict(gplan.params)

    def graph_factory(module, arguments, input_shape):
        shape = tuple(int(s) for s in input_shape)
        g, _, _, captured_again = plan_graph(meta, arguments, group, module.device_, shape=shape, fixed=fixed, cp=cp,
                                             sequence_parallel=sequence_parallel)
        captured_again.release()
        return g

    # weights: everything that can fail on input runs before any shard is written
    module = ParallelCausalLM(source.config, plan, group, device, dtype, graph_factory, cp_group=cp)
    module.sequence_parallel = sequence_parallel
    module.set_buffers(meta.fxparallel_buffers)
    module.add_graph(local)
    t = time.perf_counter()
    if files is not None:
        module.bytes_read = load_from_files(module, plan, files, group.rank, group.size, meta_model=meta)
    elif source.state_dict is not None:
        load_from_state_dict(module, plan, source.state_dict, group.rank, group.size)
    else:
        initialize(module, plan, source.config, group.rank, group.size, seed, dtype, source.model_class)
    timings["load"] = time.perf_counter() - t
    timings["total"] = time.perf_counter() - t0
    module.timings = timings
    return module
