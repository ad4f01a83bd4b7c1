"""Stock ``transformers.Trainer`` over dp x tp (issue 31): 4 ranks, the model parallelized over the tp sub-mesh of
``fxparallel.runtime.init_mesh(tp=2, dp=2)``. Trainer reads the dp size from the model's
``config.distributed_config`` and splits the data over dp only; the parameters are DTensors over the (dp, tp) mesh,
so that its clipping takes the true global norm; gradients are averaged over dp once per optimizer step
(accelerate's ``no_sync`` between the micro-batches of gradient accumulation), bucket by bucket within the
backward. Against the single-device Trainer on the same global batches: losses, clipped grad norms, every final
weight; every rank of a tp position holds the same shard and replicated weights are bit-identical on all four; ``save_model`` writes what transformers loads as the
trained model, and so does ``dcp.save(model.state_dict())``; Trainer checkpoints (``fxparallel.TrainerCheckpoints``)
resume to the uninterrupted run (test_trainer_stack's ``_resumed`` over the tp sub-mesh); the same Trainer run on a
model under fxparallel's FSDP over dp (``apply_data_parallel``) gives the same losses, clipped norms and weights, and
its Trainer checkpoints resume likewise (the optimizer states FSDP's chunks of the tp shards); TRL's
SFTTrainer trains a
LoRA adapter over dp x tp with PeftModel's results. A model parallelized over a ProcessGroup cannot say which ranks
are its data-parallel peers: refused, naming the mesh to use; so is a mesh whose tp groups are not consecutive ranks
(accelerate's data split assumes they are)."""
from __future__ import annotations

from distributed import run_ranks
from test_trainer_stack import _check_resumed, _resumed, _sft_run, _single_process, _trainer_run


def _dp_tp(rank, world, path, root):
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from safetensors.torch import load_file, save_file
    from torch.distributed.device_mesh import init_device_mesh
    from transformers import AutoModelForCausalLM

    import fxparallel
    from checks import raised
    from fxparallel import trainer_data_parallel
    from fxparallel.accelerate_cpu import allow_tensor_parallel_on_cpu
    from fxparallel.runtime import init_mesh

    allow_tensor_parallel_on_cpu()
    mesh = init_mesh(tp=2, dp=2)
    out = {}
    over_group = fxparallel.parallelize(path, mesh.tp_mesh.get_group(), dtype=torch.float32)
    out["over_group"] = raised(lambda: over_group.tp_size)
    out["over_group_clip"] = raised(lambda: torch.nn.utils.clip_grad_norm_(over_group.parameters(), 1.0))
    tp_outer = init_device_mesh("cpu", (2, 2), mesh_dim_names=("tp", "dp"))  # tp groups {0, 2} and {1, 3}
    out["tp_outer"] = raised(lambda: fxparallel.parallelize(path, tp_outer["tp"], dtype=torch.float32).tp_size)

    # buckets of 16 KiB (DDP's 25 MiB would hold the whole tiny model): every case here averages bucket by bucket
    trainer_data_parallel.BUCKET_BYTES = 16 * 1024
    model = fxparallel.parallelize(path, mesh.tp_mesh, dtype=torch.float32)
    averages, starts = [], []
    model.tp_size  # noqa: B018 -- Trainer's first read; here to count the averages that follow
    dp = model.__dict__["_dtensor_data_parallel"]
    average, start_bucket = dp.average, dp._start_bucket
    dp.average = lambda: (averages.append(len(starts)), average())[1]
    dp._start_bucket = lambda i: (starts.append(i), start_bucket(i))[1]
    out["trainer"] = _trainer_run(model, f"{root}/dp{rank}", save_to=f"{root}/saved", rows=32, sampling="sequential")
    # per optimizer step: the buckets started in order, every one before the backward's end (each within the
    # backward, as its last gradient was written)
    out["buckets"] = (len(dp.buckets), starts, averages)
    out["averages"] = len(averages)
    out["placements"] = sorted({str(p.placements) for _, p in model.named_parameters()})
    local = torch.cat([p.detach().flatten() for _, p in model.local_named_parameters()])
    copies = [torch.empty_like(local) for _ in range(world)]
    dist.all_gather(copies, local)
    tp_rank = mesh.tp_rank
    out["same_shard_over_dp"] = all(torch.equal(copies[r], local) for r in range(world) if r % 2 == tp_rank)

    if rank == 0:
        single = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        out["trainer_ref"] = _single_process(_trainer_run, single, f"{root}/single", batch=4, rows=32,
                                              sampling="sequential")
        save_file({n: p.detach().contiguous() for n, p in single.named_parameters()}, f"{root}/single.safetensors")
    dist.barrier()
    ref = load_file(f"{root}/single.safetensors")
    out["weights"] = max((p.detach() - model.plan.param(n).shard_of(ref[n], tp_rank, 2)).abs().max().item()
                         for n, p in model.local_named_parameters())
    replicated = [p.detach().flatten() for n, p in model.local_named_parameters()
                  if not model.plan.param(n).placement.is_shard]
    local = torch.cat(replicated)
    dist.all_gather(copies := [torch.empty_like(local) for _ in range(world)], local)
    out["replicated_identical"] = all(torch.equal(c, local) for c in copies)
    out["replicated_count"] = len(replicated)
    saved = AutoModelForCausalLM.from_pretrained(f"{root}/saved", dtype=torch.float32)
    out["saved_equals_shards"] = all(torch.equal(model.plan.param(n).shard_of(p.detach(), tp_rank, 2),
                                                 dict(model.local_named_parameters())[n].detach())
                                     for n, p in saved.named_parameters())
    # the DCP habit at dp x tp: every dp replica describes the same pieces; the checkpoint holds the full weights
    dcp.save(model.state_dict(), checkpoint_id=f"{root}/dcp")
    whole = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).state_dict()
    dcp.load(whole, checkpoint_id=f"{root}/dcp")
    out["dcp_equals_saved"] = all(torch.equal(whole[n], p.detach()) for n, p in saved.state_dict().items())
    out["fsdp"] = _fsdp_trainer(rank, mesh, path, root, ref)
    out["resumed"] = _resumed(rank, world, path, root, tp_group=mesh.tp_mesh)
    out["sft_lora"] = _sft_lora(rank, mesh, root)
    out["accelerate"] = _accelerate_loop(rank, mesh, path, root)
    return out


