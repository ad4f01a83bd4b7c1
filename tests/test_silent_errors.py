"""Cases that once gave wrong numbers without any error, kept as regressions.

* A row-parallel linear with a bias (added once, after the all-reduce) whose output feeds
  column-parallel layers directly (ELECTRA's ``embeddings_project`` -> layer 0's q/k/v):
  the rewrite replaced the linear by ``all_reduce + bias`` and the backward all-reduce of
  the consumers' input gradient was lost (gradients of everything below off by 5e-3).
* An in-place op whose result is unused (DeepSeek-style group-limited routing builds its
  group mask with ``scatter_``) was removed as dead code (logits off by 3e-2).
* A persistent buffer with trained values in the checkpoint (the routing score bias
  ``e_score_correction_bias``) was left at its initial value instead of being loaded.
"""
from __future__ import annotations

import os
import sys

from distributed import run_ranks

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))


def _errors(rank, tp, paths):
    import warnings

    import torch
    import torch.distributed as dist

    warnings.filterwarnings("ignore")
    import fxparallel
    from checks import batch, compare
    from models import reference

    results = {}
    for name, path in paths.items():
        model = fxparallel.parallelize(path, dist.group.WORLD, dtype=torch.float32)
        errors = compare(model, reference(path), rank, tp, ids=batch(model.config.vocab_size), gather_logits=True)
        buffers = {n: b.tolist() for n, b in model.named_buffers() if "e_score_correction_bias" in n}
        results[name] = {"errors": {k: errors[k] for k in ("loss", "logits", "grad")}, "buffers": buffers}
    return results


BIAS = (0.0, 0.5, -0.5, 0.25)  # routing score bias far from its zero init: it decides which experts run


def test_once_silently_wrong(tmp_path):
    import torch

    from models import edited_copy, save_checkpoint
    from tiny_configs import tiny_config

    electra = save_checkpoint(tiny_config("electra"), str(tmp_path / "electra"))
    # glm4_moe with 2 expert groups, one kept per token
    plain = save_checkpoint(tiny_config("glm4_moe", n_group=2, topk_group=1), str(tmp_path / "plain"))

    def edit(tensors):
        names = [n for n in tensors if n.endswith("e_score_correction_bias")]
        assert names, "the checkpoint stores the routing score bias"
        for n in names:
            tensors[n] = torch.tensor(BIAS)

    glm4_moe = edited_copy(plain, str(tmp_path / "trained_bias"), edit)
    for r in run_ranks(2, _errors, {"electra": electra, "glm4_moe": glm4_moe}, timeout=600):
        for name in ("electra", "glm4_moe"):
            assert max(r[name]["errors"].values()) < 1e-5, (name, r[name]["errors"])
        buffers = r["glm4_moe"]["buffers"]
        assert buffers and all(tuple(b) == BIAS for b in buffers.values()), buffers
