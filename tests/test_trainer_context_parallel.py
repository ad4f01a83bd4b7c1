"""Stock ``transformers.Trainer`` with context parallelism (issue 31): ``TrainingArguments(parallelism_config=
ParallelismConfig(dp_shard_size=dp, cp_size=2, tp_size=tp))`` on a model parallelized over accelerate's
(dp, cp, tp) mesh, ``parallelize(path, mesh["tp"], cp_group=mesh["cp"])``. 4 ranks, tp 2 x cp 2 and dp 2 x cp 2.
Trainer cuts each step's rows with torch's ``context_parallel`` (head-tail chunks, the model's own layout) and
the model takes its ``shift_labels``. Against the single-device Trainer on the same global batches: losses and
clipped grad norms (gradient accumulation with ``num_items_in_batch``, gradient checkpointing, a learning-rate
schedule), Trainer's counters, every final weight, and the evaluation loss. Replicated weights are bit-identical on
all four ranks, ``save_model`` writes the trained model, and Trainer checkpoints (``fxparallel.TrainerCheckpoints``)
resume to the uninterrupted run. Refused by name (``trainer_context_parallel.py``):

- a ParallelismConfig that is missing or lacks a size;
- a model without cp group in a step torch has cut, or given accelerate's attention hooks;
- calls outside a cut step;
- ``predict``;
- an attention mask with padding in one cp rank's chunks only, refused on every rank."""
from __future__ import annotations

from distributed import run_ranks
from test_trainer_stack import _reset_accelerate, _single_process, _trainer_run

LAYOUTS = {"tp2 cp2": ((1, 2, 2), dict(batch=2, mask=True)),
           "dp2 cp2": ((2, 2, 1), dict(batch=2, rows=32, sampling="sequential"))}


def _eval_loss(model, out_dir, **arguments) -> float:
    """Trainer's ``evaluate()`` loss (``prediction_loss_only``) on 4 rows of 8 tokens."""
    import torch
    from transformers import Trainer, TrainingArguments

    g = torch.Generator().manual_seed(11)
    data = [{"input_ids": ids, "labels": list(ids)} for ids in (torch.randint(0, 128, (8,), generator=g).tolist()
                                                                for _ in range(4))]
    args = TrainingArguments(output_dir=out_dir, per_device_eval_batch_size=2, report_to=[], use_cpu=True,
                             save_strategy="no", prediction_loss_only=True, **arguments)
    return Trainer(model=model, args=args, eval_dataset=data).evaluate()["eval_loss"]


def _context_parallel(rank, world, path, root):
    import torch
    import torch.distributed as dist
    from accelerate import ParallelismConfig
    from accelerate.big_modeling import _attach_context_parallel_hooks
    from safetensors.torch import load_file, save_file
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.experimental import context_parallel
    from transformers import AutoModelForCausalLM, Trainer, TrainingArguments

    import fxparallel
    from checks import raised
    from fxparallel.accelerate_cpu import allow_tensor_parallel_on_cpu

    allow_tensor_parallel_on_cpu()
    out = {}
    if rank == 0:  # the single-device Trainer on the same global batches: dp 2 x 2 rows per step are 4
        for name, (sizes, run) in LAYOUTS.items():
            single = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
            batch = run["batch"] * sizes[0]
            out[name] = _single_process(_trainer_run, single, f"{root}/single", length=8, **{**run, "batch": batch})
            out[name + " eval"] = _single_process(_eval_loss, single, f"{root}/single_eval")
            save_file({n: p.detach().contiguous() for n, p in single.named_parameters()}, f"{root}/{name}.safetensors")
    dist.barrier()
    for name, ((dp, cp, tp), run) in LAYOUTS.items():
        _reset_accelerate()
        mesh = init_device_mesh("cpu", (dp, cp, tp), mesh_dim_names=("dp", "cp", "tp"))
        model = fxparallel.parallelize(path, mesh["tp"], cp_group=mesh["cp"], dtype=torch.float32)
        config = ParallelismConfig(dp_shard_size=dp, cp_size=cp, tp_size=tp)
        if tp > 1:  # before any step (the model unchanged): no ParallelismConfig, and one without tp_size
            arguments = TrainingArguments(output_dir=f"{root}/refused", use_cpu=True, report_to=[])
            out["no config"] = raised(lambda: Trainer(model=model, args=arguments))
            arguments = TrainingArguments(output_dir=f"{root}/refused", use_cpu=True, report_to=[],
                                          parallelism_config=ParallelismConfig(cp_size=cp))
            out["cp only"] = raised(lambda: Trainer(model=model, args=arguments))
            _reset_accelerate()
        shards = dict(model.local_named_parameters())  # (trained in place below)
        checkpoints = dict(save_strategy="steps", save_steps=2, save_only_model=True,
                           callbacks=[fxparallel.TrainerCheckpoints()]) if tp > 1 else {}
        result = {"trainer": _trainer_run(model, f"{root}/{name}", save_to=f"{root}/{name} saved", length=8,
                                          parallelism_config=config, **run, **checkpoints)}
        if tp > 1:  # a fresh model resumed from the checkpoint after step 2: the uninterrupted run's steps 3 and 4
            _reset_accelerate()
            resumed = fxparallel.parallelize(path, mesh["tp"], cp_group=mesh["cp"], dtype=torch.float32)
            result["resumed"] = _trainer_run(resumed, f"{root}/{name}", length=8, parallelism_config=config,
                                             resume=f"{root}/{name}/checkpoint-2", **run, **checkpoints)
            result["resumed weights"] = max((p.detach() - shards[n]).abs().max().item()
                                            for n, p in resumed.local_named_parameters())
        result["eval"] = _eval_loss(model, f"{root}/{name} eval{rank}", parallelism_config=config)
        ref = load_file(f"{root}/{name}.safetensors")
        result["weights"] = max((p.detach() - model.plan.param(n).shard_of(ref[n], mesh["tp"].get_local_rank(), tp))
                                .abs().max().item() for n, p in shards.items())
        replicated = torch.cat([p.detach().flatten() for n, p in shards.items()
                                if not model.plan.param(n).placement.is_shard])
        dist.all_gather(copies := [torch.empty_like(replicated) for _ in range(world)], replicated)
        result["replicated_identical"] = all(torch.equal(c, replicated) for c in copies)
        saved = AutoModelForCausalLM.from_pretrained(f"{root}/{name} saved", dtype=torch.float32)
        result["saved"] = max((p.detach() - ref[n]).abs().max().item() for n, p in saved.named_parameters())
        ids = torch.randint(0, 128, (2, 8), generator=torch.Generator().manual_seed(2))
        result["whole rows"] = raised(lambda: model(input_ids=ids, labels=ids))
        if tp > 1:
            arguments = TrainingArguments(output_dir=f"{root}/predict", per_device_eval_batch_size=2, use_cpu=True,
                                          report_to=[], save_strategy="no", parallelism_config=config)
            rows = [{"input_ids": r, "labels": r} for r in ids.tolist()]
            result["predict"] = raised(lambda: Trainer(model=model, args=arguments).predict(rows))
            # padding in chunk 0 only (cp rank 0's): every rank refuses, none is left waiting
            padded, mask = ids.clone(), torch.ones_like(ids)
            mask[0, 0] = 0
            with context_parallel(mesh["cp"], buffers=[padded, mask], buffer_seq_dims=[1, 1],
                                  no_restore_buffers={padded, mask}):
                result["padding"] = raised(lambda: model(input_ids=padded, attention_mask=mask, labels=padded))
            plain = fxparallel.parallelize(path, mesh["tp"], dtype=torch.float32)  # no cp group
            cut = ids.clone()
            with context_parallel(mesh["cp"], buffers=[cut], buffer_seq_dims=[1], no_restore_buffers={cut}):
                result["no cp group"] = raised(lambda: plain(input_ids=cut))
            result["hooks"] = raised(lambda: _attach_context_parallel_hooks(plain))
        out[name + " ranks"] = result
    return out


