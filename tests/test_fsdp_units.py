"""Per-decoder-layer FSDP2 units: each layer is all-gathered only while it runs.

One spawn of 4 ranks: tp=2 x dp=2 (Qwen3) on all four, then tp=1 x dp=2 (Llama) on ranks 0-1 (in a process
group of their own), both with tied embeddings. Against the single-process
transformers model: the number of units (layers + root), that inside a layer's forward no
other layer is unsharded (the same probe sees every layer unsharded with root-only
wrapping), loss and every gradient (1e-5), a few AdamW steps, a graph captured after
wrapping (no labels), greedy generate before training (each dp rank its own prompts and lengths: transformers'
tokens), bf16 mixed precision (fp32 parameters, gradients and AdamW moments); replicate mode and root-only
wrapping (in bf16, bit-identical to bf16 per-layer) at tp=1 only, to keep the test short; and that
the graph split alone (no FSDP) gives bit-identical numbers to the unsplit graph.
"""
from __future__ import annotations

import logging

import pytest
import torch

from checks import as_numpy, full_values, max_diff
from distributed import free_port, run_ranks

LAYERS = 2
GLOBAL_BATCH, SEQ = 4, 16
STEPS = 3
LR = 1e-3
TOL = 1e-5
PARAM_TOL = 3e-5  # parameters after AdamW steps: Adam's normalization amplifies 1e-7 gradient noise
# bf16 vs the fp32 reference: bf16 keeps 8 significant bits (relative rounding up to 2^-9 = 2e-3 per
# value); the loss (about 4.8) is a mean of such rounded terms, so 2^-9 relative of it (1e-2) bounds it
BF16_LOSS_TOL = 1e-2


# ---- inside ranks ----------------------------------------------------------------------
def _batches(mesh):
    from fxparallel.runtime import StepBatches, pack_tokens, synthetic_token_stream

    rows = pack_tokens(synthetic_token_stream(128, 20 * SEQ, seed=5, mean_doc_len=12), SEQ)
    return StepBatches(rows, GLOBAL_BATCH, mesh.dp_rank, mesh.dp)


def _probe(model):
    """After each layer's FSDP pre-forward: the layers whose parameters are not sharded DTensors."""
    from torch.distributed.tensor import DTensor

    from fxparallel.ops.layer_units import LayerUnit

    layers = {name: m for name, m in model.named_modules() if isinstance(m, LayerUnit)}
    seen = []

    def hook(name):
        def record(module, args):
            seen.append((name, sorted(n for n, m in layers.items()
                                      if any(not isinstance(p, DTensor) for p in m.parameters()))))
        return record

    for name, m in layers.items():
        m.register_forward_pre_hook(hook(name))  # FSDP's own pre-hook is prepended: it ran already
    return seen


def _parallelize(path, mesh, **kwargs):
    """``fxparallel.parallelize`` over the mesh's tp group: the first dp replica plans (into the graph cache), the
    others then read its graphs (as tests/test_fused_checkpoint.py does)."""
    import torch.distributed as dist

    import fxparallel

    if mesh.dp_rank:
        dist.barrier()
    model = fxparallel.parallelize(path, mesh.tp_mesh, **kwargs)
    if not mesh.dp_rank:
        dist.barrier()
    return model


def _prompts(dp_rank: int):
    """Each dp rank's prompts (the second row left-padded; a length of its own) and new tokens (dp rank 0 stops
    first, then steps with the other: FSDP all-gathers in every forward, generation/forward_peers.py)."""
    ids = torch.randint(3, 100, (2, 4 + 3 * dp_rank), generator=torch.Generator().manual_seed(dp_rank))
    mask = torch.ones_like(ids)
    mask[1, :2] = 0
    return ids, mask, 2 + 3 * dp_rank


