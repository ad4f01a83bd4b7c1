"""DistributedDataParallel around the parallel model, as users and accelerate / transformers.Trainer wrap it,
is refused on every rank before any shard changes (DDP's broadcast would copy rank 0's shards over rank 1's)."""
from __future__ import annotations

from distributed import run_ranks


def _wrapped(rank, world, path, out_dir):
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    import fxparallel
    from fxparallel.data_parallel_guard import DataParallelError

    model = fxparallel.parallelize(path, dist.group.WORLD, dtype=torch.float32)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
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
    except DataParallelError as err:
        result["trainer"] = str(err)
    result["unchanged"] = all(torch.equal(before[n], p) for n, p in model.named_parameters())
    return result


def test_ddp_and_trainer_refuse_the_parallel_model(checkpoints, tmp_path):
    results = run_ranks(2, _wrapped, checkpoints["llama"], str(tmp_path / "trainer"))
    for r in results:
        assert "DistributedDataParallel was given fxparallel's tensor-parallel model" in r.get("ddp", ""), r
        assert "would broadcast rank 0's shards" in r.get("trainer", ""), r  # accelerate's DDP, through Trainer
        assert r["unchanged"]
