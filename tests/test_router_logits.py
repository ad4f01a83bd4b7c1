"""transformers' ``output_router_logits`` on the parallel model (``fxparallel/router_outputs.py``): a
mixture-of-experts model trained with the load-balancing loss. At tp=2 the loss (holding the term), ``aux_loss``,
every layer's ``router_logits`` and every gradient equal the single-device model's (and with sequence parallelism
the loss, term and router logits), whether the flag comes from the checkpoint's config, the argument, or the config
changed after ``parallelize``; with Trainer's
``num_items_in_batch`` the term is added after the normalization, as transformers adds it; the tuple of
``return_dict=False`` is transformers'; generate's tokens are unchanged; a dense model is refused by name. Under
context parallelism (tp 1 x cp 2) the term is the whole sequences' and the loss and every gradient the single
device's; a function other than the forward's term is refused. Stock
TRL ``SFTTrainer``, which turns the loss on for every MoE model (its fused LM head then adds it), gives the
single-device SFTTrainer's losses, grad norms, entropy, token accuracy and weights (whole experts per rank).
``output_tokens_per_expert=True`` counts the tokens routed to each expert of every MoE layer as the single-device
model's experts modules receive them (DeepSeek-V3's biased grouped routing, experts per rank; Qwen3-MoE)."""
from __future__ import annotations

import os
import sys

import pytest

from distributed import run_ranks

sys.path.insert(0, os.path.join(os.path.dirname(__file__), os.pardir, "benchmarks"))


@pytest.fixture(scope="module")
def router_checkpoints(tmp_path_factory):
    from transformers import AutoTokenizer

    from models import save_checkpoint, save_with_tokenizer, tiny_config as dense
    from tiny_configs import tiny_config

    root = tmp_path_factory.mktemp("router")
    tokenizer = AutoTokenizer.from_pretrained(save_with_tokenizer(str(root / "tokenizer")))
    sft = save_checkpoint(tiny_config("mixtral", vocab_size=len(tokenizer), pad_token_id=0, bos_token_id=1,
                                      eos_token_id=2), str(root / "sft"))
    tokenizer.save_pretrained(sft)
    return {
        "sft": sft,
        # a checkpoint saved with the flag on (fine-tuned with the load-balancing loss)
        "mixtral": save_checkpoint(tiny_config("mixtral", output_router_logits=True), str(root / "mixtral")),
        "qwen3_moe": save_checkpoint(tiny_config("qwen3_moe"), str(root / "qwen3_moe")),
        # a term weighted enough to move the loss and gradients well past the tolerance
        "qwen3_moe_weighted": save_checkpoint(tiny_config("qwen3_moe", router_aux_loss_coef=0.5),
                                              str(root / "qwen3_moe_weighted")),
        "gpt_oss": save_checkpoint(tiny_config("gpt_oss"), str(root / "gpt_oss")),
        "deepseek_v3": save_checkpoint(tiny_config("deepseek_v3"), str(root / "deepseek_v3")),
        "llama": save_checkpoint(dense(), str(root / "llama")),
    }


def _router_errors(out, ref) -> dict:
    return {"aux": (out.aux_loss - ref.aux_loss).abs().item(),
            "layers": (len(out.router_logits), len(ref.router_logits)),
            "router": max((a - b).abs().max().item() for a, b in zip(out.router_logits, ref.router_logits))}


