"""TP=2 on CUDA, two processes sharing the one lent GPU over a CUDA-only gloo group (``"cuda:gloo"``, which, like
NCCL, has no backend for CPU tensors: a collective on a CPU tensor fails here as it would on NCCL). Against
transformers on the same GPU: loss, logits and every gradient, then three AdamW steps; a LoRA adapter's loss and
every adapter gradient against PeftModel; greedy ``generate`` with left padding eager and with its decode steps
compiled, while CUDA graphs (``mode="reduce-overhead"``), which cannot record gloo's collectives, are refused
before the prefill (measured: the capture failed inside the first compiled step);
``dcp.save(model.state_dict())`` loaded into another parallel model; and
``save_pretrained``, which transformers loads to the same logits; a mixture of experts with the grouped_mm kernel
and the planner's choice of whole experts per rank. Run on a lent GPU by
``benchmarks/gpu_session.sh``; CI has no GPU (the same cases run on CPU over gloo in the rest of the suite)."""
from __future__ import annotations

import pytest
import torch

from distributed import run_ranks

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

MODES = ("eager", "default", "reduce-overhead")


def _attempt(fn):
    """``fn()``'s value, or what it raised (one case failing must not hide the others' results)."""
    try:
        return fn()
    except Exception as err:  # noqa: BLE001 - reported to the test, which asserts on it
        return f"{type(err).__name__}: {str(err)[:600]}"


def _training(model, ref, rank, world, ids) -> dict:
    """compare() against transformers, then three AdamW steps on both: losses and every weight."""
    from checks import compare

    out = {"first": compare(model, ref, rank, world, ids)}
    ref_params = dict(ref.named_parameters(remove_duplicate=False))
    steps = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (model, ref)]
    losses = []
    for _ in range(3):
        pair = []
        for m, opt in zip((model, ref), steps):
            opt.zero_grad(set_to_none=True)
            loss = m(input_ids=ids, labels=ids).loss
            loss.backward()
            opt.step()
            pair.append(loss.item())
        losses.append(abs(pair[0] - pair[1]))
    out["step_losses"] = max(losses)
    out["weights"] = max((p.detach() - model.plan.param(n).shard_of(ref_params[n].detach(), rank, world)).abs().max().item()
                         for n, p in model.named_parameters())
    return out


def _lora(adapter, group, rank, world, ids, device) -> dict:
    import os

    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    import fxparallel
    from fxparallel.capture.adapters import hf_name

    model = fxparallel.parallelize(adapter, group, dtype=torch.float32, is_trainable=True)
    base = AutoModelForCausalLM.from_pretrained(os.path.join(os.path.dirname(adapter), "base"), dtype=torch.float32)
    ref = PeftModel.from_pretrained(base, adapter, is_trainable=True).to(device)
    loss, ref_loss = (m(input_ids=ids, labels=ids).loss for m in (model, ref))
    loss.backward()
    ref_loss.backward()
    ref_params = {hf_name(n.removeprefix("base_model.model.")): p for n, p in ref.named_parameters()}
    trained = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    return {"loss": (loss - ref_loss).abs().item(), "trained": len(trained),
            "ref_trained": sum(p.requires_grad for p in ref.parameters()),
            "grad": max((p.grad - model.plan.param(n).shard_of(ref_params[n].grad, rank, world)).abs().max().item()
                        for n, p in trained)}


def _generate(model, ref, device, modes) -> dict:
    from transformers import CompileConfig

    ids = torch.randint(1, 128, (3, 7), generator=torch.Generator().manual_seed(0)).to(device)
    mask = torch.ones_like(ids)
    mask[0, :3] = 0
    kwargs = dict(input_ids=ids * mask, attention_mask=mask, max_new_tokens=16, do_sample=False, pad_token_id=0)
    expected = ref.generate(**kwargs)
    out = {}
    for mode in modes:
        config = None if mode == "eager" else CompileConfig(fullgraph=True, dynamic=False, mode=mode)
        extra = {} if config is None else {"compile_config": config}
        out[mode] = _attempt(lambda: all(torch.equal(model.generate(**kwargs, **extra), expected) for _ in range(2)))
    return out


