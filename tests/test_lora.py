"""LoRA adapters on the parallel model (issue 36, first part): ``parallelize(adapter_dir)`` takes a PEFT LoRA
adapter saved by PEFT (its base from ``base_model_name_or_path``), injects PEFT's own LoRA layers into the
captured model and lets the solver place the adapter matrices. Against ``PeftModel`` on one device at TP=2:
logits, loss, every adapter gradient (``is_trainable=True``), greedy ``generate``; loss and gradients at TP=4,
at TP=3 (heads split unevenly) and TP=1; the adapters add only rank-r sized collectives to the plan; the base model is frozen
(no gradient, no gradient buffer) and a default load freezes the adapter too (PEFT's inference default);
transformers' names on a parallel base model: ``load_adapter`` (same checks), ``add_adapter`` (logits unchanged,
B being zero; loss and gradients as PEFT's with the same A), ``active_adapters``, a second adapter refused; ``parallelize(peft_model)`` (same checks); ``merge_and_unload`` (PEFT's merged logits, no adapter left); GPT-2's
fused Conv1D projections (fan_in_fan_out, q/k/v in one weight) trained and merged;
``save_pretrained`` writes the adapter only (PEFT's layout) and PEFT loads it to the same logits. Refused by
name before any capture: other PEFT methods, LoRA options not supported yet (DoRA), a pickled adapter."""
from __future__ import annotations

import json
import os

import pytest
import torch

from distributed import run_ranks

TARGETS = ["q_proj", "v_proj", "o_proj", "gate_proj", "down_proj"]


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


def _trained(adapter, group, rank, tp, ids, model=None, ref=None) -> dict:
    """Loss and every adapter gradient at ``group``'s layout against PeftModel's (``ref``, by default the
    adapter's); which parameters take gradients. ``model``: by default ``parallelize(adapter)``."""
    import fxparallel
    from fxparallel.capture.adapters import hf_name, is_adapter_parameter

    model = model or fxparallel.parallelize(adapter, group, dtype=torch.float32, is_trainable=True)
    ref = ref or _reference(adapter, trainable=True)
    loss, ref_loss = model(input_ids=ids, labels=ids).loss, ref(input_ids=ids, labels=ids).loss
    loss.backward()
    ref_loss.backward()
    out = {"loss": (loss - ref_loss).abs().item()}
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


def _ranks(rank, world, adapter):
    import torch.distributed as dist
    from peft import LoraConfig

    import fxparallel
    from checks import raised
    from fxparallel.runtime import gather_full_state_dict

    ids = torch.randint(0, 128, (2, 9), generator=torch.Generator().manual_seed(0))
    # training: the adapter's gradients against PEFT's, the base frozen
    out = _trained(adapter, dist.group.WORLD, rank, world, ids)
    # transformers' names: load_adapter on a parallel base model, add_adapter (PEFT's initialization)
    base_dir = os.path.join(os.path.dirname(adapter), "base")
    model = fxparallel.parallelize(base_dir, dist.group.WORLD, dtype=torch.float32)
    model.load_adapter(adapter, is_trainable=True)
    out["load_adapter"] = _trained(adapter, dist.group.WORLD, rank, world, ids, model=model)
    out["active"] = model.active_adapters()
    out["second adapter"] = raised(lambda: model.load_adapter(adapter))
    model = fxparallel.parallelize(base_dir, dist.group.WORLD, dtype=torch.float32)
    with torch.no_grad():
        before = model(input_ids=ids).logits
    model.add_adapter(LoraConfig(r=4, lora_alpha=8, target_modules=TARGETS))
    with torch.no_grad():
        out["added: logits unchanged (B is zero)"] = (model(input_ids=ids).logits - before).abs().max().item()
    ref = _with_weights(base_dir, LoraConfig(r=4, lora_alpha=8, target_modules=TARGETS),
                        gather_full_state_dict(model, to_rank0_only=False))
    out["add_adapter"] = _trained(adapter, dist.group.WORLD, rank, world, ids, model=model, ref=ref)
    # a PeftModel in memory (its adapter trainable there, so here)
    model = fxparallel.parallelize(_reference(adapter, trainable=True), dist.group.WORLD, dtype=torch.float32)
    out["peft model"] = _trained(adapter, dist.group.WORLD, rank, world, ids, model=model)
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
    # saved at TP=2: the adapter alone, as PEFT writes it, loaded by PEFT on one device
    saved = os.path.join(os.path.dirname(adapter), "saved")
    model.save_pretrained(saved)
    dist.barrier()
    out["files"] = sorted(os.listdir(saved))
    with torch.no_grad():
        out["reloaded"] = (_reference(saved, trainable=False)(input_ids=ids).logits - ref(input_ids=ids).logits
                           ).abs().max().item()
    # merged into the base shards: PEFT's merge_and_unload, no adapter left
    merged = model.merge_and_unload()
    with torch.no_grad():
        out["merged"] = (merged(input_ids=ids).logits - ref.merge_and_unload()(input_ids=ids).logits).abs().max().item()
    out["left after merging"] = [n for n, _ in merged.named_parameters() if ".lora_" in n] + merged.active_adapters()
    return out