def _run(rank, tp, paths):
    import warnings

    import torch
    import torch.distributed as dist

    warnings.filterwarnings("ignore")
    import fxparallel
    from checks import batch, compare, raised
    from models import reference

    group, results = dist.group.WORLD, {}
    for name, expert_parallel in (("mixtral", False), ("gpt_oss", True)):  # the flag from the checkpoint's config
        model = fxparallel.parallelize(paths[name], group, dtype=torch.float32, expert_parallel=expert_parallel)
        ref = reference(paths[name])
        if name == "gpt_oss":
            model.config.output_router_logits = ref.config.output_router_logits = True  # changed after parallelize
        ids = batch(model.config.vocab_size)
        errors = compare(model, ref, rank, tp, ids=ids, gather_logits=True)
        out, expected = model(input_ids=ids, labels=ids), ref(input_ids=ids, labels=ids)
        plain = ref(input_ids=ids, labels=ids, output_router_logits=False).loss
        results[name] = dict(errors, **_router_errors(out, expected), term=(expected.loss - plain).abs().item(),
                             tokens=(model.generate(ids[:, :4], max_new_tokens=5, do_sample=False).tolist(),
                                     ref.generate(ids[:, :4], max_new_tokens=5, do_sample=False).tolist()))

    # the argument, on a model whose config leaves it off
    model = fxparallel.parallelize(paths["qwen3_moe"], group, dtype=torch.float32)
    ref = reference(paths["qwen3_moe"])
    ids = batch(model.config.vocab_size)
    errors = compare(model, ref, rank, tp, ids=ids, gather_logits=True, output_router_logits=True)
    labels = ids.clone()
    labels[:, :3] = -100
    asked = dict(input_ids=ids, labels=labels, output_router_logits=True, num_items_in_batch=torch.tensor(23))
    out, expected = model(**asked), ref(**asked)
    as_tuple = model(input_ids=ids, labels=ids, output_router_logits=True, gather_logits=True, return_dict=False)
    ref_tuple = ref(input_ids=ids, labels=ids, output_router_logits=True, return_dict=False, use_cache=False)
    results["qwen3_moe"] = dict(
        errors, **_router_errors(out, expected), items=(out.loss - expected.loss).abs().item(),
        off=(model(input_ids=ids, labels=ids).loss - ref(input_ids=ids, labels=ids).loss).abs().item(),
        off_fields=(model(input_ids=ids, labels=ids).aux_loss, model(input_ids=ids).router_logits),
        tuple_kinds=([type(v).__name__ for v in as_tuple], [type(v).__name__ for v in ref_tuple]),
        tuple_aux=(as_tuple[1] - ref_tuple[1]).abs().item())

    # sequence parallelism: the MoE blocks keep whole rows, so the routers' logits are whole too
    model = fxparallel.parallelize(paths["qwen3_moe"], group, dtype=torch.float32, sequence_parallel=True)
    even = ids[:, :8]
    out, expected = (m(input_ids=even, labels=even, output_router_logits=True) for m in (model, ref))
    results["sequence_parallel"] = dict(_router_errors(out, expected), loss=(out.loss - expected.loss).abs().item())

    # tokens per expert, for any router: DeepSeek-V3's grouped routing with its bias (no router logits in
    # transformers) with experts per rank, and Qwen3-MoE's top-k of a softmax
    for name, expert_parallel in (("deepseek_v3", True), ("qwen3_moe", False)):
        model = fxparallel.parallelize(paths[name], group, dtype=torch.float32, expert_parallel=expert_parallel)
        results[f"counts {name}"] = _counts(model, reference(paths[name]), batch(model.config.vocab_size, 2, 16))

    results["context parallel"] = _context_parallel(rank, paths["qwen3_moe_weighted"])
    dense = fxparallel.parallelize(paths["llama"], group, dtype=torch.float32)
    results["refused"] = raised(lambda: dense(input_ids=ids % 128, output_router_logits=True))
    results["counts refused"] = raised(lambda: dense(input_ids=ids % 128, output_tokens_per_expert=True))
    results["sft"] = _sft(rank, tp, paths["sft"])
    return results


