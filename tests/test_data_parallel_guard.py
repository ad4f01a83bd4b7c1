"""DistributedDataParallel around the parallel model, as users wrap it, is refused on every rank before any
shard changes (DDP's broadcast would copy rank 0's shards over rank 1's). transformers.Trainer does not wrap
it: it reads ``model.tp_size`` and takes transformers' tensor-parallel path, which accelerate refuses on a
CPU job (on GPUs it trains: test_trainer_stack.py); accelerate's FSDP2 preparation (Trainer's ``fsdp=`` on GPUs)
is refused naming ``apply_data_parallel``; nothing changes either way."""
from __future__ import annotations

from distributed import run_ranks


def _wrapped(rank, world, path, out_dir):
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    import fxparallel
    from fxparallel.data_parallel_guard import DataParallelError

    model = fxparallel.parallelize(path, dist.group.WORLD, dtype=torch.float32)
    before = {n: p.detach().clone() for n, p in model.local_named_parameters()}
    result = {}
    try:
        DistributedDataParallel(model)
    except DataParallelError as err:
        result["ddp"] = str(err)
    from transformers import Trainer, TrainingArguments

    rows = [{"input_ids": [1, 2, 3, 4, 5, 6], "labels": [1, 2, 3, 4, 5, 6]}] * 4
    args = TrainingArguments(output_dir=out_dir, per_device_train_batch_size=2, max_steps=1, report_to=[],
                             use_cpu=True, save_strategy="no", logging_strategy="no")
    try:
        Trainer(model=model, args=args, train_dataset=rows).train()
    except ValueError as err:  # accelerate's: ParallelismConfig needs accelerators
        result["trainer"] = str(err)
    # accelerate's FSDP2 preparation, as Trainer(fsdp=..., fsdp_config={"fsdp_version": 2}) runs it on GPUs (on
    # CPU accelerate makes no FSDP plugin: given here)
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState
    from accelerate.utils import FullyShardedDataParallelPlugin
    from accelerate.utils.fsdp_utils import fsdp2_prepare_model

    AcceleratorState._reset_state(reset_partial_state=True)
    accelerator = Accelerator(cpu=True)
    accelerator.state.fsdp_plugin = FullyShardedDataParallelPlugin(fsdp_version=2)
    try:
        fsdp2_prepare_model(accelerator, model)
    except DataParallelError as err:
        result["fsdp2"] = str(err)
    result["unchanged"] = all(torch.equal(before[n], p) for n, p in model.local_named_parameters())
    return result


def test_ddp_and_trainer_refuse_the_parallel_model(checkpoints, tmp_path):
    results = run_ranks(2, _wrapped, checkpoints["llama"], str(tmp_path / "trainer"))
    for r in results:
        assert "DistributedDataParallel was given fxparallel's tensor-parallel model" in r.get("ddp", ""), r
        assert "ParallelismConfig is only compatible" in r.get("trainer", ""), r  # no DDP: transformers' TP path
        assert r.get("fsdp2", "").startswith("accelerate's FSDP2 (Trainer's fsdp= / fsdp_config"), r
        assert r["unchanged"]