def _fsdp_trainer(rank, mesh, path, root, ref):
    """The same Trainer run on a model under fxparallel's FSDP over dp (``apply_data_parallel``; trainer_fsdp.py):
    every weight after it (gathered over dp and tp) against the single-device run's (``ref``), and what
    ``save_model`` wrote; Trainer checkpoints (``TrainerCheckpoints``) resume to the uninterrupted run under FSDP too;
    ``train_step`` refused on it. Under HSDP the same weights: 2 replicas of 1 shard at tp 2, and 2 replicas of 2
    shards at tp 1 (one row per rank per micro-batch: the same global batches)."""
    import torch
    from transformers import AutoModelForCausalLM

    import fxparallel
    from checks import raised
    from fxparallel.runtime import apply_data_parallel, init_mesh, train_step
    from fxparallel.runtime.dtensor import full_tensor
    from fxparallel.runtime.fsdp import reshard

    def run(on, name, batch=2, save_to=None):  # (trainer results, {name: trained full tensor}, the model)
        model = apply_data_parallel(fxparallel.parallelize(path, on.tp_mesh, dtype=torch.float32), on)
        if name == "fsdp":  # FSDP's reduction held back by no_sync, micro-batch by one
            sync = model.set_requires_gradient_sync
            model.set_requires_gradient_sync = lambda flag, **how: (syncs.append(flag), sync(flag, **how))[1]
        results = _trainer_run(model, f"{root}/{name}{rank}", save_to=save_to, rows=32, sampling="sequential",
                               batch=batch)
        reshard(model)
        return results, {model.plan.param(n).name: full_tensor(p, model.plan.param(n), on).clone()
                         for n, p in model.local_named_parameters()}, model

    syncs = []
    out = {"syncs": syncs}
    out["trainer"], trained, model = run(mesh, "fsdp", save_to=f"{root}/fsdp_saved")
    out["weights"] = max((t - ref[n]).abs().max().item() for n, t in trained.items())
    saved = AutoModelForCausalLM.from_pretrained(f"{root}/fsdp_saved", dtype=torch.float32)
    out["saved_equals_trained"] = all(torch.equal(p.detach(), trained[n]) for n, p in saved.named_parameters())
    ids = torch.randint(0, 128, (2, 9), generator=torch.Generator().manual_seed(5))
    out["train_step"] = raised(lambda: train_step(model, torch.optim.SGD(model.parameters(), lr=0.0),
                                                  {"input_ids": ids}, mesh))
    hsdp = {"hsdp tp2": (init_mesh(tp=2, dp=2, dp_shard=1), 2), "hsdp tp1": (init_mesh(tp=1, dp=4, dp_shard=2), 1)}
    # the checkpoint saved under FSDP resumed at tp 1 under HSDP too
    out["resumed"] = _resumed(rank, 4, path, root, tp_group=mesh.tp_mesh, data_parallel=mesh,
                              other_layout=(hsdp["hsdp tp1"][0].tp_mesh, *hsdp["hsdp tp1"]))
    for name, (on, batch) in hsdp.items():
        results, trained, _ = run(on, name.replace(" ", "_"), batch)
        out[name] = results, max((t - ref[n]).abs().max().item() for n, t in trained.items())
    return out


