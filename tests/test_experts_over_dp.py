"""Experts over data-parallel ranks (``parallelize(..., ep_group=mesh.ep_mesh)``, ``init_mesh(ep=...)``): each rank of
an ep group holds a run of the experts and the rows routed to them travel there and back by all-to-all
(``fxparallel/ops/expert_exchange.py``). Three AdamW steps with clipping under FSDP2 equal one process (losses,
gradient norms, every parameter) at dp=2 (ep=2) x tp=2 with whole experts per tp rank (one expert per rank); its
checkpoint resumes at dp=4 (ep=2) x tp=1 (the experts' gradients summed over the two dp blocks) and without ep, and
one saved without ep resumes with it, each step as one process's; each rank reads only its run of the experts; its
export_pretrained loads in transformers with one process's weights. GPT-OSS (biases picked per routed row: an
exchange per product) trains at dp=4 (ep=2) as one process, and so do dp=2 (ep=2) x cp=2 (each cp rank exchanges its
chunks' rows), dp=2 (ep=2) x tp=2 with sequence parallelism and dp=4 (ep=2) under HSDP (dp_shard=2); under bf16 mixed
precision the losses are those without ep (to bf16's rounding). The all-to-alls of a step are counted and their bytes
checked against the rows routed to other ranks' experts (once out and back per MoE block). Greedy generate gives
transformers' tokens at dp=2 (ep=2) x tp=2 under FSDP and without it, under HSDP at dp=4 (ep=2, dp_shard=2) and for
GPT-OSS at dp=4 (ep=2), each dp rank with prompts and
new tokens of its own (those that stop first step on with the others: generation/forward_peers.py), and a call refused
on one dp rank is refused on all of them. Without FSDP, ``model.state_dict()`` and an optimizer's ``state_dict()``
through DCP (each run described as its pieces of the whole tensor) load at another ep layout exactly, and so does
``load_state_dict`` of complete tensors; ``save_pretrained`` and accelerate's ``get_state_dict`` give the complete
tensors on global rank 0. What does not handle a run of experts yet is refused by name."""
from __future__ import annotations

import os
import sys

import pytest

from distributed import run_ranks
from test_expert_parallel import GLOBAL_BATCH, MAX_NORM, SAVE_AT, STEPS, _optimizer, _rows

sys.path.insert(0, os.path.join(os.path.dirname(__file__), os.pardir, "benchmarks"))

RUNS = {"trained": (2, 2, 2), "resumed at ep=2 x tp=1": (1, 4, 2), "resumed without ep": (2, 2, 1),
        "from a checkpoint without ep": (1, 4, 2), "gpt_oss": (1, 4, 2), "with cp": (1, 2, 2),
        "with sp": (2, 2, 2), "with hsdp": (1, 4, 2)}  # (tp, dp, ep)


def _prompts(dp_rank: int):
    """Each dp rank's prompts (two rows, the second left-padded; a length of its own) and new tokens: dp rank 0
    stops first, 6 slots before the end of its cache (128), and waits, stepping with the others for 10 steps
    (generation/forward_peers.py)."""
    import torch

    length, new = (120, 2) if dp_rank == 0 else (5 + 4 * dp_rank, 12)
    ids = torch.randint(3, 64, (2, length), generator=torch.Generator().manual_seed(dp_rank))
    mask = torch.ones_like(ids)
    mask[1, :2] = 0
    return ids, mask, new


def _generated(model, dp_rank: int) -> dict:
    """Greedy generate of this dp rank's prompts, and of a call refused on dp rank 1 only (a 1-D input_ids); the
    returned cache of a rank that waited holds nothing past its last token."""
    from checks import raised

    ids, mask, new = _prompts(dp_rank)
    out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new, return_dict_in_generate=True)
    cache, last = out.cache, out.sequences.shape[1] - 1  # (the last token is never fed: its slot stays empty)

    def slot(i):  # the largest value each cache tensor holds at position i
        return [t.narrow(d, i, 1).abs().max().item() for t in cache.tensors.values()
                for d in range(t.dim()) if t.shape[d] == cache.length]

    return {"tokens": out.sequences.tolist(), "last slot": max(slot(last)), "slot before": min(slot(last - 1)),
            "refused on one": raised(lambda: model.generate(ids[0] if dp_rank == 1 else ids, max_new_tokens=2))}


