"""LoRA adapters on the parallel model (issue 36, first part): ``parallelize(adapter_dir)`` takes a PEFT LoRA
adapter saved by PEFT (its base from ``base_model_name_or_path``), injects PEFT's own LoRA layers into the
captured model and lets the solver place the adapter matrices. Against ``PeftModel`` on one device at TP=2:
logits, loss, every adapter gradient (``is_trainable=True``), greedy ``generate``; loss and gradients (the adapter
and its base read from a hub cache by id) at TP=4,
at TP=3 (heads split unevenly) and TP=1; the adapters add no collective to the plan (their rank-r values join
the base layers' calls); the base model is frozen
(no gradient, no gradient buffer) and a default load freezes the adapter too (PEFT's inference default);
transformers' names on a parallel base model: ``load_adapter`` (same checks), ``add_adapter`` (logits unchanged,
B being zero; loss and gradients as PEFT's with the same A), ``active_adapters``, a second adapter (other
targets and rank) loaded beside the first and switched with ``set_adapter``, trained, read and deleted against a
PeftModel holding both, both active at once (their outputs added, trained, merged; saving refused),
``get_adapter_state_dict``, ``disable_adapters`` / ``enable_adapters`` and ``set_adapter`` against what PEFT gives
for them, ``get_peft_model`` on the parallel model refused naming the way, transformers' errors without an
adapter; ``lora_dropout`` and ``use_rslora`` trained with the layers recomputed (activation checkpointing), the
adapters' collectives joined with their base layers' (one call each; the dropouts' masks still PEFT's), and under
selective checkpointing; ``parallelize(peft_model)`` (same checks); ``merge_and_unload`` (PEFT's merged logits, no adapter
left); GPT-2's fused Conv1D projections (fan_in_fan_out, q/k/v in one weight) trained and merged;
``save_pretrained`` writes the adapter only (PEFT's layout) and PEFT loads it to the same logits. Refused by
name before any capture: other PEFT methods, LoRA options not supported yet (DoRA), a pickled adapter."""
from __future__ import annotations

import json
import os
import sys

import pytest
import torch

from distributed import run_ranks

sys.path.insert(0, os.path.join(os.path.dirname(__file__), os.pardir, "benchmarks"))  # tiny_configs

TARGETS = ["q_proj", "v_proj", "o_proj", "gate_proj", "down_proj"]
EXPERT_WEIGHTS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]