def _accelerate_loop(rank, mesh, path, root):
    """accelerate's own loop over dp x tp, the optimizer built before ``prepare`` as accelerate's examples build it
    (its parameters are then the plain shards; the DTensor views start at prepare): gradient accumulation 2,
    clipping, AdamW, against one process stepping the same global batches."""
    import torch
    import torch.distributed as dist
    from accelerate import Accelerator
    from accelerate.utils import ParallelismConfig
    from transformers import AutoModelForCausalLM

    import fxparallel
    from test_trainer_stack import _reset_accelerate

    _reset_accelerate()
    model = fxparallel.parallelize(path, mesh.tp_mesh, dtype=torch.float32)
    before = {n: p.detach().clone() for n, p in model.local_named_parameters()}
    rows = torch.randint(0, 100, (16, 12), generator=torch.Generator().manual_seed(3))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=2,
                              parallelism_config=ParallelismConfig(tp_size=2, dp_shard_size=2))
    model, optimizer, loader = accelerator.prepare(model, optimizer, torch.utils.data.DataLoader(rows, batch_size=2))
    losses, norms = [], []
    for batch in loader:  # dp rank d's micro-batch m of step s: rows of loader batch 2 * (2 s + m) + d
        with accelerator.accumulate(model):
            loss = model(input_ids=batch, labels=batch).loss
            accelerator.backward(loss)
            if accelerator.sync_gradients:
                norms.append(accelerator.clip_grad_norm_(model.parameters(), 1.0).item())
            optimizer.step()
            optimizer.zero_grad()
        losses.append(loss.detach())
    dist.all_reduce(means := torch.stack(losses), group=mesh.dp_cp_group)
    out = {"losses": (means / 2).tolist(), "norms": norms}
    if rank == 0:
        single = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        reference = torch.optim.AdamW(single.parameters(), lr=1e-3)
        ref_losses, ref_norms = [], []
        for step in range(2):
            for micro in range(2):
                first = 2 * (2 * step + micro)
                batch = rows[2 * first: 2 * first + 4]  # loader batches `first` and `first + 1`, the two dp ranks'
                loss = single(input_ids=batch, labels=batch).loss
                (loss / 2).backward()
                ref_losses.append(loss.item())
            ref_norms.append(torch.nn.utils.clip_grad_norm_(single.parameters(), 1.0).item())
            reference.step()
            reference.zero_grad()
        out["ref"] = ref_losses, ref_norms
        torch.save({n: p.detach() for n, p in single.named_parameters()}, f"{root}/accelerate_single.pt")
    dist.barrier()
    ref = torch.load(f"{root}/accelerate_single.pt")
    out["weights"] = max((p.detach() - model.plan.param(n).shard_of(ref[n], mesh.tp_rank, 2)).abs().max().item()
                         for n, p in model.local_named_parameters())
    out["moved"] = min((p.detach() - before[n]).abs().max().item() for n, p in model.local_named_parameters())
    return out


def _sft_lora(rank, mesh, root):
    """TRL's SFTTrainer training a LoRA adapter over dp x tp, against PeftModel's in one process on the same global
    batches: logged losses, grad norms, entropies, token accuracies, and the trained adapter."""
    import torch
    import torch.distributed as dist
    from peft import LoraConfig, PeftModel, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import fxparallel
    from models import save_with_tokenizer

    path, adapter = f"{root}/with_tokenizer", f"{root}/sft-adapter"
    if rank == 0:
        save_with_tokenizer(path)
        config = LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", init_lora_weights=False)
        get_peft_model(AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32), config).save_pretrained(adapter)
    dist.barrier()
    tokenizer = AutoTokenizer.from_pretrained(path)
    parallel = fxparallel.parallelize(path, mesh.tp_mesh, dtype=torch.float32)
    parallel.load_adapter(adapter, is_trainable=True)
    out = {"dp_tp": _sft_run(parallel, tokenizer, f"{root}/sft-lora{rank}")}
    ours = parallel.get_adapter_state_dict()  # gathers over tp: every rank takes part
    if rank == 0:
        single = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32), adapter,
                                           is_trainable=True)
        out["single"] = _single_process(_sft_run, single, tokenizer, f"{root}/sft-lora-single", batch=4)
        theirs = {k.removeprefix("base_model.model.").replace(".default.", "."): p.detach()
                  for k, p in single.named_parameters() if ".lora_" in k}
        out["adapter"] = (sorted(ours) == sorted(theirs), max((ours[k] - theirs[k]).abs().max().item() for k in theirs))
    return out