def _layout_run(path, tp, dp, ep, *, load=None, save=None, steps=range(STEPS), export=None, mixed=None, cp=1,
                sp=False, dp_shard=None, generate=False):
    """Train ``steps`` at (tp, dp, ep), first loading checkpoint ``load``, saving ``save`` before step SAVE_AT; at the
    end, with ``export``, write a Hugging Face directory there and read it back with transformers. ``mixed``:
    runtime's mixed precision ("bf16"); ``cp``: context-parallel size; ``generate``: first generate
    (``_generated``)."""
    import torch
    from torch.distributed.tensor.debug import CommDebugMode

    import fxparallel
    from checks import raised
    from fxparallel.runtime import (StepBatches, apply_data_parallel, export_pretrained, init_mesh, load_checkpoint,
                                    save_checkpoint, train_step)
    from fxparallel.runtime.dtensor import full_tensor
    from fxparallel.runtime.fsdp import reshard
    from fxparallel.ops import expert_exchange as exchange

    mesh = init_mesh(tp=tp, dp=dp, ep=ep, cp=cp, dp_shard=dp_shard)
    dtype = torch.bfloat16 if mixed else torch.float32
    model = apply_data_parallel(fxparallel.parallelize(path, mesh.tp_mesh, dtype=dtype, ep_group=mesh.ep_mesh,
                                                       cp_group=mesh.cp_mesh if cp > 1 else None,
                                                       sequence_parallel=sp), mesh,
                                mixed_precision=mixed)
    generated = _generated(model, mesh.dp_rank) if generate else None
    opt = _optimizer(model.parameters())
    if load:
        load_checkpoint(load, model, opt, mesh)
    data = StepBatches(_rows(), GLOBAL_BATCH, mesh.dp_rank, mesh.dp)
    history, exchanges, volume = [], [], None
    for step in steps:
        if step == SAVE_AT and save:
            save_checkpoint(save, model, opt, mesh, SAVE_AT)
        if ep > 1 and tp == cp == 1 and step == STEPS - 1 and not mixed:  # the bytes the step's exchanges send, and what they carry
            volume = _exchanged(model, data.batch(step)["input_ids"], mesh.ep_rank, ep)
        with CommDebugMode() as comm:
            m = train_step(model, opt, data.batch(step), mesh, max_norm=MAX_NORM)
        history.append((m.loss, m.grad_norm))
        if volume is not None and step == STEPS - 1:
            volume["sent"] = exchange.bytes_sent[model.ep_group.handle]
        exchanges.append({str(op): n for op, n in comm.get_comm_counts().items() if "all_to_all" in str(op)
                          or "alltoall" in str(op)})
    reshard(model)
    params, runs, exported = {}, {}, None
    for name, p in model.named_parameters():
        plan = model.plan.param(name)
        run = getattr(p, "_fxparallel_expert_run", None)
        if run:  # this rank's run of its tp shard's experts, and the full tensor (gathered over ep, then tp)
            runs[plan.name] = (run, tuple(p.shape), plan.placement.is_shard, p.detach().clone())
        params[plan.name] = full_tensor(p, plan, mesh).clone()
    if export:
        export_pretrained(model, mesh, export)
        if mesh.rank == 0:
            from transformers import AutoModelForCausalLM

            exported = dict(AutoModelForCausalLM.from_pretrained(export, dtype=torch.float32).named_parameters())
    return {"history": history, "all-to-alls": exchanges, "volume": volume, "runs": runs, "params": params,
            "exported": exported, "sequence parallel": model.plan.sequence_parallel,
            "tp_rank": mesh.tp_rank, "bytes read": model.bytes_read,
            "exchanges": {tuple(g.code.count(f"{op}(") for op in ("dispatch_rows", "local_grouped_mm", "combine_rows",
                                                                   "exchanged_grouped_mm")) for g in model.graphs()},
            "generated": generated, "dp_rank": mesh.dp_rank,
            "trainer": raised(lambda: model.tp_size) if ep > 1 and tp > 1 else ""}