def _fsdp_run(path, mesh, mode="shard", mixed=None, per_layer=True, later_graph=False):
    """Wrap, step once (grads), step twice more (AdamW); with ``later_graph`` first a greedy generate of this dp
    rank's prompts (its graphs captured after wrapping; the optimizer made after it), and at the end a forward
    without labels (a graph captured after wrapping)."""
    from torch.distributed.fsdp import FSDPModule

    from fxparallel.runtime import apply_data_parallel, train_step

    dtype = torch.bfloat16 if mixed else torch.float32
    model = _parallelize(path, mesh, dtype=dtype)
    model = apply_data_parallel(model, mesh, mode=mode, mixed_precision=mixed, per_layer=per_layer)
    if later_graph:
        from transformers import CompileConfig

        from checks import raised

        ids, mask, new = _prompts(mesh.dp_rank)
        generated = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new).tolist()
        compiled = raised(lambda: model.generate(input_ids=ids, max_new_tokens=2, compile_config=CompileConfig()))
    seen = _probe(model)
    params = list(model.parameters())
    opt = torch.optim.AdamW(params, lr=LR)
    data = _batches(mesh)
    out = {"units": model._fxparallel_data_parallel.units,
           "fsdp_modules": sum(isinstance(m, FSDPModule) for m in model.modules()), "losses": []}
    for step in range(STEPS):
        out["losses"].append(train_step(model, opt, data.batch(step), mesh).loss)
        if step == 0:
            out["grads"] = as_numpy(full_values(model, mesh, lambda p: p.grad))
            out["seen_train"] = list(seen)
            if later_graph and mesh.tp > 1:  # torch's clipping of FSDP's chunks: each tp rank's own norm, refused
                out["torch clip"] = {"list": raised(lambda: torch.nn.utils.clip_grad_norm_(params, 1.0)),
                                     "parameters()": raised(lambda: torch.nn.utils.clip_grad_norm_(
                                         model.parameters(), 1.0)),
                                     "grads kept": max_diff(as_numpy(full_values(model, mesh, lambda p: p.grad)),
                                                            out["grads"])}
    out["params"] = as_numpy(full_values(model, mesh))
    out["dtypes"] = sorted({str(t.dtype) for p in model.parameters()  # parameters, gradients, AdamW moments
                            for t in (p, p.grad, *(v for v in opt.state[p].values() if v.dim()))})
    if not later_graph:
        return out
    seen.clear()
    graphs = len(model.graphs())
    out["logits"] = model(input_ids=data.global_batch_at(STEPS)["input_ids"]).logits.detach().float().numpy()
    out["new_graphs"] = len(model.graphs()) - graphs
    out["seen_logits"] = list(seen)
    out["generated"], out["dp_rank"], out["compiled"] = generated, mesh.dp_rank, compiled
    out["optimizer"] = _complete_optimizer_state(model, opt)
    return out


def _complete_optimizer_state(model, opt) -> dict:
    """torch's ``get_optimizer_state_dict(full_state_dict=True)`` (AdamW's exp_avg, complete), and, loaded back into
    the optimizer with its states zeroed, whether each rank's states are its own again."""
    from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_optimizer_state_dict,
                                                         set_optimizer_state_dict)

    from fxparallel.runtime.fsdp import reshard

    reshard(model)  # the sharded parameters the optimizer holds, after the forward without labels
    full = StateDictOptions(full_state_dict=True)
    complete = get_optimizer_state_dict(model, opt, options=full)
    own = [{k: v.to_local().clone() for k, v in state.items() if v.dim()} for state in opt.state.values()]
    for state in opt.state.values():
        for value in state.values():
            if value.dim():
                value.to_local().zero_()
    set_optimizer_state_dict(model, opt, optim_state_dict=complete, options=full)
    back = all(torch.equal(state[k].to_local(), v) for state, mine in zip(opt.state.values(), own)
               for k, v in mine.items())
    return {"exp_avg": {name: state["exp_avg"].numpy() for name, state in complete["state"].items()},
            "loaded back": back}


def _split_vs_whole(path, mesh):
    """Plain parallelize (no FSDP), graph split by layer or kept whole: logits, loss, every gradient.
    Returns the differences and the split model."""
    ids = _batches(mesh).global_batch_at(0)["input_ids"]
    results = {}
    for split in (True, False):
        model = _parallelize(path, mesh, dtype=torch.float32, skip_passes=() if split else ("split_by_layer",))
        out = model(input_ids=ids, labels=ids)
        out.loss.backward()
        results[split] = {"model": model, "loss": out.loss.detach(), "logits": model(input_ids=ids).logits.detach(),
                          "grads": {n: p.grad for n, p in model.named_parameters()},
                          "units": len(model.fsdp_units()), "pieces": model.graphs()[0].pieces is not None}
    a, b = results[True], results[False]
    return {"units": (a["units"], b["units"]), "pieces": (a["pieces"], b["pieces"]),
            "loss": (a["loss"] - b["loss"]).abs().item(), "logits": (a["logits"] - b["logits"]).abs().max().item(),
            "grads": max((a["grads"][n] - b["grads"][n]).abs().max().item() for n in a["grads"])}, a["model"]