def _adapter(root: str, config=None, **options) -> str:
    """A tiny Llama checkpoint (or of ``config``) and a LoRA adapter of it with nonzero B (PEFT's default B is
    zero)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from models import save_checkpoint, tiny_config

    base = save_checkpoint(config or tiny_config("llama"), os.path.join(root, "base"))
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    options = {"target_modules": TARGETS, **options}
    config = LoraConfig(r=4, lora_alpha=8, init_lora_weights=False, **options)
    path = os.path.join(root, "adapter")
    get_peft_model(model, config).save_pretrained(path)
    return path


def _reference(adapter: str, trainable: bool):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(os.path.join(os.path.dirname(adapter), "base"), dtype=torch.float32)
    return PeftModel.from_pretrained(base, adapter, is_trainable=trainable)


def _trained(adapter, group, rank, tp, ids, model=None, ref=None, seed=None) -> dict:
    """Loss and every adapter gradient at ``group``'s layout against PeftModel's (``ref``, by default the
    adapter's); which parameters take gradients. ``model``: by default ``parallelize(adapter)``. ``seed``: both
    in training mode (dropout) under that seed."""
    import fxparallel
    from fxparallel.capture.adapters import hf_name, is_adapter_parameter

    model = model or fxparallel.parallelize(adapter, group, dtype=torch.float32, is_trainable=True)
    ref = ref or _reference(adapter, trainable=True)
    losses = []
    for m in (model, ref):
        if seed is not None:
            m.train()
            torch.manual_seed(seed)
        losses.append(m(input_ids=ids, labels=ids).loss)
        losses[-1].backward()
    loss, ref_loss = losses
    out = {"loss": (loss - ref_loss).abs().item()}
    if seed is not None:  # the dropout acted
        with torch.no_grad():
            out["train - eval loss"] = (ref_loss - ref.eval()(input_ids=ids, labels=ids).loss).abs().item()
    ref_params = {hf_name(n.removeprefix("base_model.model.")): p for n, p in ref.named_parameters()}
    grad_err, adapters, base_with_grad = 0.0, 0, []
    for name, p in model.named_parameters():
        if is_adapter_parameter(name):
            expected = model.plan.param(name).shard_of(ref_params[name].grad, rank, tp)
            grad_err = max(grad_err, (p.grad - expected).abs().max().item())
            adapters += 1
        elif p.requires_grad or p.grad is not None:
            base_with_grad.append(name)
    out["grad"], out["adapter matrices"] = grad_err, adapters
    out["reference adapter matrices"] = sum(1 for n in ref_params if is_adapter_parameter(n))
    out["base with grad"] = base_with_grad
    return out


def _with_weights(base_dir, config, state):
    """PeftModel of ``config`` on the base model with the adapter matrices of ``state`` (names as ours)."""
    from peft import get_peft_model
    from transformers import AutoModelForCausalLM

    from fxparallel.capture.adapters import hf_name, is_adapter_parameter

    ref = get_peft_model(AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32), config)
    with torch.no_grad():
        for name, p in ref.named_parameters():
            ours = hf_name(name.removeprefix("base_model.model."))
            if is_adapter_parameter(ours):
                p.copy_(state[ours])
    return ref


def _second_adapter(adapter: str) -> str:
    """Another adapter of ``adapter``'s base model: other targets (all linear layers) and rank."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(os.path.join(os.path.dirname(adapter), "base"), dtype=torch.float32)
    torch.manual_seed(1)
    path = os.path.join(os.path.dirname(adapter), "second")
    get_peft_model(model, LoraConfig(r=2, lora_alpha=4, init_lora_weights=False, target_modules="all-linear")
                   ).save_pretrained(path)
    return path


def _step_against(model, ref, ref_params, ids, rank, tp) -> dict:
    """The trainable matrices of ``model`` and of PEFT's ``ref``, and the loss and every trainable gradient against
    it."""
    out = {"trainable": ([n for n, p in model.named_parameters() if p.requires_grad],
                         [n for n, p in ref_params.items() if p.requires_grad])}
    loss, ref_loss = (m(input_ids=ids, labels=ids).loss for m in (model, ref))
    loss.backward()
    ref_loss.backward()
    out["loss"] = (loss - ref_loss).abs().item()
    out["grad"] = max((p.grad - model.plan.param(n).shard_of(ref_params[n].grad, rank, tp)).abs().max().item()
                      for n, p in model.named_parameters() if p.requires_grad)
    return out


def _several(model, base_dir, adapter, other, ids, rank, tp) -> dict:
    """A second adapter (other targets and rank; named "mlp", like a module) loaded on ``model`` (which holds
    ``adapter`` as "default", trainable) against PeftModel holding both: which is active after loading (the new
    one, as transformers' injection makes it), logits with each active, ``set_adapter``'s trainable matrices, the
    loss and every gradient with "default" active (the other's matrices get none), ``get_adapter_state_dict`` of
    the inactive one, ``save_pretrained`` of the active one loaded by PEFT, ``delete_adapter`` of the active one;
    a repeated name and two active adapters refused."""
    import torch.distributed as dist
    from peft import PeftModel, get_peft_model_state_dict
    from transformers import AutoModelForCausalLM

    from checks import raised
    from fxparallel.capture.adapters import hf_name

    ref = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32), adapter,
                                    is_trainable=True)
    ref.load_adapter(other, adapter_name="mlp", is_trainable=True)
    model.zero_grad(set_to_none=True)
    out = {"repeated name": raised(lambda: model.load_adapter(other))}
    model.load_adapter(other, adapter_name="mlp")
    out["active after loading"] = model.active_adapters()
    out["held"] = list(model.peft_config)
    logits = {}
    with torch.no_grad():
        for name in ("mlp", "default"):
            model.set_adapter(name)
            ref.set_adapter(name)
            logits[name] = ref(input_ids=ids).logits
            out[f"logits, {name} active"] = (model(input_ids=ids).logits - logits[name]).abs().max().item()
    out["effect"] = (logits["mlp"] - logits["default"]).abs().max().item()
    ref_params = {hf_name(n.removeprefix("base_model.model.")): p for n, p in ref.named_parameters()}
    out.update(_step_against(model, ref, ref_params, ids, rank, tp))
    out["grads"] = ([n for n, p in model.named_parameters() if p.grad is not None],
                    [n for n, p in ref_params.items() if p.grad is not None])
    ours = model.get_adapter_state_dict("mlp")
    theirs = {k.removeprefix("base_model.model."): v
              for k, v in get_peft_model_state_dict(ref, adapter_name="mlp").items()}
    out["state dict of the inactive"] = sorted(ours) == sorted(theirs) and \
        max((ours[k] - theirs[k]).abs().max().item() for k in theirs) < 1e-6
    out["two active"] = _two_active(model, ref, ref_params, ids, rank, tp, adapter, other)
    out["two active"]["vs default alone"] = (out["two active"].pop("expected") - logits["default"]).abs().max().item()
    model.set_adapter("mlp")  # saved: the active adapter alone, under PEFT's names, loaded by PEFT
    saved = os.path.join(os.path.dirname(adapter), "saved_mlp")
    model.save_pretrained(saved)
    dist.barrier()
    with torch.no_grad():
        reloaded = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32),
                                             saved)
        out["saved active"] = (reloaded(input_ids=ids).logits - logits["mlp"]).abs().max().item()
    model.set_adapter("default")
    model.delete_adapter("default")
    ref.delete_adapter("default")  # PEFT makes the remaining one active
    out["after delete"] = (model.active_adapters(), [n for n, _ in model.named_parameters() if ".default." in n])
    with torch.no_grad():
        out["logits after delete"] = (model(input_ids=ids).logits - ref(input_ids=ids).logits).abs().max().item()
    return out


def _two_active(model, ref, ref_params, ids, rank, tp, adapter, other) -> dict:
    """Both adapters active (their outputs add up) against PeftModel's LoRA model with both active: logits, the
    trainable matrices (both adapters'), loss and every gradient; save_pretrained refused as transformers refuses
    it; merge_and_unload folds both (on a copy of ``model``'s state: a new model with the same adapters)."""
    import torch.distributed as dist

    import fxparallel
    from checks import raised

    both = ["default", "mlp"]
    model.zero_grad(set_to_none=True)
    for p in ref.parameters():
        p.grad = None
    model.set_adapter(both)
    ref.base_model.set_adapter(both)
    out = {"active": model.active_adapters()}
    with torch.no_grad():
        expected = ref(input_ids=ids).logits
        out["logits"] = (model(input_ids=ids).logits - expected).abs().max().item()
    out.update(_step_against(model, ref, ref_params, ids, rank, tp))
    out["saved"] = raised(lambda: model.save_pretrained(os.path.join(os.path.dirname(adapter), "both")))
    copy = fxparallel.parallelize(os.path.join(os.path.dirname(adapter), "base"), dist.group.WORLD,
                                  dtype=torch.float32)
    for name, path in zip(both, (adapter, other)):
        copy.load_adapter(path, adapter_name=name)
    with torch.no_grad():
        for n, p in copy.named_parameters():
            if ".lora_" in n:
                p.copy_(model.get_parameter(n))
    copy.set_adapter(both)
    copy.merge_and_unload()
    with torch.no_grad():
        out["merged"] = (copy(input_ids=ids).logits - expected).abs().max().item()
    out["merged names"] = [n for n, _ in copy.named_parameters() if "lora" in n]
    out["expected"] = expected
    model.zero_grad(set_to_none=True)
    for p in ref.parameters():
        p.grad = None
    return out