def _exchanged(model, ids, ep_rank: int, ep: int) -> dict:
    """Before a step at tp=1: the bytes its forward's exchanges should send to other ranks, from the tokens this rank
    routes to each expert: its rows of the other ranks' experts go out hidden wide (to gate_up) and as many come back
    hidden wide (from down), over all ranks; the counter reset."""
    import torch

    from fxparallel.ops import expert_exchange as exchange

    with torch.no_grad():
        counts = model(input_ids=ids, output_tokens_per_expert=True).tokens_per_expert  # [layers, experts]
    first, n = exchange.expert_runs(counts.shape[1], ep)[ep_rank]
    others = int(counts.sum()) - int(counts[:, first:first + n].sum())
    config = model.config
    exchange.bytes_sent[model.ep_group.handle] = 0
    return {"expected": others * 2 * config.hidden_size * 4}


def _held(model, full: dict) -> float:
    """The largest difference between this rank's parameters and their pieces of ``full`` (its tp shard, then its
    run of the experts), and how many of them are runs."""
    diff, runs = 0.0, 0
    group = model.tp_group
    for name, p in model.local_named_parameters():
        piece = model.plan.param(name).shard_of(full[name], group.rank, group.size)
        run = getattr(p, "_fxparallel_expert_run", None)
        if run:
            piece, runs = piece[run[0]:run[0] + run[1]], runs + 1
        diff = max(diff, (p.detach() - piece).abs().max().item())
    return diff, runs


def _state_dicts(path, root) -> dict:
    """Without FSDP, the habits of torch users: ``model.state_dict()`` and an SGD optimizer's ``state_dict()`` (its
    momentum 2 x each weight: one step of lr 0 on gradients 2 x the weights) through DCP at dp=2 (ep=2) x tp=2,
    loaded into zeroed state at dp=4 (ep=2) x tp=1; then ``load_state_dict`` of complete tensors (transformers'
    state dict, halved), and torch's ``get_state_dict`` / ``set_optimizer_state_dict`` with ``full_state_dict``."""
    import copy

    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_optimizer_state_dict
    from transformers import AutoModelForCausalLM

    import fxparallel
    from fxparallel.runtime import init_mesh

    def model_and_optimizer(tp, dp, ep):
        mesh = init_mesh(tp=tp, dp=dp, ep=ep)
        model = fxparallel.parallelize(path, mesh.tp_mesh, dtype=torch.float32, ep_group=mesh.ep_mesh)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.0, momentum=0.9)
        for p in model.parameters():
            p.grad = 2 * p.detach()
        optimizer.step()
        return model, optimizer, mesh

    where = os.path.join(root, "dcp state dicts")
    model, optimizer, mesh = model_and_optimizer(2, 2, 2)
    generated = _generated(model, mesh.dp_rank)  # without FSDP: the ep group's ranks step together
    # complete tensors without FSDP (each run gathered over its ep group, which spans the tp groups: one writer,
    # global rank 0): save_pretrained, and accelerate's get_state_dict (accelerator.save_model's)
    from accelerate import Accelerator

    saved = os.path.join(root, "saved without fsdp")
    model.save_pretrained(saved)
    answered = Accelerator().get_state_dict(model)
    dcp.save({"model": model.state_dict(), "optim": optimizer.state_dict()}, checkpoint_id=where)
    model, optimizer, _ = model_and_optimizer(1, 4, 2)
    state = {"model": model.state_dict(), "optim": optimizer.state_dict()}
    with torch.no_grad():
        for value in list(state["model"].values()) + [v for s in state["optim"]["state"].values() for v in s.values()]:
            value.zero_()  # in place: what comes back is what DCP read
    dcp.load(state, checkpoint_id=where)
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optim"])
    full = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).state_dict()
    if mesh.rank == 0:
        read = AutoModelForCausalLM.from_pretrained(saved, dtype=torch.float32).state_dict()
        complete = {"saved": max((read[n] - t).abs().max().item() for n, t in full.items()),
                    "accelerate": max((answered[n] - t).abs().max().item() for n, t in full.items())}
    else:
        complete = {"saved": None, "accelerate": len(answered)}
    out = {"generated": generated, "dp_rank": mesh.dp_rank, "complete without fsdp": complete, "dcp": _held(model, full), "momentum": max(
        (optimizer.state[p]["momentum_buffer"] - 2 * p.detach()).abs().max().item() for p in model.parameters())}
    model.load_state_dict({name: value / 2 for name, value in full.items()})
    out["complete"] = _held(model, {name: value / 2 for name, value in full.items()})
    # torch's helpers asked for complete tensors: each run gathered over its ep group (then dp and tp), and the
    # complete momenta loaded back into zeroed state
    options = StateDictOptions(full_state_dict=True)
    # (a copy: whole tensors come back as the live ones)
    weights, moments = copy.deepcopy(get_state_dict(model, optimizer, options=options))
    out["complete weights"] = max((weights[n] - full[n] / 2).abs().max().item() for n in full)
    out["complete momenta"] = max((moments["state"][n]["momentum_buffer"] - 2 * full[n]).abs().max().item()
                                  for n in moments["state"])
    own = {p: optimizer.state[p]["momentum_buffer"].clone() for p in model.parameters()}
    for p in model.parameters():
        optimizer.state[p]["momentum_buffer"].zero_()
    set_optimizer_state_dict(model, optimizer, optim_state_dict=moments, options=options)
    out["momenta back"] = all(torch.equal(optimizer.state[p]["momentum_buffer"], v) for p, v in own.items())
    return out