def _unsplit_graph_is_refused(model, mesh):
    """A later graph that could not be split cannot run on FSDP layer units: clear error."""
    import dataclasses

    from fxparallel.errors import ShardingError
    from fxparallel.runtime import apply_data_parallel

    for p in model.parameters():
        p.grad = None
    model = apply_data_parallel(model, mesh)
    factory = model._graph_set.factory
    options = factory.options
    factory.options = dataclasses.replace(options, skip_passes=("split_by_layer",))  # the next graph stays whole
    try:
        model(input_ids=torch.zeros(2, 8, dtype=torch.long), attention_mask=torch.ones(2, 8, dtype=torch.long))
    except ShardingError as err:
        return str(err)
    finally:
        factory.options = options
    return None


def _world4(mesh, path):
    return {"layers": _fsdp_run(path, mesh, later_graph=True), "bf16": _fsdp_run(path, mesh, mixed="bf16"),
            "split": _split_vs_whole(path, mesh)[0]}


def _world2(mesh, path):
    split, model = _split_vs_whole(path, mesh)
    # root-only wrapping runs in bf16 only: bit-identical to per-layer bf16, which is checked against one process
    return {"layers": _fsdp_run(path, mesh, later_graph=True), "replicate": _fsdp_run(path, mesh, mode="replicate"),
            "bf16": _fsdp_run(path, mesh, mixed="bf16"),
            "root_only": _fsdp_run(path, mesh, mixed="bf16", per_layer=False),
            "split": split, "refused": _unsplit_graph_is_refused(model, mesh)}


def _every_case(rank, world, paths):
    """tp=2 x dp=2 (Qwen3) on all four ranks; then ranks 0-1 leave that job for one of two ranks (a new process
    group on a port rank 0 picks: init_mesh spans the whole job, and the runtime reduces over it) and run
    tp=1 x dp=2 (Llama) in it."""
    import datetime
    import os

    import torch.distributed as dist

    from fxparallel.runtime import init_mesh

    out = {"world4": _world4(init_mesh(tp=2, dp=2, cp=1), paths["qwen3"])}
    port = [free_port() if rank == 0 else None]
    dist.broadcast_object_list(port, src=0)
    dist.barrier()  # every rank is done with the job of four
    if rank >= 2:
        return out
    dist.destroy_process_group()
    os.environ.update(MASTER_PORT=str(port[0]), WORLD_SIZE="2")
    dist.init_process_group("gloo", rank=rank, world_size=2, timeout=datetime.timedelta(seconds=120))
    out["world2"] = _world2(init_mesh(tp=1, dp=2, cp=1), paths["llama"])
    return out


# ---- the single-process reference ------------------------------------------------------
def _reference(path):
    from transformers import AutoModelForCausalLM

    from fxparallel.runtime import StepBatches, pack_tokens, synthetic_token_stream

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    ref = {"generated": [model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new,
                                        do_sample=False).tolist() for ids, mask, new in map(_prompts, range(2))]}
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    rows = pack_tokens(synthetic_token_stream(128, 20 * SEQ, seed=5, mean_doc_len=12), SEQ)
    data = StepBatches(rows, GLOBAL_BATCH, 0, 1)
    ref["losses"] = []
    for step in range(STEPS):
        opt.zero_grad()
        batch = data.global_batch_at(step)
        loss = model(input_ids=batch["input_ids"], labels=batch["input_ids"]).loss
        loss.backward()
        if step == 0:
            ref["grads"] = {n: p.grad.clone() for n, p in model.named_parameters()}
        opt.step()
        ref["losses"].append(loss.item())
    ref["params"] = {n: p.detach().clone() for n, p in model.named_parameters()}
    ref["exp_avg"] = {n: opt.state[p]["exp_avg"].clone() for n, p in model.named_parameters()}
    with torch.no_grad():
        ref["logits"] = model(input_ids=data.global_batch_at(STEPS)["input_ids"]).logits
    return ref