def _ranks(rank, world, adapter, with_options, other):
    import torch.distributed as dist
    from peft import LoraConfig

    import fxparallel
    from checks import raised
    from fxparallel.runtime import gather_full_state_dict

    ids = torch.randint(0, 128, (2, 9), generator=torch.Generator().manual_seed(0))
    # training: the adapter's gradients against PEFT's, the base frozen
    out = _trained(adapter, dist.group.WORLD, rank, world, ids)
    # lora_dropout and use_rslora, in training mode, the decoder layers recomputed (activation checkpointing)
    model = fxparallel.parallelize(with_options, dist.group.WORLD, dtype=torch.float32, is_trainable=True)
    model.gradient_checkpointing_enable()
    out["dropout, rslora, checkpointed"] = _trained(with_options, dist.group.WORLD, rank, world, ids, model=model,
                                                    seed=7)
    out["checkpointed layers"] = sum(u.checkpoint is not None for u in model.layer_units())
    out["joined calls, dropout"] = _joined_calls(model)  # each adapter's dropout moved with its A x
    # the layers recomputed under selective checkpointing, which keeps the joined all-reduces' outputs
    model = fxparallel.parallelize(adapter, dist.group.WORLD, dtype=torch.float32, is_trainable=True)
    model.gradient_checkpointing_enable(mode="selective")
    out["joined, selective checkpointing"] = _trained(adapter, dist.group.WORLD, rank, world, ids, model=model)
    out["joined calls"] = _joined_calls(model)
    # sequence parallelism: A x of a column layer's adapter and B of a row layer's run on this rank's tokens (their
    # gradients reduced like a norm's), the dropout masks this rank's tokens of one device's
    even = torch.randint(0, 128, (2, 8), generator=torch.Generator().manual_seed(1))
    model = fxparallel.parallelize(with_options, dist.group.WORLD, dtype=torch.float32, is_trainable=True,
                                   sequence_parallel=True)
    out["sequence parallel"] = _trained(with_options, dist.group.WORLD, rank, world, even, model=model, seed=7)
    out["sequence parallel plan"] = (model.plan.sequence_parallel_kept, model.plan.count("all_reduce", "forward"),
                                     model.plan.count("reduce_scatter", "forward"),
                                     model.plan.count("all_gather", "forward"),
                                     model.plan.count("all_reduce", "backward"), _joined_calls(model))
    model.zero_grad(set_to_none=True)  # again, the layers recomputed keeping the joined collectives' outputs
    model.gradient_checkpointing_enable(mode="selective")
    out["sequence parallel, selective checkpointing"] = _trained(with_options, dist.group.WORLD, rank, world, even,
                                                                 model=model, seed=7)
    # transformers' names: load_adapter on a parallel base model, add_adapter (PEFT's initialization)
    base_dir = os.path.join(os.path.dirname(adapter), "base")
    model = fxparallel.parallelize(base_dir, dist.group.WORLD, dtype=torch.float32)
    model.load_adapter(adapter, is_trainable=True)
    out["load_adapter"] = _trained(adapter, dist.group.WORLD, rank, world, ids, model=model)
    out["active"] = model.active_adapters()
    out["several"] = _several(model, base_dir, adapter, other, ids, rank, world)
    model = fxparallel.parallelize(base_dir, dist.group.WORLD, dtype=torch.float32)
    with torch.no_grad():
        before = model(input_ids=ids).logits
    model.add_adapter(LoraConfig(r=4, lora_alpha=8, target_modules=TARGETS))
    with torch.no_grad():
        out["added: logits unchanged (B is zero)"] = (model(input_ids=ids).logits - before).abs().max().item()
    ref = _with_weights(base_dir, LoraConfig(r=4, lora_alpha=8, target_modules=TARGETS),
                        gather_full_state_dict(model, to_rank0_only=False))
    out["add_adapter"] = _trained(adapter, dist.group.WORLD, rank, world, ids, model=model, ref=ref)
    # a PeftModel in memory (its adapter trainable there, so here); parallelized under no_grad, as an inference
    # script would, then trained: the graphs are captured with gradients whatever the caller's mode
    with torch.no_grad():
        model = fxparallel.parallelize(_reference(adapter, trainable=True), dist.group.WORLD, dtype=torch.float32)
    out["peft model"] = _trained(adapter, dist.group.WORLD, rank, world, ids, model=model)
    # a PeftModel holding two adapters, the second active: both attached, PEFT's active one computing
    ref = _reference(adapter, trainable=False)
    ref.load_adapter(other, adapter_name="mlp")
    ref.set_adapter("mlp")
    model = fxparallel.parallelize(ref, dist.group.WORLD, dtype=torch.float32)
    out["peft model, two adapters"] = [model.active_adapters(), list(model.peft_config)]
    with torch.no_grad():
        for name in ("mlp", "default"):
            model.set_adapter(name)
            ref.set_adapter(name)
            out["peft model, two adapters"].append((model(input_ids=ids).logits - ref(input_ids=ids).logits
                                                    ).abs().max().item())
    # inference (PEFT's default): nothing takes gradients; logits and tokens as PeftModel's
    model = fxparallel.parallelize(adapter, dist.group.WORLD, dtype=torch.float32)
    ref = _reference(adapter, trainable=False)
    out["trainable by default"] = [n for n, p in model.named_parameters() if p.requires_grad]
    with torch.no_grad():
        out["logits"] = (model(input_ids=ids).logits - ref(input_ids=ids).logits).abs().max().item()
    mask = torch.ones(2, 5, dtype=torch.long)
    mask[1, :2] = 0  # left padding
    tokens = model.generate(input_ids=ids[:, :5], attention_mask=mask, max_new_tokens=6, do_sample=False)
    expected = ref.generate(input_ids=ids[:, :5], attention_mask=mask, max_new_tokens=6, do_sample=False)
    out["generate"] = torch.equal(tokens, expected)
    out["names"] = _names_against_peft(model, adapter, ids)
    out["saved plan"] = _saved_plan(model, adapter, rank)
    # saved at TP=2: the adapter alone, as PEFT writes it, loaded by PEFT on one device
    saved = os.path.join(os.path.dirname(adapter), "saved")
    model.save_pretrained(saved)
    dist.barrier()
    out["files"] = sorted(os.listdir(saved))
    with torch.no_grad():
        out["reloaded"] = (_reference(saved, trainable=False)(input_ids=ids).logits - ref(input_ids=ids).logits
                           ).abs().max().item()
    # merged into the base shards: PEFT's merge_and_unload, no adapter left
    # merged into the base shards (while disabled: PEFT merges a disabled adapter too): PEFT's merge_and_unload
    model.disable_adapters()
    from fxparallel import graph_cache

    looked_up = dict(graph_cache.stats)
    merged = model.merge_and_unload()
    # the base plan the adapter followed, kept from parallelize: nothing planned, not even read from the cache
    out["planned by merging"] = {k: n - looked_up[k] for k, n in graph_cache.stats.items() if n != looked_up[k]}
    with torch.no_grad():
        out["merged"] = (merged(input_ids=ids).logits - ref.merge_and_unload()(input_ids=ids).logits).abs().max().item()
    out["left after merging"] = [n for n, _ in merged.named_parameters() if ".lora_" in n]
    out["no adapter"] = [raised(f) for f in (merged.active_adapters, merged.disable_adapters, merged.enable_adapters,
                                             lambda: merged.set_adapter("default"), merged.get_adapter_state_dict)]
    return out