def _accumulated(path) -> float:
    """At dp=4 (ep=2): the experts' gradients of one backward against two backwards of half the loss accumulated
    (each backward's gradient is summed over the other dp block once)."""
    import torch

    import fxparallel
    from fxparallel.runtime import StepBatches, apply_data_parallel, init_mesh

    mesh = init_mesh(tp=1, dp=4, ep=2)
    model = apply_data_parallel(fxparallel.parallelize(path, mesh.tp_mesh, dtype=torch.float32,
                                                       ep_group=mesh.ep_mesh), mesh)
    ids = StepBatches(_rows(), GLOBAL_BATCH, mesh.dp_rank, mesh.dp).batch(0)["input_ids"]
    runs = [p for p in model.parameters() if getattr(p, "_fxparallel_expert_run", None)]
    grads = []
    for parts in (1, 2):
        for p in model.parameters():
            p.grad = None
        for _ in range(parts):
            (model(input_ids=ids, labels=ids).loss / parts).backward()
        grads.append([p.grad.clone() for p in runs])
    return max((a - b).abs().max().item() for a, b in zip(*grads))


def _train(rank, world, path, dense_path, root, oss_path, lora_path):
    """dp=2 (ep=2) x tp=2 trains three steps, saving before the third; that checkpoint resumed at dp=4 (ep=2) x
    tp=1 and at dp=2 x tp=2 without ep, which saves it again; that one resumed at dp=4 (ep=2) x tp=1."""
    import warnings

    warnings.filterwarnings("ignore")
    import fxparallel
    from checks import raised
    from fxparallel.runtime import init_mesh

    a, b = os.path.join(root, "a"), os.path.join(root, "b")
    out = {"rank": rank, "bad ep": raised(lambda: init_mesh(tp=1, dp=4, ep=3)),
           "trained": _layout_run(path, 2, 2, 2, save=a, export=os.path.join(root, "hf"), generate=True),
           "resumed at ep=2 x tp=1": _layout_run(path, 1, 4, 2, load=a, steps=range(SAVE_AT, STEPS)),
           "resumed without ep": _layout_run(path, 2, 2, 1, load=a, save=b, steps=range(SAVE_AT, STEPS)),
           "from a checkpoint without ep": _layout_run(path, 1, 4, 2, load=b, steps=range(SAVE_AT, STEPS)),
           "gpt_oss": _layout_run(oss_path, 1, 4, 2, generate=True),
           "with cp": _layout_run(path, 1, 2, 2, cp=2),
           "with sp": _layout_run(path, 2, 2, 2, sp=True),
           "bf16": _layout_run(path, 1, 4, 2, mixed="bf16", steps=range(2)),
           "bf16 without ep": _layout_run(path, 1, 4, 1, mixed="bf16", steps=range(2)),
           "with hsdp": _layout_run(path, 1, 4, 2, load=a, steps=range(SAVE_AT, STEPS), dp_shard=2,
                                    generate=True)}
    out["accumulated"] = _accumulated(path)
    out["state dicts"] = _state_dicts(path, root)
    mesh = init_mesh(tp=1, dp=4, ep=2)
    out["dense"] = raised(lambda: fxparallel.parallelize(dense_path, mesh.tp_mesh, ep_group=mesh.ep_mesh))
    import json

    from transformers import AutoConfig

    with open(os.path.join(path, "config.json")) as f:
        config = json.load(f)
    batched = AutoConfig.for_model(**config)
    batched._experts_implementation = "batched_mm"
    out["batched_mm"] = raised(lambda: fxparallel.parallelize(batched, mesh.tp_mesh, ep_group=mesh.ep_mesh))
    three = AutoConfig.for_model(**config)
    three.num_experts = 3
    mesh = init_mesh(tp=1, dp=4, ep=4)
    out["too few experts"] = raised(lambda: fxparallel.parallelize(three, mesh.tp_mesh, ep_group=mesh.ep_mesh))
    from peft import LoraConfig

    from test_lora import EXPERT_WEIGHTS

    mesh = init_mesh(tp=1, dp=4, ep=2)  # LoRA on the expert weights: refused before any capture, or any change
    out["expert adapter"] = raised(lambda: fxparallel.parallelize(lora_path, mesh.tp_mesh, ep_group=mesh.ep_mesh))
    model = fxparallel.parallelize(path, mesh.tp_mesh, ep_group=mesh.ep_mesh)
    out["add expert adapter"] = raised(lambda: model.add_adapter(LoraConfig(r=2, target_modules=["q_proj"],
                                                                            target_parameters=EXPERT_WEIGHTS[1:])))
    out["adapter after the refusal"] = raised(lambda: model.active_adapters())
    return out


