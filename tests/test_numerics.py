"""Parallelized models equal the single-device model: loss, logits, every gradient (fp32, 1e-5)."""
from __future__ import annotations

import pytest

from distributed import run_ranks

FAMILIES = ("llama", "mistral", "qwen2", "qwen3-tied")
TOL = 1e-5


def _compare_families(rank, tp, paths):
    import torch
    import torch.distributed as dist

    import fxparallel
    from checks import compare
    from models import reference

    results = {}
    for family, path in paths.items():
        model = fxparallel.parallelize(path, dist.group.WORLD, dtype=torch.float32)
        results[family] = compare(model, reference(path), rank, tp)
        results[family]["plan"] = model.plan.to_dict()
    return results


@pytest.mark.parametrize("tp, families", [(1, ("llama", "qwen3-tied")), (2, FAMILIES), (4, ("llama", "qwen3-tied"))])
def test_families_match_single_device(checkpoints, tp, families):
    paths = {f: checkpoints[f] for f in families}
    per_rank = run_ranks(tp, _compare_families, paths)
    for rank, results in enumerate(per_rank):
        for family in families:
            r = results[family]
            assert r["loss"] < TOL, (family, rank, r)
            assert r["logits"] < TOL, (family, rank, r)
            assert r["grad"] < TOL, (family, rank, r)
            # with labels, logits stay vocab-sharded: no gather of the full logits
            assert not r["logits_gathered_with_labels"]
            assert r["local_logits"][-1] == 128 // tp
    # every rank derived the same plan
    plans = [results[f]["plan"] for results in per_rank for f in families[:1]]
    assert all(p == plans[0] for p in plans)


def _train(rank, tp, path, steps):
    import torch
    import torch.distributed as dist

    import fxparallel
    from checks import batch
    from models import reference

    model = fxparallel.parallelize(path, dist.group.WORLD, dtype=torch.float32)
    ref = reference(path)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    params_before = {n: id(p) for n, p in model.named_parameters()}
    losses, ref_losses = [], []
    data = batch(model.config.vocab_size, b=2, s=10, seed=0)
    for step in range(steps):
        ids = data[:, : 8 + step % 3]  # the sequence length changes too
        for m, o, record in ((model, opt, losses), (ref, ref_opt, ref_losses)):
            o.zero_grad()
            loss = m(input_ids=ids, labels=ids).loss
            loss.backward()
            o.step()
            record.append(loss.item())
    same_params = params_before == {n: id(p) for n, p in model.named_parameters()}
    return losses, ref_losses, same_params, len(model.graphs())


def test_adamw_follows_single_device_loss_curve(checkpoints):
    per_rank = run_ranks(2, _train, checkpoints["llama"], 10)
    for losses, ref_losses, same_params, n_graphs in per_rank:
        assert len(losses) == 10
        assert max(abs(a - b) for a, b in zip(losses, ref_losses)) < 1e-4, (losses, ref_losses)
        assert losses[-1] < losses[0]  # it trains
        assert same_params and n_graphs == 1  # new sequence lengths reuse the graph and the parameters