def _saved_plan(model, adapter, rank) -> dict:
    """``parallelize(adapter, plan=saved)`` with the plan saved from the model: the same plan; with an adapter
    matrix's placement edited away from its base layer's: refused, naming it."""
    import torch.distributed as dist

    import fxparallel
    from checks import raised
    from test_saved_plans import _edited

    path = os.path.join(os.path.dirname(adapter), f"plan{rank}.json")
    model.plan.save(path)
    again = fxparallel.parallelize(adapter, dist.group.WORLD, dtype=torch.float32, plan=path)

    def replicate_b(d):
        for p in d["params"]:
            if p["name"] == "model.layers.0.self_attn.q_proj.lora_B.default.weight":
                p["placement"], p["split"] = "R", []

    edited = _edited(model.plan, replicate_b)
    return {"same": again.plan == model.plan,
            "edited": raised(lambda: fxparallel.parallelize(adapter, dist.group.WORLD, dtype=torch.float32,
                                                            plan=edited))}


def _names_against_peft(model, adapter, ids) -> dict:
    """transformers' PEFT-integration names on the parallel model (an inference load) against what they do on one
    device, computed with PEFT (transformers 5.24's own methods ask for peft >= 0.22, which the package index does
    not have yet): the adapter state dict (``get_peft_model_state_dict``, names as on a transformers model), logits
    disabled (``disable_adapter()``) and enabled again, which parameters ``set_adapter`` makes trainable; PEFT's
    ``get_peft_model`` on the parallel model refused, naming the way, and PEFT's ``get_peft_model_state_dict`` (which
    would take the shards) refused naming ``get_adapter_state_dict``."""
    from peft import LoraConfig, get_peft_model, get_peft_model_state_dict

    from checks import raised
    from fxparallel.capture.adapters import hf_name

    ref = _reference(adapter, trainable=False)
    ours = model.get_adapter_state_dict()
    theirs = {k.removeprefix("base_model.model."): v for k, v in get_peft_model_state_dict(ref).items()}
    out = {"state dict keys": sorted(ours) == sorted(theirs) and len(ours) == 2 * 2 * len(TARGETS),
           "state dict": max((ours[k] - theirs[k]).abs().max().item() for k in theirs)}
    with torch.no_grad():
        with ref.disable_adapter():
            base = ref(input_ids=ids).logits
        adapted = ref(input_ids=ids).logits
        model.disable_adapters()
        out["disabled"] = (model(input_ids=ids).logits - base).abs().max().item()
        model.enable_adapters()
        out["enabled"] = (model(input_ids=ids).logits - adapted).abs().max().item()
    out["adapter's effect"] = (adapted - base).abs().max().item()  # "disabled" compares the base models
    model.set_adapter("default")
    ref.set_adapter("default")
    out["set_adapter trainable"] = ([n for n, p in model.named_parameters() if p.requires_grad],
                                    [hf_name(n.removeprefix("base_model.model.")) for n, p in ref.named_parameters()
                                     if p.requires_grad])
    out["set_adapter unknown"] = raised(lambda: model.set_adapter("other"))
    config = model.peft_config["default"]
    out["get_peft_model"] = raised(lambda: get_peft_model(model, LoraConfig(r=4, target_modules=["q_proj"])))
    out["peft_config kept"] = model.peft_config == {"default": config}  # PEFT's tuner adds to it before failing
    out["peft state dict"] = raised(lambda: get_peft_model_state_dict(model))  # it would take the shards
    return out


def _other_layouts(rank, world, adapter, cache, expert_adapter):
    """TP=4 on the world; TP=3 (heads split unevenly) on ranks 0-2 and TP=1 on rank 3; the adapter by its hub id
    (``HUB_ADAPTER`` in the hub cache ``cache``, its base by the hub id its config names); and ``expert_adapter``
    (LoRA on 6 stacked experts) with expert parallelism at TP=4, experts 2 / 2 / 1 / 1."""
    import torch.distributed as dist

    import fxparallel

    ids = torch.randint(0, 128, (2, 9), generator=torch.Generator().manual_seed(0))
    ep = fxparallel.parallelize(expert_adapter, dist.group.WORLD, dtype=torch.float32, is_trainable=True,
                                expert_parallel=True)
    experts = _trained(expert_adapter, dist.group.WORLD, rank, world, ids, model=ep)
    experts["local"] = {n.split("layers.0.")[1]: tuple(p.shape) for n, p in ep.local_named_parameters()
                        if n.startswith("model.layers.0.mlp.experts.")}

    def from_hub(group):
        return fxparallel.parallelize(HUB_ADAPTER, group, dtype=torch.float32, is_trainable=True, cache_dir=cache,
                                      local_files_only=True)

    out = {4: _trained(adapter, dist.group.WORLD, rank, world, ids, model=from_hub(dist.group.WORLD)),
           "experts": experts}
    mine, _ = dist.new_subgroups_by_enumeration([[0, 1, 2], [3]])
    tp = dist.get_world_size(mine)
    out[tp] = _trained(adapter, mine, dist.get_rank(mine), tp, ids, model=from_hub(mine))
    out["dp2 x tp2"] = _under_fsdp(adapter, from_hub)
    return out