@pytest.fixture(scope="module")
def paths(tmp_path_factory):
    from models import save_checkpoint, tiny_config

    root = tmp_path_factory.mktemp("fsdp_units")
    # tied embeddings: the shared weight stays on the root unit. Qwen3 (at tp=2): its q/k norm weights
    # get a gradient all-reduce the rewrite hoists to the top; it must run inside the layer's piece.
    return {family: save_checkpoint(tiny_config(family, tie_word_embeddings=True, num_hidden_layers=LAYERS),
                                    str(root / family)) for family in ("llama", "qwen3")}


@pytest.fixture(scope="module")
def references(paths):
    return {family: _reference(path) for family, path in paths.items()}


@pytest.fixture(scope="module")
def on_ranks(paths):
    return run_ranks(4, _every_case, paths, timeout=900)


@pytest.fixture(scope="module")
def world4(on_ranks):
    return [r["world4"] for r in on_ranks]


@pytest.fixture(scope="module")
def world2(on_ranks):
    world2 = [r["world2"] for r in on_ranks if "world2" in r]
    assert len(world2) == 2
    return world2


FAMILY = {"tp2xdp2": "qwen3", "tp1xdp2": "llama"}


def _runs(world4, world2, key):
    return [("tp2xdp2", r[key]) for r in world4 if key in r] + [("tp1xdp2", r[key]) for r in world2 if key in r]


# ---- tests -----------------------------------------------------------------------------
def test_one_unit_per_layer_plus_root(world4, world2):
    for layout, run in _runs(world4, world2, "layers") + _runs(world4, world2, "replicate"):
        assert run["units"] == LAYERS + 1 and run["fsdp_modules"] == LAYERS + 1, layout
    for _, run in _runs(world4, world2, "root_only"):
        assert run["units"] == 1 and run["fsdp_modules"] == 1


def test_only_the_running_layer_is_unsharded(world4, world2):
    expected = [(f"model.layers.{i}", [f"model.layers.{i}"]) for i in range(LAYERS)]
    for layout, run in _runs(world4, world2, "layers") + _runs(world4, world2, "replicate"):
        assert run["seen_train"] == expected, (layout, run["seen_train"])  # the training graph
        if "seen_logits" in run:
            assert run["seen_logits"] == expected, (layout, run["seen_logits"])  # a graph captured later
    everything = [f"model.layers.{i}" for i in range(LAYERS)]
    for _, run in _runs(world4, world2, "root_only"):  # the probe fails for root-only wrapping
        assert run["seen_train"] == [(f"model.layers.{i}", everything) for i in range(LAYERS)]


def test_training_matches_single_process(world4, world2, references):
    runs = _runs(world4, world2, "layers") + _runs(world4, world2, "replicate")
    for layout, run in runs:
        reference = references[FAMILY[layout]]
        for loss, ref in zip(run["losses"], reference["losses"]):
            assert abs(loss - ref) < TOL, (layout, run["losses"], reference["losses"])
    for layout, per_rank in (("tp2xdp2", world4), ("tp1xdp2", world2)):
        reference = references[FAMILY[layout]]
        for key in ("layers", "replicate"):
            if key not in per_rank[0]:
                continue
            run = per_rank[0][key]  # full tensors are the same on every rank
            assert max_diff(run["grads"], reference["grads"]) < TOL, key  # every parameter, first step
            assert max_diff(run["params"], reference["params"]) < PARAM_TOL, key  # after the AdamW steps
            if key == "layers":  # logits from a graph captured after wrapping
                assert run["new_graphs"] == 1
                assert (torch.as_tensor(run["logits"]) - reference["logits"]).abs().max().item() < TOL, key


def test_torch_clipping_of_fsdp_chunks_is_refused(world4):
    """At tp 2 x dp 2 FSDP's DTensors span the dp ranks only: torch's ``clip_grad_norm_`` over a list of them would
    clip each tp rank by its own norm. Refused (over ``model.parameters()`` too), naming runtime.clip_grad_norm_,
    before any gradient changes."""
    for per_rank in world4:
        clip = per_rank["layers"]["torch clip"]
        assert clip["list"].startswith("ArgumentError: torch.nn.utils.clip_grad_norm_ reached FSDP's chunk of a "
                                       "tensor-parallel shard (model.") and \
            "fxparallel.runtime.clip_grad_norm_(model, max_norm, mesh)" in clip["list"], clip
        assert "fxparallel.runtime.clip_grad_norm_" in clip["parameters()"], clip
        assert clip["grads kept"] == 0.0, clip