@pytest.mark.timeout(1200)
def test_experts_over_dp_train_like_one_process_and_checkpoints_load_at_other_layouts(tmp_path):
    import torch

    from checks import single_process_training
    from models import save_checkpoint
    from tiny_configs import tiny_config

    path = save_checkpoint(tiny_config("qwen3_moe"), str(tmp_path / "moe"))
    dense = save_checkpoint(tiny_config("llama"), str(tmp_path / "dense"))
    oss = save_checkpoint(tiny_config("gpt_oss"), str(tmp_path / "gpt_oss"))
    from test_lora import EXPERT_WEIGHTS, _adapter

    lora = _adapter(str(tmp_path / "lora"), tiny_config("qwen3_moe"), target_modules=["q_proj"],
                    target_parameters=EXPERT_WEIGHTS)
    ranks = run_ranks(4, _train, path, dense, str(tmp_path / "ckpt"), oss, lora, timeout=1100)
    refs = {model: single_process_training(p, steps=STEPS, save_at=SAVE_AT, optimizer=_optimizer, rows=_rows(),
                                           global_batch=GLOBAL_BATCH, mask=lambda batch: batch, max_norm=MAX_NORM)
            for model, p in (("qwen3_moe", path), ("gpt_oss", oss))}
    layers = 2
    from transformers import AutoModelForCausalLM

    # generate before training (under FSDP; under HSDP; without FSDP, the ep group's ranks stepping together):
    # transformers' tokens
    for run, p in (("trained", path), ("gpt_oss", oss), ("with hsdp", path), ("state dicts", path)):
        one = AutoModelForCausalLM.from_pretrained(p, dtype=torch.float32)
        for r in ranks:
            ids, mask, new = _prompts(r[run]["dp_rank"])
            got = r[run]["generated"]
            assert got["tokens"] == one.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new,
                                                 do_sample=False).tolist(), (run, r[run]["dp_rank"])
            assert got["last slot"] == 0 and got["slot before"] > 0, (run, got)
            assert got["refused on one"].startswith(
                "InputError: generate: the call was refused on data-parallel rank 1" if r[run]["dp_rank"] != 1 else
                "InputError: generate needs input_ids of shape [batch, prompt length]"), (run, got["refused on one"])
    exported = ranks[0]["trained"]["exported"]  # export_pretrained at dp=2 (ep=2) x tp=2, read by transformers
    assert set(exported) == set(refs["qwen3_moe"]["params"])
    assert max((exported[n] - t).abs().max().item() for n, t in refs["qwen3_moe"]["params"].items()) < 3e-5
    for r in ranks:  # bf16 mixed precision: the runs fp32 masters, cast for each product; as without ep
        for run in ("bf16", "bf16 without ep"):
            for (loss, _), (ref_loss, _) in zip(r[run]["history"], refs["qwen3_moe"]["history"][:2], strict=True):
                assert abs(loss - ref_loss) < 1e-2, (run, r[run]["history"])
        # (the first step's loss the same; then the experts' bf16 gradients are summed inside the product over the
        # ep group's rows, where FSDP sums each rank's in fp32)
        ours, plain = ([loss for loss, _ in r[run]["history"]] for run in ("bf16", "bf16 without ep"))
        assert ours[0] == plain[0] and abs(ours[1] - plain[1]) < 1e-3, (ours, plain)
        assert {t.dtype for t in r["bf16"]["params"].values()} == {torch.float32}
        assert r["bf16"]["exchanges"] == {(layers, 2 * layers, layers, 0)}
    for r in ranks:  # loading reads only this rank's run of its tp shard's experts (checkpoint in fp32)
        unread = sum((of - n) * local[0].numel() * local.element_size()
                     for (_, n, of), _, _, local in r["trained"]["runs"].values())
        assert unread > 0 and r["resumed without ep"]["bytes read"] - r["trained"]["bytes read"] == unread, \
            (r["trained"]["bytes read"], r["resumed without ep"]["bytes read"], unread)
        assert r["accumulated"] < 1e-6, r["accumulated"]
        # DCP of model.state_dict() / optimizer.state_dict() (each rank's run of experts described as pieces of the
        # whole tensor) at dp=2 (ep=2) x tp=2, loaded at dp=4 (ep=2) x tp=1; load_state_dict of complete tensors
        assert r["state dicts"]["dcp"] == (0.0, 2 * layers) and r["state dicts"]["momentum"] == 0.0, r["state dicts"]
        assert r["state dicts"]["complete"] == (0.0, 2 * layers), r["state dicts"]
        assert r["state dicts"]["complete weights"] == 0.0 and r["state dicts"]["complete momenta"] == 0.0, \
            r["state dicts"]
        assert r["state dicts"]["momenta back"], r["state dicts"]
        # save_pretrained and accelerate's get_state_dict without FSDP: complete tensors on global rank 0 (before,
        # the runs were gathered to each tp group's rank 0 at once, and the ranks waited on each other for ever)
        assert r["state dicts"]["complete without fsdp"] == ({"saved": 0.0, "accelerate": 0.0} if r["rank"] == 0 else
                                                            {"saved": None, "accelerate": 0}), r["state dicts"]
        assert r["bad ep"].startswith("GroupError: EP size (3) must divide DP size (4)"), r["bad ep"]
        assert r["dense"].startswith("ShardingError: ep_group: llama has no stacked expert weights"), r["dense"]
        assert r["batched_mm"].startswith("ShardingError: ep_group: the experts kernel is 'batched_mm'"), \
            r["batched_mm"]
        assert r["too few experts"].startswith("ShardingError: ep_group of size 4: qwen3_moe has 3 experts in a layer, "
                                               "fewer than the expert-parallel ranks"), r["too few experts"]
        assert r["expert adapter"].startswith("ShardingError: ep_group: LoRA adapter 'default' targets expert weights "
                                              "(model.layers.0.mlp.experts.down_proj and 3 more)"), r["expert adapter"]
        assert r["add expert adapter"].startswith("ShardingError: ep_group: LoRA adapter 'default' targets expert "
                                                  "weights (model.layers.0.mlp.experts.down_proj and 1 more)"), \
            r["add expert adapter"]
        assert r["adapter after the refusal"].startswith("ArgumentError: active_adapters: no adapter loaded"), \
            r["adapter after the refusal"]
        for run, (tp, dp, ep) in RUNS.items():
            got, ref = r[run], refs["gpt_oss" if run == "gpt_oss" else "qwen3_moe"]
            expected = ref["history"][STEPS - len(got["history"]):]  # (the resumed runs: the steps after SAVE_AT)
            for (loss, norm), (ref_loss, ref_norm) in zip(got["history"], expected, strict=True):
                assert abs(loss - ref_loss) < 1e-5 and abs(norm - ref_norm) < 1e-5, (run, got["history"], expected)
            for name, value in got["params"].items():  # every parameter after the last step, as one process
                assert (value - ref["params"][name]).abs().max().item() < 3e-5, (run, name)
            for name, ((first, n, of), shape, sharded, local) in got["runs"].items():  # this rank's run of experts
                full = ref["params"][name]
                if tp > 1 and sharded:  # whole experts per tp rank (the planner's choice with grouped_mm)
                    per = full.shape[0] // tp
                    full = full[got["tp_rank"] * per:(got["tp_rank"] + 1) * per]
                assert of == full.shape[0] and n in (of // ep, -(-of // ep)) and shape[0] == n, \
                    (run, name, first, n, of, shape)
                assert (local - full[first:first + n]).abs().max().item() < 3e-5, (run, name)
            if ep == 1:
                assert not got["runs"] and got["exchanges"] == {(0, 0, 0, 0)}
                continue
            assert len(got["runs"]) == 2 * layers, (run, got["runs"])
            assert got["sequence parallel"] == (run == "with sp")
            if run == "gpt_oss":  # its biases are picked per routed row between the products: an exchange per product
                assert got["exchanges"] == {(0, 0, 0, 2 * layers)}, got["exchanges"]
                for counts in got["all-to-alls"]:
                    assert counts == {"c10d.alltoall_base_": 2 * layers,
                                      "c10d_functional.all_to_all_single": 8 * layers}, counts
                continue
            # in every graph, each MoE block dispatches its rows once, runs gate_up, the activation and down on them,
            # and combines the products once (rewrite/expert_exchange.py)
            assert got["exchanges"] == {(layers, 2 * layers, layers, 0)}, (run, got["exchanges"])
            for counts in got["all-to-alls"]:  # per block and step: the counts, the rows there and back, and back
                assert counts == {"c10d.alltoall_base_": layers, "c10d_functional.all_to_all_single": 4 * layers}, \
                    (run, counts)
            if tp == 1 and run != "with cp":  # the bytes exchanged, over every rank: each row of another rank's expert
                assert sum(x[run]["volume"]["sent"] for x in ranks) == sum(x[run]["volume"]["expected"] for x in ranks)
                assert ranks[0][run]["volume"]["sent"] > 0
            # at tp > 1 Trainer / accelerate read tp_size for DTensor views, and would average other experts over dp:
            # refused (at tp = 1 they wrap the model in DDP, which the model refuses: data_parallel_guard.py)
            assert tp == 1 or got["trainer"].startswith("DTensorParametersError: transformers.Trainer / accelerate with experts "
                                             "over data-parallel ranks (ep_group) is not supported"), got["trainer"]