def _under_fsdp(adapter, from_hub) -> dict:
    """FSDP over dp=2 around tp=2 (``apply_data_parallel``, one runtime step): each dp rank's half of the batch;
    the loss and every adapter gradient (reduced over dp) against PeftModel's on the whole batch."""
    from fxparallel.capture.adapters import hf_name, is_adapter_parameter
    from fxparallel.runtime import apply_data_parallel, init_mesh, train_step
    from fxparallel.runtime.dtensor import full_tensor

    mesh = init_mesh(tp=2, dp=2, cp=1)
    model = apply_data_parallel(from_hub(mesh.tp_mesh), mesh)
    batch = torch.randint(0, 128, (4, 9), generator=torch.Generator().manual_seed(1))
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.0)
    loss = train_step(model, optimizer, {"input_ids": batch[2 * mesh.dp_rank:][:2]}, mesh).loss
    ref = _reference(adapter, trainable=True)
    ref_loss = ref(input_ids=batch, labels=batch).loss
    ref_loss.backward()
    ref_grads = {hf_name(n.removeprefix("base_model.model.")): p.grad for n, p in ref.named_parameters()}
    grads = {n: full_tensor(p.grad, model.plan.param(n), mesh) for n, p in model.named_parameters()
             if is_adapter_parameter(n)}
    from checks import raised

    refused = raised(model.merge_and_unload)  # FSDP's parameters are not the shards it would fold into
    return {"merge refused": refused,
            "loss": abs(float(loss) - ref_loss.item()), "grad": max((g - ref_grads[n]).abs().max().item()
                                                                     for n, g in grads.items()),
            "adapter matrices": len(grads), "reference adapter matrices": 2 * 2 * len(TARGETS),
            "base with grad": [n for n, p in model.named_parameters() if not is_adapter_parameter(n) and
                               (p.requires_grad or p.grad is not None)]}


HUB_ADAPTER, HUB_BASE = "org/tiny-llama-lora", "org/tiny-llama"


def _hub_cache(adapter: str) -> str:
    """A hub cache (huggingface_hub's layout) holding the adapter and its base model, the adapter's config naming
    the base by hub id."""
    import shutil

    from hub import add_to_cache, checkpoint_files

    root = os.path.dirname(adapter)
    cache, published = os.path.join(root, "hub"), os.path.join(root, "published")
    shutil.copytree(adapter, published)
    with open(os.path.join(published, "adapter_config.json")) as f:
        config = json.load(f)
    config["base_model_name_or_path"] = HUB_BASE
    with open(os.path.join(published, "adapter_config.json"), "w") as f:
        json.dump(config, f)
    add_to_cache(cache, HUB_BASE, checkpoint_files(os.path.join(root, "base")))
    add_to_cache(cache, HUB_ADAPTER, checkpoint_files(published))
    return cache


def _joined_calls(model) -> int:
    """How many collectives of ``model``'s graphs carry an adapter's values with its base layer's."""
    code = "".join(str(g.code) for g in model._graph_set)
    return sum(code.count(f"{op}_many(") for op in ("copy_to_tp", "all_reduce", "gather_seq_to_tp", "reduce_scatter_seq"))


def _check_training(r, adapted_per_layer: int = len(TARGETS)):
    assert r["loss"] < 1e-5 and r["grad"] < 1e-5, r
    assert r["adapter matrices"] == r["reference adapter matrices"] == 2 * adapted_per_layer * 2, r
    assert r["base with grad"] == [], r


def test_hub_lora_adapter_matches_peft_at_tp4_uneven_tp3_tp1_and_under_fsdp(tmp_path):
    from tiny_configs import tiny_config

    adapter = _adapter(str(tmp_path))
    expert_adapter = _adapter(str(tmp_path / "experts"), tiny_config("qwen3_moe", num_experts=6),
                              target_modules=["q_proj"], target_parameters=EXPERT_WEIGHTS)
    results = run_ranks(4, _other_layouts, adapter, _hub_cache(adapter), expert_adapter)
    assert sorted(results[0], key=str) == [3, 4, "dp2 x tp2", "experts"]
    assert sorted(results[3], key=str) == [1, 4, "dp2 x tp2", "experts"]
    for rank, r in enumerate(results):
        assert "merge_and_unload: merge before apply_data_parallel or Trainer" in r["dp2 x tp2"].pop("merge refused")
        experts = r.pop("experts")
        _check_training(experts, adapted_per_layer=3)
        n = (2, 2, 1, 1)[rank]  # this rank's experts; r = 4: A [6 x 4, in] by experts, B [out, 4 x 6] by columns
        local = experts["local"]
        assert local["mlp.experts.gate_up_proj"][0] == n and local["mlp.experts.lora_A.default.weight"][0] == 4 * n \
            and local["mlp.experts.lora_B.default.weight"][1] == 4 * n, local
        for layout in r.values():
            _check_training(layout)


def test_adapters_add_no_collective(tmp_path):
    """The plan's collectives with the adapter: as many calls of each kind and direction as the base model's,
    each adapter's r floats per token carried by its base layer's call (rewrite/coalesce_collectives.py), at
    TP=2 and TP=4; the plan says why each adapter matrix is placed where it is."""
    import collections

    import fxparallel

    adapter = _adapter(str(tmp_path))
    hidden, r = 64 * 4, 4 * 4  # bytes per token: an activation, a rank-r value (float32)
    for tp in (2, 4):
        base, _ = fxparallel.plan_model(str(tmp_path / "base"), tp, dtype=torch.float32)
        lora, _ = fxparallel.plan_model(adapter, tp, dtype=torch.float32)

        def calls(plan):
            counted = collections.Counter()
            for c in plan.collectives:
                counted[c.kind, c.direction] += c.count
            return counted

        def per_token(plan):
            return sum(c.count * c.bytes_per_token for c in plan.collectives)

        assert calls(lora) == calls(base), (tp, lora.collectives, base.collectives)
        # one rank-r value per adapter of a split layer (B split by its outputs, or A by its inputs)
        split = [p for p in lora.params if ".lora_" in p.name and not p.placement.is_replicate]
        assert split and per_token(lora) - per_token(base) == r * len(split), (tp, lora.collectives)
        joined = [c for c in lora.collectives if c not in base.collectives]
        assert joined and all(c.bytes_per_token > hidden and (c.bytes_per_token - hidden) % r == 0
                              for c in joined), (tp, joined)
        placed = {p.name: str(p.placement) for p in lora.params if "layers.0." in p.name and ".lora_" in p.name}
        assert placed["model.layers.0.self_attn.q_proj.lora_A.default.weight"] == "R", placed
        assert placed["model.layers.0.self_attn.q_proj.lora_B.default.weight"] == "S(0)", placed
        assert placed["model.layers.0.mlp.down_proj.lora_A.default.weight"] == "S(1)", placed
        assert placed["model.layers.0.mlp.down_proj.lora_B.default.weight"] == "R", placed
        assert "LoRA of a column-parallel layer" in lora.param("model.layers.0.self_attn.q_proj.lora_B.default.weight"
                                                              ).reason