def _checkpoint(model, other, root, ids) -> dict:
    """dcp.save of the parallel model's state_dict, loaded into a parallel model of other weights."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    import fxparallel

    with torch.no_grad():
        expected = model(input_ids=ids).logits
    dcp.save(model.state_dict(), checkpoint_id=f"{root}/dcp")
    second = fxparallel.parallelize(other, dist.group.WORLD, dtype=torch.float32)
    with torch.no_grad():
        before = second(input_ids=ids).logits
        state = second.state_dict()
        dcp.load(state, checkpoint_id=f"{root}/dcp")
        second.load_state_dict(state)
        after = second(input_ids=ids).logits
    return {"before": (before - expected).abs().max().item(), "after": (after - expected).abs().max().item()}


def _export(model, root, ids) -> dict:
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM

    model.save_pretrained(f"{root}/export")
    dist.barrier()
    with torch.no_grad():
        ours = model(input_ids=ids).logits
        loaded = AutoModelForCausalLM.from_pretrained(f"{root}/export", dtype=torch.float32).to(ids.device)
        return {"logits": (loaded(input_ids=ids).logits - ours).abs().max().item()}


def _experts(moe, rank, world, device) -> dict:
    """A mixture of experts with transformers' grouped_mm kernel (its default on CUDA), ``expert_parallel`` left
    to the planner: whole experts per rank, against transformers on the same GPU."""
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM

    import fxparallel
    from checks import batch, compare

    model = fxparallel.parallelize(moe, dist.group.WORLD, dtype=torch.float32)
    ref = AutoModelForCausalLM.from_pretrained(moe, dtype=torch.float32).to(device)
    ids = batch(model.config.vocab_size, 2, 9).to(device)
    return {"why": model.plan.experts, "grouped": all("grouped_mm" in g.code for g in model.graphs()),
            **compare(model.train(), ref.train(), rank, world, ids)}


def _cases(rank, world, path, other, adapter, root, moe, modes=MODES):
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM

    import fxparallel
    from checks import batch

    model = fxparallel.parallelize(path, dist.group.WORLD, dtype=torch.float32)
    device = model.device_
    out = {"device": str(device), "params_on_device": all(p.device == device for p in model.parameters())}
    ref = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).to(device)
    ids = batch(128, 2, 9).to(device)
    out["generate"] = _generate(model.eval(), ref.eval(), device, modes)
    out["training"] = _attempt(lambda: _training(model.train(), ref.train(), rank, world, ids))
    out["checkpoint"] = _attempt(lambda: _checkpoint(model, other, root, ids))
    out["export"] = _attempt(lambda: _export(model, root, ids))
    out["lora"] = _attempt(lambda: _lora(adapter, dist.group.WORLD, rank, world, ids, device))
    out["experts"] = _attempt(lambda: _experts(moe, rank, world, device))
    return out


def test_tp2_on_one_gpu_over_cuda_gloo(checkpoints, tmp_path):
    import os
    import sys

    import test_lora
    from models import save_checkpoint, tiny_config

    sys.path.insert(0, os.path.join(os.path.dirname(__file__), os.pardir, "benchmarks"))
    from tiny_configs import tiny_config as any_tiny_config  # (every model type)

    other = save_checkpoint(tiny_config("llama"), str(tmp_path / "other"), seed=1)
    adapter = test_lora._adapter(str(tmp_path / "lora"))
    moe = save_checkpoint(any_tiny_config("qwen3_moe"), str(tmp_path / "moe"))
    results = run_ranks(2, _cases, checkpoints["llama"], other, adapter, str(tmp_path), moe, backend="cuda:gloo",
                        timeout=420)
    for r in results:
        assert r["device"].startswith("cuda") and r["params_on_device"], r
        generated = r["generate"]
        assert generated["eager"] is True and generated["default"] is True, generated
        assert generated["reduce-overhead"].startswith("InputError: generate: compile_config (mode='reduce-overhead') "
                                                       "records the decode steps as CUDA graphs"), generated
        training = r["training"]
        assert isinstance(training, dict), training
        first = training["first"]
        assert first["loss"] < 1e-5 and first["logits"] < 1e-5 and first["grad"] < 1e-5, first
        assert training["step_losses"] < 1e-5 and training["weights"] < 1e-4, training
        assert isinstance(r["checkpoint"], dict) and r["checkpoint"]["before"] > 1e-2, r["checkpoint"]
        assert r["checkpoint"]["after"] < 1e-6, r["checkpoint"]
        assert isinstance(r["export"], dict) and r["export"]["logits"] < 1e-5, r["export"]
        lora = r["lora"]
        assert isinstance(lora, dict) and lora["trained"] == lora["ref_trained"] > 0, lora
        assert lora["loss"] < 1e-5 and lora["grad"] < 1e-5, lora
        experts = r["experts"]  # grouped_mm on CUDA: the planner takes whole experts per rank
        assert isinstance(experts, dict) and experts["grouped"], experts
        assert experts["why"].startswith("whole experts per rank (chosen: transformers' grouped_mm"), experts
        assert experts["loss"] < 1e-5 and experts["logits"] < 1e-5 and experts["grad"] < 1e-5, experts