def test_trainer_with_context_parallelism(checkpoints, tmp_path):
    results = run_ranks(4, _context_parallel, checkpoints["llama"], str(tmp_path))
    for name in LAYOUTS:
        ref_losses, ref_norms, ref_counters = results[0][name]
        assert max(ref_norms) > 0.5, ref_norms  # the clipping acted
        for r in results:
            ours = r[name + " ranks"]
            losses, norms, counters = ours["trainer"]
            assert len(losses) == 4 == len(ref_losses), (name, losses, ref_losses)
            for a, b in zip(losses + norms, ref_losses + ref_norms, strict=True):
                assert abs(a - b) <= 1e-5 * max(1.0, abs(b)), (name, losses, ref_losses, norms, ref_norms)
            assert counters == ref_counters, (name, counters, ref_counters)
            if "resumed" in ours:  # Trainer checkpoints (fxparallel.TrainerCheckpoints) resume exactly under cp
                assert ours["resumed"] == ours["trainer"] and ours["resumed weights"] == 0.0, (ours["resumed"],
                                                                                             ours["trainer"], ours)
            assert abs(ours["eval"] - results[0][name + " eval"]) < 1e-5, (name, ours["eval"], results[0][name + " eval"])
            assert ours["weights"] < 1e-5 and ours["saved"] < 1e-5 and ours["replicated_identical"], (name, ours)
            assert ours["whole rows"].startswith("ContextParallelError: the parallel model has a cp group of 2 ranks") \
                and "ParallelismConfig(cp_size=2)" in ours["whole rows"], ours["whole rows"]
    for r in results:
        assert r["no config"].startswith("ContextParallelError: Trainer with the parallel model's context "
                                         "parallelism") and "ParallelismConfig(cp_size=2, tp_size=2)" in \
            r["no config"] and "none was given" in r["no config"], r["no config"]
        assert "the one given has dp=1, cp=2, tp=1" in r["cp only"], r["cp only"]
        ours = r["tp2 cp2 ranks"]
        assert ours["predict"].startswith("ContextParallelError: Trainer.predict / evaluate keeping the logits"), \
            ours["predict"]
        assert ours["padding"].startswith("ContextParallelError: ") and "attention_mask is not supported under " \
            "context parallelism" in ours["padding"], ours["padding"]
        assert ours["no cp group"].startswith("ContextParallelError: torch's context_parallel") and \
            "cp_group=mesh['cp']" in ours["no cp group"], ours["no cp group"]
        assert ours["hooks"].startswith("ContextParallelError: accelerate's context parallelism") and \
            "cp_group=mesh['cp']" in ours["hooks"], ours["hooks"]