def test_lora_adapter_matches_peft_at_tp2(tmp_path):
    adapter = _adapter(str(tmp_path))
    with_options = _adapter(str(tmp_path / "options"), use_rslora=True, lora_dropout=0.1)
    for r in run_ranks(2, _ranks, adapter, with_options, _second_adapter(adapter)):
        _check_training(r)
        options = r["dropout, rslora, checkpointed"]
        _check_training({k: v for k, v in options.items() if k != "train - eval loss"})
        assert options["train - eval loss"] > 1e-4 and r["checkpointed layers"] == 2, r
        _check_training(r["joined, selective checkpointing"])
        # q/k/v's input, o_proj, gate/up's input, down_proj; 2 layers
        assert r["joined calls"] == r["joined calls, dropout"] == 4 * 2, r
        sp = r["sequence parallel"]
        _check_training({k: v for k, v in sp.items() if k != "train - eval loss"})
        assert sp["train - eval loss"] > 1e-4, sp
        # no region left plain TP, and the collectives of sequence parallelism without adapters (2 layers): a
        # reduce-scatter after o_proj, down_proj (each with its adapter's partial A x) and the embedding, a gather
        # before q/k/v, gate/up (with the adapters' A x) and lm_head, one for the loss; backward all-reduces: one
        # per layer for the gradients of its 2 norm weights and of each adapter matrix used on sequence shards (A
        # of q, v, gate; B of o, down), one for the final norm's (5 without adapters); 5 joined calls per layer
        assert r["sequence parallel plan"] == ([], 0, 2 * 2 + 1, 2 * 2 + 2, 2 + 1, 5 * 2), \
            r["sequence parallel plan"]
        _check_training({k: v for k, v in r["sequence parallel, selective checkpointing"].items()
                         if k != "train - eval loss"})
        _check_training(r["load_adapter"])
        _check_training(r["add_adapter"])
        _check_training(r["peft model"])
        two = r["peft model, two adapters"]
        assert two[:2] == [["mlp"], ["default", "mlp"]] and max(two[2:]) < 1e-5, two
        assert r["added: logits unchanged (B is zero)"] == 0.0 and r["active"] == ["default"], r
        several = r["several"]
        assert "adapter with name 'default' already exists" in several["repeated name"], several
        assert several["active after loading"] == ["mlp"] and several["held"] == ["default", "mlp"], several
        assert several["logits, mlp active"] < 1e-5 and several["logits, default active"] < 1e-5, several
        assert several["effect"] > 1e-3 and several["loss"] < 1e-5 and several["grad"] < 1e-5, several
        ours, theirs = several["trainable"]
        assert ours == theirs and all(".default." in n for n in ours) and len(ours) == 2 * 2 * len(TARGETS), several
        assert several["grads"][0] == several["grads"][1] == ours, several
        assert several["state dict of the inactive"], several
        two = several["two active"]
        assert two["active"] == ["default", "mlp"] and two["logits"] < 1e-5 and two["merged"] < 1e-5, two
        assert two["loss"] < 1e-5 and two["grad"] < 1e-5 and two["merged names"] == [], two
        assert two["vs default alone"] > 1e-3, two  # the second adapter's output counts
        ours, theirs = two["trainable"]
        assert ours == theirs and any(".mlp." in n for n in ours) and any(".default." in n for n in ours), two
        assert "adapters ['default', 'mlp'] are active together" in two["saved"], two
        assert several["after delete"] == (["mlp"], []) and several["logits after delete"] < 1e-5, several
        assert several["saved active"] < 1e-5, several
        assert r["logits"] < 1e-5 and r["reloaded"] < 1e-5 and r["trainable by default"] == [], r
        assert r["merged"] < 1e-5 and r["left after merging"] == [] and r["planned by merging"] == {}, r
        assert all("no adapter loaded; attach one first" in e for e in r["no adapter"]), r["no adapter"]
        assert r["saved plan"]["same"], r["saved plan"]
        assert "parameter 'model.layers.0.self_attn.q_proj.lora_B.default.weight': the saved plan places it R" in \
            r["saved plan"]["edited"], r["saved plan"]
        names = r["names"]
        assert names["state dict keys"] and names["state dict"] < 1e-6, names
        assert names["disabled"] < 1e-5 and names["enabled"] < 1e-5 and names["adapter's effect"] > 1e-3, names
        ours, theirs = names["set_adapter trainable"]
        assert ours == theirs and len(ours) == 2 * 2 * len(TARGETS), names  # the adapter only, as PEFT sets it
        assert "adapter(s) ['other'] not found; the model holds ['default']" in names["set_adapter unknown"], names
        assert "cannot wrap the parallel model" in names["get_peft_model"] and "model.add_adapter(peft_config)" in \
            names["get_peft_model"], names
        assert names["peft_config kept"], names
        assert "ArgumentError: peft.get_peft_model_state_dict / set_peft_model_state_dict cannot take" in \
            names["peft state dict"] and "model.get_adapter_state_dict()" in names["peft state dict"], names
        assert r["generate"], r
        assert r["files"] == ["adapter_config.json", "adapter_model.safetensors"], r


def _fused(rank, world, adapter):
    """GPT-2's Conv1D (fan_in_fan_out) with its fused q/k/v: trained and merged against PEFT."""
    import torch.distributed as dist

    ids = torch.randint(0, 128, (2, 9), generator=torch.Generator().manual_seed(0))
    out = _trained(adapter, dist.group.WORLD, rank, world, ids)
    import fxparallel

    model = fxparallel.parallelize(adapter, dist.group.WORLD, dtype=torch.float32)
    ref = _reference(adapter, trainable=False)
    with torch.no_grad():
        out["merged"] = (model.merge_and_unload()(input_ids=ids).logits
                         - ref.merge_and_unload()(input_ids=ids).logits).abs().max().item()
    out["c_attn"] = str(model.plan.param("transformer.h.0.attn.c_attn.weight").placement)
    return out


