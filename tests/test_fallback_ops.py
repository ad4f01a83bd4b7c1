"""An op without a sharding rule runs on gathered (replicated) inputs: the plan promises that fallback is
always correct. Here a real model hits it on real ranks, against the single-device model.

The tiny Llama's MLP is patched (in each rank, and in its single-device reference) to use ``torch.flip``,
which has no rule, twice: on the MLP's hidden units (an activation split across the ranks: gathered, flipped,
and used by ``down_proj``, row-parallel (sliced again) or column-parallel, whose input gradient is then partial
and must be summed before the gather's backward takes this rank's part), and on ``down_proj``'s own weight, split on the same
dimension (a parameter gathered for the op: its gradient from the replicated branch is complete on every rank
and is added to the shard's). Loss, logits and every gradient must match at TP=2, and the plan must list both
fallbacks.

Before the flip, the MLP writes into a view of the hidden units with a tensor index (no rule keeps the shard: the
write runs on a gathered copy of the view, and this rank's part goes back into the view, so the flip, which reads
the hidden units themselves, sees it; before: only readers of the view itself were looked for, and the write was
lost, as in Kimi-Linear's keys filled through slices). A write into a slice taken across the split
(``h[..., 1:3].mul_(2.0)``: the slice is read from a gathered copy) is refused by name (before: lost, loss off by
4e-4).

The MLP also reads one row of ``gate_proj``'s weight, split by rows (``weight[-3]``, as Gemma 4 reads its pad
token's row of the vocabulary-split embedding): that has a rule, not a fallback. The rank holding the row gives it,
the others zeros (a partial sum), so the weight is not gathered, and the row's gradient reaches its owner only.
"""
from __future__ import annotations

import pytest
import torch

from distributed import run_ranks


def flipped_mlp(self, x):
    h = self.act_fn(self.gate_proj(x)) * self.up_proj(x)
    row = h[:, 1]  # a view of the hidden units, split as they are
    row[torch.arange(1, device=h.device)] = 0.0  # a tensor index: written on a gathered copy, then back into the view
    h = torch.flip(h, dims=[-1])  # not elementwise: flipping a sharded dim locally would be wrong
    out = self.down_proj(h)
    # a sharded weight read as a whole by an op without a rule (after down_proj has decided its placement)
    out = out + 0.5 * torch.flip(self.down_proj.weight, dims=[1])[:, :5].sum(-1)
    return out + 0.25 * self.gate_proj.weight[-3]  # one row of a weight split by rows: read from its owner


def slice_writing_mlp(self, x):
    """An in-place write into a slice of the hidden units taken across their split: refused by name."""
    h = self.act_fn(self.gate_proj(x)) * self.up_proj(x)
    h[..., 1:3].mul_(2.0)
    return self.down_proj(h)


def _patch():
    from transformers.models.llama import modeling_llama

    modeling_llama.LlamaMLP.forward = flipped_mlp


def _fallback(rank, tp, path):
    import torch.distributed as dist

    import fxparallel
    from checks import compare
    from fxparallel.errors import ShardingError
    from models import reference

    _patch()  # in this process: the ranks' meta model and the reference run the same code
    model = fxparallel.parallelize(path, dist.group.WORLD)
    errors = compare(model, reference(path), rank, tp, gather_logits=True)
    placements = {p.name: str(p.placement) for p in model.plan.params}
    from transformers.models.llama import modeling_llama

    modeling_llama.LlamaMLP.forward = slice_writing_mlp
    try:
        fxparallel.parallelize(path, dist.group.WORLD)
        refused = "no error"
    except ShardingError as err:
        refused = str(err)
    return errors, list(model.plan.fallbacks), str(model.plan), placements, refused


@pytest.fixture(scope="module")
def fallback_run(checkpoints):
    return run_ranks(2, _fallback, checkpoints["llama"])


def test_fallback_on_real_ranks_matches_single_device(fallback_run):
    for errors, _, _, placements, refused in fallback_run:
        # the ops read sharded values: the MLP is split as usual, so the fallback has something to gather
        assert placements["model.layers.0.mlp.up_proj.weight"] == "S(0)", placements
        # (row- or column-parallel after the gathered flip: the same bytes either way, the solver may take either)
        assert placements["model.layers.0.mlp.down_proj.weight"] in ("S(0)", "S(1)"), placements
        assert errors["loss"] < 1e-5 and errors["logits"] < 1e-5 and errors["grad"] < 1e-5, errors
        # a write into a slice taken across the split would land in a gathered copy (loss off by 4e-4): refused
        assert refused.startswith("mul_ (mul_; File ") and refused.endswith(
            "in slice_writing_mlp) writes in place into a slice of h taken across its split over the tp ranks: the "
            "slice is read from a gathered copy, so the write would not reach h. Not supported: write out of place "
            "(e.g. torch.where, or a new tensor)"), refused


def test_plan_lists_the_fallbacks(fallback_run):
    for _, fallbacks, report, _, _ in fallback_run:
        flips = [f for f in fallbacks if "flip" in f and "gathered" in f]
        # two per layer (the hidden units and down_proj's weight), two layers
        assert len(flips) == 4, fallbacks
        assert "replicated by fallback (gathered):" in report and all(f in report for f in flips)
        assert not [f for f in fallbacks if f.startswith("getitem")], fallbacks  # the row of gate_proj
