"""DistributedDataParallel around the parallel model, as users wrap it, is refused on every rank before any
shard changes (DDP's broadcast would copy rank 0's shards over rank 1's). transformers.Trainer does not wrap
it: it reads ``model.tp_size`` and takes transformers' tensor-parallel path, which accelerate refuses on a
CPU job (on GPUs it trains: test_trainer_stack.py); nothing changes either way."""
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
    result["unchanged"] = all(torch.equal(before[n], p) for n, p in model.local_named_parameters())
    return result


def test_ddp_and_trainer_refuse_the_parallel_model(checkpoints, tmp_path):
    results = run_ranks(2, _wrapped, checkpoints["llama"], str(tmp_path / "trainer"))
    for r in results:
        assert "DistributedDataParallel was given fxparallel's tensor-parallel model" in r.get("ddp", ""), r
        assert "ParallelismConfig is only compatible" in r.get("trainer", ""), r  # no DDP: transformers' TP path
        assert r["unchanged"]