def test_lora_on_fused_conv1d_projections_matches_peft(tmp_path):
    """GPT-2: Conv1D weights stored [in, out] (PEFT's fan_in_fan_out), q/k/v fused in c_attn (B split by the
    same segments), c_proj row-parallel (A split by input features)."""
    from transformers import GPT2Config

    config = GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=128, n_positions=64)
    adapter = _adapter(str(tmp_path), config, target_modules=["c_attn", "c_proj"], fan_in_fan_out=True)
    for r in run_ranks(2, _fused, adapter):
        assert r["loss"] < 1e-5 and r["grad"] < 1e-5 and r["merged"] < 1e-5, r
        assert r["adapter matrices"] == r["reference adapter matrices"] == 2 * 2 * 3 and r["base with grad"] == [], r
        assert r["c_attn"] == "S(1)[64,64,64]", r  # Conv1D [in, 3 x out]: split by output features, per segment


def _mamba2(rank, world, adapter):
    """LoRA on a Mamba-2 mixer split by heads (one group: B and C whole on every rank): trained, stepped, saved
    and merged against PEFT."""
    import torch.distributed as dist

    import fxparallel

    ids = torch.randint(0, 128, (2, 9), generator=torch.Generator().manual_seed(0))
    out = _trained(adapter, dist.group.WORLD, rank, world, ids)
    model = fxparallel.parallelize(adapter, dist.group.WORLD, dtype=torch.float32, is_trainable=True)
    out["placements"] = {n.split(".mamba.")[-1]: str(model.plan.param(n).placement)
                         for n, _ in model.named_parameters() if ".layers.0.mamba." in n}
    # one SGD step, then the adapter saved (the whole rows of B once, not once per rank) and reloaded by PEFT
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.5)
    model(input_ids=ids, labels=ids).loss.backward()
    optimizer.step()
    saved = os.path.join(os.path.dirname(adapter), "stepped")
    model.save_pretrained(saved)
    with torch.no_grad():
        after = model(input_ids=ids).logits
        out["stepped"] = (after - _reference(adapter, trainable=False)(input_ids=ids).logits).abs().max().item()
        out["reloaded"] = (_reference(saved, trainable=False)(input_ids=ids).logits - after).abs().max().item()
        out["merged"] = (model.merge_and_unload()(input_ids=ids).logits - after).abs().max().item()
    return out


def test_lora_on_a_head_split_mamba2_mixer_matches_peft(tmp_path):
    """Bamba (Mamba-2 layers of one group and attention) at a width where the solver splits the mixer by heads:
    in_proj's B takes its weight's segments, B and C's rows whole on every rank, their gradients (partial per
    rank) summed once; out_proj's A split by input features."""
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), os.pardir, "benchmarks"))
    from tiny_configs import tiny_config

    config = tiny_config("bamba", hidden_size=128, mamba_d_state=16, mamba_d_head=32)
    adapter = _adapter(str(tmp_path), config, target_modules=["in_proj", "out_proj", "q_proj", "v_proj"])
    for r in run_ranks(2, _mamba2, adapter):
        assert r["loss"] < 1e-5 and r["grad"] < 1e-5, r
        assert r["adapter matrices"] == r["reference adapter matrices"] == 8 and r["base with grad"] == [], r
        placements = {n: v for n, v in r["placements"].items() if "lora" in n}
        assert placements == {"in_proj.lora_A.default.weight": "R",
                              "in_proj.lora_B.default.weight": "S(0)[256,256,16R,16R,8]",
                              "out_proj.lora_A.default.weight": "S(1)", "out_proj.lora_B.default.weight": "R"}, r
        assert r["stepped"] > 1e-3 and r["reloaded"] < 1e-5 and r["merged"] < 1e-5, r


def _experts(rank, world, adapters):
    """LoRA on stacked expert weights (``target_parameters``) beside q_proj, with the experts split like an MLP and
    split whole (expert parallelism): trained, merged and, for the first, generating greedily and saved at TP=2
    and reloaded in PEFT."""
    import torch.distributed as dist

    import fxparallel

    ids = torch.randint(0, 128, (2, 9), generator=torch.Generator().manual_seed(0))
    out = {}
    for kind, adapter in adapters.items():
        for expert_parallel in (False, True):
            def build(**options):
                return fxparallel.parallelize(adapter, dist.group.WORLD, dtype=torch.float32,
                                              expert_parallel=expert_parallel, **options)

            result = _trained(adapter, dist.group.WORLD, rank, world, ids, model=build(is_trainable=True))
            model = build()
            ref = _reference(adapter, trainable=False)
            result["placements"] = {p.name.split("layers.0.")[1]: str(p.placement) for p in model.plan.params
                                    if p.name.startswith("model.layers.0.mlp.experts.")}
            result["collectives"] = sorted((c.kind, c.direction, c.where, c.bytes_per_token)
                                           for c in model.plan.collectives if "mlp" in c.where)
            with torch.no_grad():
                result["logits"] = (model(input_ids=ids).logits - ref(input_ids=ids).logits).abs().max().item()
                if kind == "mixtral":  # greedy generate, and saved at TP=2 then reloaded in PEFT
                    kwargs = dict(max_new_tokens=8, do_sample=False, pad_token_id=0)
                    result["generate"] = torch.equal(model.generate(input_ids=ids[:, :6], **kwargs),
                                                     ref.generate(input_ids=ids[:, :6], **kwargs))
                    saved = os.path.join(os.path.dirname(adapter), f"saved-{expert_parallel}")
                    model.save_pretrained(saved)
                    dist.barrier()
                    result["reloaded"] = (_reference(saved, trainable=False)(input_ids=ids).logits
                                          - ref(input_ids=ids).logits).abs().max().item()
                result["merged"] = (model.merge_and_unload()(input_ids=ids).logits
                                    - ref.merge_and_unload()(input_ids=ids).logits).abs().max().item()
            if kind == "mixtral" and expert_parallel:
                result["added"] = _added_on_experts(adapter, rank, ids)
            out[kind, expert_parallel] = result
    return out