def _context_parallel(rank, path) -> dict:
    """Qwen3-MoE over 2 cp ranks (tp 1), the term asked for: each rank's ``aux_loss`` is the whole sequences' (the
    single device's), its ``router_logits`` are its own tokens' rows of the single device's, and the ranks' losses
    weighted by their label tokens (as ``runtime.scaled_loss`` weights them), backpropagated and summed over the cp
    ranks, give the single device's loss and every parameter's gradient."""
    import torch
    import torch.distributed as dist

    import fxparallel
    from checks import batch, raised
    from fxparallel.ops.context_parallel_attention import global_positions
    from fxparallel.runtime import init_mesh, split_for_context_parallel
    from fxparallel.runtime.loss_normalization import label_tokens
    from models import reference

    mesh = init_mesh(tp=1, cp=2)
    model = fxparallel.parallelize(path, mesh.tp_mesh, dtype=torch.float32, cp_group=mesh.cp_mesh)
    ref = reference(path)
    ids = batch(model.config.vocab_size, 2, 16)
    local = split_for_context_parallel({"input_ids": ids}, mesh.cp_rank, mesh.cp)
    out = model(**local, output_router_logits=True)
    expected = ref(input_ids=ids, labels=ids, output_router_logits=True)
    mine = label_tokens(local["labels"], shifted=True)
    total = mine.clone()
    dist.all_reduce(total, group=mesh.cp_mesh.get_group())
    weighted = (out.loss * mine / total).detach()
    (out.loss * mine / total).backward()
    expected.loss.backward()
    dist.all_reduce(weighted, group=mesh.cp_mesh.get_group())
    grads = dict(model.local_named_parameters())
    for p in grads.values():
        dist.all_reduce(p.grad, group=mesh.cp_mesh.get_group())
    function, experts, top_k = model.load_balancing  # a function other than the one the forward computes: refused
    model.load_balancing, model._balancing_checked = (lambda *a: 2 * function(*a), experts, top_k), False
    other = raised(lambda: model(**local, output_router_logits=True))
    positions = global_positions(ids.shape[1] // 2, mesh.cp_rank, mesh.cp)
    rows = [r.view(2, 16, -1)[:, positions].reshape(32 // 2, -1) for r in expected.router_logits]
    return {"aux": (out.aux_loss - expected.aux_loss).abs().item(), "loss": (weighted - expected.loss).abs().item(),
            "term": (expected.aux_loss * ref.config.router_aux_loss_coef).item(),
            "router": max((a - b).abs().max().item() for a, b in zip(out.router_logits, rows)),
            "grad": max((grads[n].grad - p.grad).abs().max().item() for n, p in ref.named_parameters()),
            "grads": len(grads), "other": other}


def _counts(model, ref, ids) -> dict:
    """``tokens_per_expert`` against the experts the single-device model's experts modules are given (counted by a
    hook on them), and the loss of the same call against one without counting."""
    import torch

    from fxparallel.capture.expert_counts import experts_modules

    seen = []
    for _, module, experts in experts_modules(ref):
        module.register_forward_pre_hook(
            lambda m, args, experts=experts: seen.append(torch.bincount(args[1].flatten(), minlength=experts)))
    out = model(input_ids=ids, labels=ids, output_tokens_per_expert=True)
    ref(input_ids=ids, labels=ids)
    return {"ours": out.tokens_per_expert.tolist(), "theirs": torch.stack(seen).tolist(),
            "loss": (out.loss - model(input_ids=ids, labels=ids).loss).abs().item()}


def _sft(rank, tp, path):
    """Stock SFTTrainer on the parallel Mixtral at tp=2 (whole experts per rank; experts split inside train through
    Trainer too: tests/test_trainer_stack.py) and on transformers' in a job of one process."""
    import tempfile

    import torch
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import fxparallel
    from fxparallel.accelerate_cpu import allow_tensor_parallel_on_cpu
    from test_trainer_stack import _sft_run, _single_process

    allow_tensor_parallel_on_cpu()
    tokenizer, root = AutoTokenizer.from_pretrained(path), tempfile.mkdtemp()
    parallel = fxparallel.parallelize(path, dist.group.WORLD, dtype=torch.float32, expert_parallel=True)
    single = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    out = {"tp2": _sft_run(parallel, tokenizer, f"{root}/tp"),
           "single": _single_process(_sft_run, single, tokenizer, f"{root}/single"),
           "enabled": (parallel.config.output_router_logits, single.config.output_router_logits)}
    weights = dict(single.named_parameters())
    out["weights"] = max((p.detach() - parallel.plan.param(n).shard_of(weights[n].detach(), rank, tp)).abs().max()
                         .item() for n, p in parallel.local_named_parameters())
    return out


def test_router_logits_and_load_balancing_loss(router_checkpoints):
    for r in run_ranks(2, _run, router_checkpoints):
        for name in ("mixtral", "gpt_oss", "qwen3_moe"):
            got = r[name]
            assert max(got["loss"], got["logits"], got["grad"], got["aux"], got["router"]) < 1e-5, (name, got)
            assert got["layers"][0] == got["layers"][1] == 2, (name, got["layers"])
        for name in ("mixtral", "gpt_oss"):
            assert r[name]["term"] > 1e-4, r[name]  # the loss holds a load-balancing term the test can see
            assert r[name]["tokens"][0] == r[name]["tokens"][1], r[name]["tokens"]
        for name, layers in (("deepseek_v3", 1), ("qwen3_moe", 2)):  # (DeepSeek-V3's first layer is dense)
            got = r[f"counts {name}"]
            assert got["ours"] == got["theirs"] and len(got["ours"]) == layers and got["loss"] == 0, (name, got)
            assert sum(got["ours"][0]) == 2 * 16 * 2, got  # every token's top-2 choices
        cp = r["context parallel"]
        assert max(cp["aux"], cp["loss"], cp["router"], cp["grad"]) < 1e-5 and cp["term"] > 0.1, cp
        assert cp["grads"] == 25 and "computes a load-balancing loss other than its module's" in cp["other"], cp
        assert "output_tokens_per_expert=True: llama has no experts modules" in r["counts refused"], r["counts refused"]
        sp = r["sequence_parallel"]
        assert max(sp["loss"], sp["aux"], sp["router"]) < 1e-5 and sp["layers"] == (2, 2), sp
        q = r["qwen3_moe"]
        assert q["items"] < 1e-5 and q["off"] < 1e-5, q
        assert q["off_fields"] == (None, None), q["off_fields"]
        assert q["tuple_kinds"][0] == q["tuple_kinds"][1] and q["tuple_aux"] < 1e-6, q
        assert "output_router_logits=True: the forward of llama has no output_router_logits" in r["refused"], \
            r["refused"]
        sft = r["sft"]
        assert sft["enabled"] == (True, True), sft  # TRL turned the load-balancing loss on
        for key, ours in sft["tp2"].items():
            theirs = sft["single"][key]
            assert len(ours) == 3 and all(abs(a - b) <= 1e-5 * max(1.0, abs(b)) for a, b in zip(ours, theirs)), (
                key, ours, theirs)
        assert sft["weights"] < 1e-5, sft