def test_trainer_over_dp_and_tp(checkpoints, tmp_path):
    results = run_ranks(4, _dp_tp, checkpoints["llama"], str(tmp_path))
    ref_losses, ref_norms, ref_counters = results[0]["trainer_ref"]
    assert max(ref_norms) > 0.5  # the clipping acted
    for r in results:
        losses, norms, counters = r["trainer"]
        assert len(losses) == 4 == len(ref_losses)
        # Trainer's tokens seen and total flos, summed over the dp x tp processes: the single process's
        assert counters == ref_counters and ref_counters[0] > 0, (counters, ref_counters)
        for ours, theirs in zip(losses + norms, ref_losses + ref_norms):
            assert abs(ours - theirs) <= 1e-5 * max(1.0, abs(theirs)), (losses, ref_losses, norms, ref_norms)
        assert r["weights"] < 1e-5, r["weights"]
        assert r["averages"] == 4, r["averages"]  # once per optimizer step: not after the no_sync micro-batch
        buckets, starts, averages = r["buckets"]
        assert buckets > 3 and starts == list(range(buckets)) * 4, r["buckets"]
        assert averages == [buckets * step for step in range(1, 5)], r["buckets"]  # none left for the end
        assert all(p.startswith("(Replicate(), ") for p in r["placements"]), r["placements"]
        assert r["same_shard_over_dp"] and r["replicated_identical"] and r["replicated_count"] == 5, r
        assert r["saved_equals_shards"] and r["dcp_equals_saved"], r
        _check_resumed(r["resumed"])
        # fxparallel's FSDP over dp under Trainer: the single-device run's losses, clipped norms (the true global
        # norm: before, each tp rank clipped by its own, 1.47 and 1.43 where one device gives 2.05), counters and
        # weights; save_model writes the trained weights
        fsdp = r["fsdp"]
        assert fsdp["trainer"][2] == ref_counters, (fsdp["trainer"], ref_counters)
        for ours, theirs in zip(fsdp["trainer"][0] + fsdp["trainer"][1], ref_losses + ref_norms, strict=True):
            assert abs(ours - theirs) <= 1e-5 * max(1.0, abs(theirs)), (fsdp["trainer"], ref_losses, ref_norms)
        assert fsdp["weights"] < 1e-5 and fsdp["saved_equals_trained"], fsdp
        assert fsdp["syncs"] == [False, True] * 4, fsdp["syncs"]  # one reduction per optimizer step
        assert fsdp["train_step"].startswith("ValueError: train_step: this model was handed to transformers.Trainer"), \
            fsdp["train_step"]
        _check_resumed(fsdp["resumed"])  # TrainerCheckpoints under FSDP: the optimizer states are FSDP's chunks
        for name in ("hsdp tp2", "hsdp tp1"):  # HSDP: its views over (dp_replicate, dp_shard, tp)
            (losses, norms, counters), weights = fsdp[name]
            assert counters == ref_counters and weights < 1e-5, (name, fsdp[name], ref_counters)
            for ours, theirs in zip(losses + norms, ref_losses + ref_norms, strict=True):
                assert abs(ours - theirs) <= 1e-5 * max(1.0, abs(theirs)), (name, fsdp[name], ref_losses, ref_norms)
        lora = r["sft_lora"]
        for key, ours in lora["dp_tp"].items():
            theirs = results[0]["sft_lora"]["single"][key]
            assert len(ours) == 3 and all(abs(a - b) <= 1e-5 * max(1.0, abs(b)) for a, b in zip(ours, theirs)), (
                key, ours, theirs)
        assert "assume consecutive ranks form each tp group" in r["tp_outer"] and "[[0, 2], [1, 3]]" in r["tp_outer"], \
            r["tp_outer"]
        assert "the world has 4 ranks and the model's tp group 2" in r["over_group"] and \
            "init_mesh(tp=..., dp=...).tp_mesh" in r["over_group"], r["over_group"]
        assert r["over_group_clip"].startswith("DTensorParametersError: torch.nn.utils.clip_grad_norm_(model.parameters(), ...)") and \
            "init_mesh(tp=..., dp=...).tp_mesh" in r["over_group_clip"], r["over_group_clip"]
        ours, theirs = r["accelerate"], results[0]["accelerate"]["ref"]
        for a, b in zip(ours["losses"] + ours["norms"], theirs[0] + theirs[1]):
            assert abs(a - b) <= 1e-5 * max(1.0, abs(b)), (ours, theirs)
        assert len(ours["losses"]) == 4 and len(ours["norms"]) == 2 and max(theirs[1]) > 1.0, (ours, theirs)
        assert ours["weights"] < 1e-5 and ours["moved"] > 5e-4, ours  # every tensor was trained (AdamW: ~lr a step)
    same_keys, adapter_error = results[0]["sft_lora"]["adapter"]
    assert same_keys and adapter_error < 1e-5, adapter_error