def _other_layouts(rank, world, adapter):
    """TP=4 on the world; TP=3 (heads split unevenly) on ranks 0-2 and TP=1 on rank 3."""
    import torch.distributed as dist

    ids = torch.randint(0, 128, (2, 9), generator=torch.Generator().manual_seed(0))
    out = {4: _trained(adapter, dist.group.WORLD, rank, world, ids)}
    mine, _ = dist.new_subgroups_by_enumeration([[0, 1, 2], [3]])
    tp = dist.get_world_size(mine)
    out[tp] = _trained(adapter, mine, dist.get_rank(mine), tp, ids)
    return out


def _check_training(r):
    assert r["loss"] < 1e-5 and r["grad"] < 1e-5, r
    assert r["adapter matrices"] == r["reference adapter matrices"] == 2 * len(TARGETS) * 2, r
    assert r["base with grad"] == [], r


def test_lora_adapter_matches_peft_at_tp4_uneven_tp3_and_tp1(tmp_path):
    adapter = _adapter(str(tmp_path))
    results = run_ranks(4, _other_layouts, adapter)
    assert sorted(results[0]) == [3, 4] and sorted(results[3]) == [1, 4]
    for r in results:
        for layout in r.values():
            _check_training(layout)


def test_adapters_add_no_hidden_sized_collective(tmp_path):
    """The plan's collectives with the adapter: the base model's hidden-sized ones unchanged (kinds,
    directions, counts), plus r floats per token for each adapter path (plan/adapter_placements.py), at TP=2
    and TP=4; the plan says why each adapter matrix is placed where it is."""
    import fxparallel

    adapter = _adapter(str(tmp_path))
    hidden, r = 64 * 4, 4 * 4  # bytes per token: an activation, a rank-r value (float32)
    for tp in (2, 4):
        base, _ = fxparallel.plan_model(str(tmp_path / "base"), tp, dtype=torch.float32)
        lora, _ = fxparallel.plan_model(adapter, tp, dtype=torch.float32)

        def sized(plan, size):
            return sorted((c.kind, c.direction, c.count) for c in plan.collectives if c.bytes_per_token == size)

        assert sized(lora, hidden) == sized(base, hidden), (tp, lora.collectives)
        extra = [c for c in lora.collectives if c not in base.collectives]
        assert extra and all(c.bytes_per_token == r and ".lora_" in c.where for c in extra), (tp, extra)
        placed = {p.name: str(p.placement) for p in lora.params if "layers.0." in p.name and ".lora_" in p.name}
        assert placed["model.layers.0.self_attn.q_proj.lora_A.default.weight"] == "R", placed
        assert placed["model.layers.0.self_attn.q_proj.lora_B.default.weight"] == "S(0)", placed
        assert placed["model.layers.0.mlp.down_proj.lora_A.default.weight"] == "S(1)", placed
        assert placed["model.layers.0.mlp.down_proj.lora_B.default.weight"] == "R", placed
        assert "LoRA of a column-parallel layer" in lora.param("model.layers.0.self_attn.q_proj.lora_B.default.weight"
                                                              ).reason


def test_lora_adapter_matches_peft_at_tp2(tmp_path):
    adapter = _adapter(str(tmp_path))
    for r in run_ranks(2, _ranks, adapter):
        _check_training(r)
        _check_training(r["load_adapter"])
        _check_training(r["add_adapter"])
        _check_training(r["peft model"])
        assert r["added: logits unchanged (B is zero)"] == 0.0 and r["active"] == ["default"], r
        assert "the model holds adapter 'default' already; one adapter is supported" in r["second adapter"], r
        assert r["logits"] < 1e-5 and r["reloaded"] < 1e-5 and r["trainable by default"] == [], r
        assert r["merged"] < 1e-5 and r["left after merging"] == [], r
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