def _added_on_experts(adapter, rank, ids) -> dict:
    """``add_adapter`` on the expert weights of a model with whole experts per rank: one SGD step, saved, and
    reloaded in PEFT on one process to the same logits."""
    import torch.distributed as dist
    from peft import LoraConfig

    import fxparallel

    root = os.path.dirname(adapter)
    model = fxparallel.parallelize(os.path.join(root, "base"), dist.group.WORLD, dtype=torch.float32,
                                   expert_parallel=True)
    with torch.no_grad():
        before = model(input_ids=ids).logits
    model.add_adapter(LoraConfig(r=4, target_modules=["q_proj"], target_parameters=EXPERT_WEIGHTS))
    model(input_ids=ids, labels=ids).loss.backward()
    torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.5).step()
    saved = os.path.join(root, "added")
    model.save_pretrained(saved)
    dist.barrier()
    with torch.no_grad():
        after = model(input_ids=ids).logits
        return {"moved": (after - before).abs().max().item(),
                "reloaded": (_reference(saved, trainable=False)(input_ids=ids).logits - after).abs().max().item()}


def test_lora_on_expert_parameters_matches_peft(tmp_path):
    """``target_parameters`` on Mixtral's experts ([experts, out, in], gate and up concatenated: B split by the
    same segments) and GPT-OSS's ([experts, in, out], gate and up interleaved, biases), applied by PEFT through
    ``torch.nn.utils.parametrize``, which the capture replaces by the same sum (capture/adapter_parameters.py).
    Experts split like an MLP: what the expert adapters add is a once-per-step all-reduce of a replicated adapter
    matrix's gradient. Experts split whole (``expert_parallel=True``): each rank holds its experts' rows of A and
    columns of B, and the adapters add no collective at all (the MoE blocks' collectives are those of the model
    without the adapter); an adapter added there with ``add_adapter`` trains and PEFT reads it back."""
    import fxparallel
    from tiny_configs import tiny_config

    adapters = {kind: _adapter(str(tmp_path / kind), tiny_config(kind), target_modules=["q_proj"],
                               target_parameters=EXPERT_WEIGHTS) for kind in ("mixtral", "gpt_oss")}
    without = {}
    for kind in adapters:
        plan, _ = fxparallel.plan_model(str(tmp_path / kind / "base"), 2, dtype=torch.float32, expert_parallel=True)
        without[kind] = sorted((c.kind, c.direction, c.where, c.bytes_per_token) for c in plan.collectives
                               if "mlp" in c.where)
    for r in run_ranks(2, _experts, adapters):
        for (kind, expert_parallel), result in r.items():
            _check_training(result, adapted_per_layer=3)  # q_proj and the two expert weights
            assert result["logits"] < 1e-5 and result["merged"] < 1e-5, (kind, result)
            placed = result["placements"]
            if expert_parallel:  # 4 experts, r = 4: A [4 x 4, in] by experts, B [out, 4 x 4] by every r's experts
                assert placed["mlp.experts.gate_up_proj"] == placed["mlp.experts.down_proj"] == "S(0)", placed
                for wrapper in ("mlp.experts.base_layer", "mlp.experts"):
                    assert placed[f"{wrapper}.lora_A.default.weight"] == "S(0)", placed
                    assert placed[f"{wrapper}.lora_B.default.weight"] == "S(1)[4,4,4,4]", placed
                assert result["collectives"] == without[kind], (result["collectives"], without[kind])
                continue
            column, row = ("S(1)[128,128]", "S(2)") if kind == "mixtral" else ("S(2)", "S(1)")
            assert placed["mlp.experts.gate_up_proj"] == column and placed["mlp.experts.down_proj"] == row, placed
            assert placed["mlp.experts.base_layer.lora_A.default.weight"] == "R", placed  # gate_up: column-parallel
            assert placed["mlp.experts.base_layer.lora_B.default.weight"] == ("S(0)[128,128]" if kind == "mixtral"
                                                                            else "S(0)"), placed
            assert placed["mlp.experts.lora_A.default.weight"] == "S(1)", placed  # down: row-parallel
            assert placed["mlp.experts.lora_B.default.weight"] == "R", placed
            added = [c[:2] + c[3:] for c in result["collectives"] if "experts" in c[2] and "lora" in c[2]]
            assert added and all(c == ("all_reduce", "backward", 0.0) for c in added), result["collectives"]
        for expert_parallel in (False, True):
            assert r["mixtral", expert_parallel]["reloaded"] < 1e-5 and r["mixtral", expert_parallel]["generate"], r
        added = r["mixtral", True]["added"]  # add_adapter with whole experts: trained, and PEFT reads it back
        assert added["moved"] > 1e-4 and added["reloaded"] < 1e-5, added


def test_other_methods_and_options_are_refused_by_name(tmp_path):
    from peft import IA3Config, get_peft_model
    from transformers import AutoModelForCausalLM

    import fxparallel
    from fxparallel.errors import ArgumentError, CheckpointError
    from models import save_checkpoint, tiny_config

    dora = _adapter(str(tmp_path / "dora"), use_dora=True)
    with pytest.raises(ArgumentError, match=r"DoRA \(use_dora=True\) is not supported"):
        fxparallel.plan_model(dora, 2)
    base = save_checkpoint(tiny_config("llama"), str(tmp_path / "base"))
    ia3 = str(tmp_path / "ia3")
    get_peft_model(AutoModelForCausalLM.from_pretrained(base), IA3Config(target_modules=["k_proj"],
                                                                        feedforward_modules=[])).save_pretrained(ia3)
    with pytest.raises(ArgumentError, match="the adapter is IA3; the parallel model supports LoRA adapters only"):
        fxparallel.plan_model(ia3, 2)
    pickled = _adapter(str(tmp_path / "pickled"))
    torch.save({}, os.path.join(pickled, "adapter_model.bin"))
    os.remove(os.path.join(pickled, "adapter_model.safetensors"))
    with pytest.raises(CheckpointError, match="no adapter_model.safetensors; its adapter_model.bin is a pickle"):
        fxparallel.parallelize(pickled, fxparallel.fake_group(1), dtype=torch.float32)
    with open(os.path.join(dora, "adapter_config.json")) as f:
        assert json.load(f)["use_dora"] is True