def test_generate_under_fsdp_gives_transformers_tokens(world4, world2, references):
    """Each dp rank its own prompts and new tokens; the rank that stops first steps on with the other, whose
    forwards all-gather over both (and training afterwards matches one process: test_training_matches...)."""
    for layout, run in _runs(world4, world2, "layers"):
        assert run["generated"] == references[FAMILY[layout]]["generated"][run["dp_rank"]], (layout, run["dp_rank"])
        assert run["compiled"].startswith("InputError: generate: compile_config under FSDP"), run["compiled"]


def test_complete_optimizer_state_and_back(world4, world2, references):
    """torch's helpers with ``full_state_dict=True`` under FSDP: the complete AdamW moments of one process (at tp=2
    gathered over dp, then tp: dcp_optimizer.py), and loaded back, each rank's own states (its tp shard's FSDP chunk)."""
    for layout, run in _runs(world4, world2, "layers"):
        reference = references[FAMILY[layout]]["exp_avg"]
        got = run["optimizer"]
        assert sorted(got["exp_avg"]) == sorted(reference) and got["loaded back"], layout
        assert max((torch.as_tensor(v) - reference[n]).abs().max().item() for n, v in got["exp_avg"].items()) < TOL


def test_bf16_mixed_precision(world4, world2, references):
    for layout, layers in _runs(world4, world2, "bf16"):
        assert layers["dtypes"] == ["torch.float32"], (layout, layers["dtypes"])  # bf16 compute, fp32 masters
        reference = references[FAMILY[layout]]
        for loss, ref in zip(layers["losses"], reference["losses"]):
            assert abs(loss - ref) < BF16_LOSS_TOL, (layout, layers["losses"], reference["losses"])
        assert layers["seen_train"] == [(f"model.layers.{i}", [f"model.layers.{i}"]) for i in range(LAYERS)]
    for r in world2:
        layers, root_only = r["bf16"], r["root_only"]
        # same bf16 graph, same ops in the same order: per-layer units change nothing numerically
        assert layers["losses"] == root_only["losses"]
        assert max_diff(layers["grads"], root_only["grads"]) == 0.0
        assert max_diff(layers["params"], root_only["params"]) == 0.0


def test_graph_split_alone_changes_nothing(world4, world2):
    for layout, split in _runs(world4, world2, "split"):
        assert split["units"] == (LAYERS, 0) and split["pieces"] == (True, False), layout
        assert split["loss"] == 0.0 and split["logits"] == 0.0 and split["grads"] == 0.0, (layout, split)


def test_unsplit_later_graph_is_refused_on_layer_units(world2):
    for r in world2:
        assert r["refused"] is not None and "could not be split by decoder layer" in r["refused"], r["refused"]


# ---- the splitter on its own -------------------------------------------------------------
def test_layer_container_is_found_from_names():
    from fxparallel.capture.graph import layer_container
    from fxparallel.ops.layer_units import layer_of

    llama = ["model.embed_tokens.weight", "model.layers.0.mlp.up_proj.weight", "model.layers.1.mlp.up_proj.weight",
             "model.norm.weight"]
    assert layer_container(llama) == "model.layers"
    gpt2 = ["transformer.wte.weight", "transformer.h.0.attn.c_attn.weight", "transformer.h.1.attn.c_attn.weight"]
    assert layer_container(gpt2) == "transformer.h"
    moe = ["model.layers.0.mlp.experts.0.w1", "model.layers.0.mlp.experts.1.w1", "model.layers.0.attn.q.weight",
           "model.layers.1.mlp.experts.0.w1", "model.layers.1.mlp.experts.1.w1", "model.layers.1.attn.q.weight"]
    assert layer_container(moe) == "model.layers"
    assert layer_of("model.layers.0.mlp.experts.1.w1", "model.layers") == "model.layers.0"
    assert layer_container(["embed.weight", "head.weight"]) is None


def test_layer_units_are_the_layers_the_forward_runs():
    # a multimodal causal LM (Gemma 3): its vision tower has more layers than the language model,
    # but a text forward never reads them, so the units are the language model's layers
    from torch import nn

    from fxparallel.plan.plan import UNUSED, ParamPlan
    from fxparallel.ops.layer_units import install_layer_units
    from fxparallel.uncalled_modules import parent_of

    vision = [ParamPlan(f"model.vision_tower.layers.{i}.fc.weight", (4, 4), "R", UNUSED) for i in range(4)]
    text = [ParamPlan(f"model.language_model.layers.{i}.mlp.up_proj.weight", (4, 4), "S(0)", "column")
            for i in range(2)]
    paths, why_not = install_layer_units(nn.Module(), vision + text, parent_of)
    assert paths == ["model.language_model.layers.0", "model.language_model.layers.1"] and why_not is None


def test_interleaved_layers_keep_the_graph_whole(caplog):
    import torch.fx as fx

    from fxparallel.rewrite.split_by_layer import SplitError, generate_layered_forward, split_by_layer

    g = fx.Graph()
    x = g.placeholder("x")
    w0, w1 = g.get_attr("layers.0.w"), g.get_attr("layers.1.w")
    a = g.call_function(torch.mul, (x, w0))
    b = g.call_function(torch.mul, (a, w1))
    c = g.call_function(torch.add, (b, w0))  # layer 0 again after layer 1
    g.output((c,))
    with pytest.raises(SplitError, match="layers.0 and layers.1 interleave"):
        split_by_layer(g, "layers")
    with caplog.at_level(logging.WARNING, logger="fxparallel"):
        _, _, pieces = generate_layered_forward(g, ["layers.0.w", "layers.1.w"])
    assert pieces is None and "graph kept whole" in caplog.text


def _graph_with_hoisted_weight_op(grad_switch: bool):
    """x -> layer 0 (x * relu(w0)) -> layer 1 (* w1); relu(w0) hoisted to the top, like the rewrite's
    copy_to_tp of a norm weight; optionally a grad-mode switch left off before layer 0."""
    import torch.fx as fx

    g = fx.Graph()
    x = g.placeholder("x")
    w0, w1 = g.get_attr("layers.0.w"), g.get_attr("layers.1.w")
    hoisted = g.call_function(torch.relu, (w0,))
    if grad_switch:
        g.call_function(torch._C._set_grad_enabled, (False,))
    a = g.call_function(torch.mul, (x, hoisted))
    b = g.call_function(torch.mul, (a, w1))
    g.output((b,))
    return g


def test_weight_computations_run_in_their_layer():
    from fxparallel.rewrite.split_by_layer import split_by_layer

    root, pieces, _ = split_by_layer(_graph_with_hoisted_weight_op(False), "layers")
    assert [n.target for n in pieces["layers.0"].nodes if n.op == "get_attr"] == ["w"]  # read from the layer
    assert torch.relu in [n.target for n in pieces["layers.0"].nodes]
    assert [n.target for n in root.nodes if n.op == "call_module"] == ["layers.0", "layers.1"]
    assert not [n for n in root.nodes if n.op == "get_attr"]


def test_weight_computation_is_not_moved_across_a_grad_mode_switch():
    from fxparallel.rewrite.split_by_layer import SplitError, split_by_layer

    with pytest.raises(SplitError, match="relu would move into another grad-mode/autocast state"):
        split_by_layer(_graph_with_hoisted_weight_op(True), "layers")


def test_a_weight_shared_by_two_layers_rules_out_layer_units():
    from torch import nn

    from fxparallel.plan.plan import ParamPlan
    from fxparallel.ops.layer_units import LayerUnit, install_layer_units
    from fxparallel.uncalled_modules import parent_of

    root = nn.Module()
    params = [ParamPlan("model.layers.0.w", (4,), "R", "replicated", aliases=("model.layers.1.w",)),
              ParamPlan("model.layers.1.v", (4,), "R", "replicated"),
              ParamPlan("model.norm.weight", (4,), "R", "replicated")]
    paths, why = install_layer_units(root, params, parent_of)
    assert paths == ["model.layers.0", "model.layers.1"]  # the split still runs through them
    assert isinstance(root.get_submodule("model.layers.1"), LayerUnit)
    assert why == "parameter model.layers.0.w is shared by ['model.layers.0', 'model.layers.1']"
