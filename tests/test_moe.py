"""Mixture-of-experts layers (Mixtral, Qwen2-MoE with a shared expert, Qwen3-MoE, OLMoE) loaded from saved
per-expert checkpoints: each expert's FFN is split like a dense MLP (gate_up by segments, down by its input
features), the MoE block costs one forward all-reduce, and loss, logits and every gradient equal one device.
At tp=4 the expert and shared-expert widths are odd (30 and 62: 8/8/8/6 and 16/16/16/14 columns), so the
experts are split unevenly in torch.chunk's sizes, the same plan as an even split."""
from __future__ import annotations

import json
import os
import sys

import pytest

from distributed import run_ranks

sys.path.insert(0, os.path.join(os.path.dirname(__file__), os.pardir, "benchmarks"))

TYPES = ("qwen2_moe", "qwen3_moe", "olmoe")  # mixtral: tests/test_coverage.py
TP4 = ("qwen2_moe_uneven",)  # the shared expert too; tp=4 divides neither width
# (transformers' CPU grouped_mm needs 16-byte strides, which 30 floats are not: the reference uses batched_mm)
UNEVEN = dict(moe_intermediate_size=30, shared_expert_intermediate_size=62, experts_implementation="batched_mm")
EXPERTS = ("mlp.experts.gate_up_proj", "mlp.experts.down_proj")


@pytest.fixture(scope="module")
def moe_checkpoints(tmp_path_factory):
    from models import save_checkpoint
    from tiny_configs import tiny_config

    root = tmp_path_factory.mktemp("moe")
    paths = {t: save_checkpoint(tiny_config(t), str(root / t)) for t in TYPES}
    paths["qwen2_moe_uneven"] = save_checkpoint(tiny_config("qwen2_moe", **UNEVEN), str(root / "qwen2_moe_uneven"))
    return paths


def _summary(model, errors, rank, tp) -> dict:
    """What the assertions need from one parallelized model, as plain data."""
    plan, config = model.plan, model.config
    full = {p.name: p for p in plan.params}
    local = dict(model.named_parameters())
    return {
        "errors": {k: errors[k] for k in ("loss", "logits", "grad")},
        "experts": {n: str(p.placement) for n, p in full.items() if n.endswith(EXPERTS)},
        "experts_local": {n: tuple(local[n].shape) for n in full if n.endswith(EXPERTS)},
        "forward": [(c.kind, c.where, c.count) for c in plan.collectives if c.direction == "forward"],
        "backward_hidden": [(c.where, c.count) for c in plan.collectives if c.direction == "backward"
                            and c.kind == "all_reduce" and c.bytes_per_token == 4 * config.hidden_size],
        "bytes_read": model.bytes_read,
        "shard_bytes": sum(p.numel() * p.element_size() for p in model.parameters()),
        "layers": config.num_hidden_layers,
        "intermediate": getattr(config, "moe_intermediate_size", None) or config.intermediate_size,
        "experts_count": getattr(config, "num_experts", None) or config.num_local_experts,
        "hidden": config.hidden_size,
    }


def _check_all(rank, tp, paths):
    import warnings

    import torch
    import torch.distributed as dist

    warnings.filterwarnings("ignore")
    import fxparallel
    from checks import batch, compare
    from models import reference

    out = {}
    for name, path in paths.items():
        model = fxparallel.parallelize(path, dist.group.WORLD, dtype=torch.float32)
        errors = compare(model, reference(path), rank, tp, ids=batch(model.config.vocab_size), gather_logits=True)
        out[name] = _summary(model, errors, rank, tp)
    return out


def _assert_moe(name, tp, rank, r):
    for key, err in r["errors"].items():
        assert err < 1e-5, (name, tp, key, r["errors"])
    from fxparallel.plan.layout import by_rows

    layers, inter, experts, hidden = r["layers"], r["intermediate"], r["experts_count"], r["hidden"]
    # each rank holds its slice of gate and of up of every expert, and its input slice of down
    cols = by_rows(inter, tp)[rank]  # torch.chunk's sizes: 30 at tp=4 is 8/8/8/6
    for param, placement in r["experts"].items():
        gate_up = param.endswith("gate_up_proj")
        assert placement == (f"S(1)[{inter},{inter}]" if gate_up else "S(2)"), (name, param, placement)
        assert r["experts_local"][param] == ((experts, 2 * cols, hidden) if gate_up else (experts, hidden, cols)), \
            (name, param, rank, r["experts_local"][param])
    # forward: the embedding, then per layer one all-reduce after attention and one after the MoE block
    # (routed and shared experts together); the router is replicated, so no gather of router logits
    reduces = [(where, n) for kind, where, n in r["forward"] if kind == "all_reduce"]
    # (OLMoE normalises q and k over all heads: one 4-byte all-reduce of each norm's statistics)
    norm_stats = [(where, n) for where, n in reduces if where.endswith(("q_norm", "k_norm"))]
    assert sum(n for _, n in norm_stats) == (2 * layers if name == "olmoe" else 0), (name, reduces)
    reduces = [x for x in reduces if x not in norm_stats]
    assert sum(n for _, n in reduces) == 2 * layers + 1, (name, r["forward"])
    assert sum(n for where, n in reduces if where.endswith("self_attn.o_proj")) == layers, (name, reduces)
    assert sum(n for where, n in reduces if where.endswith(".mlp")) == layers, (name, reduces)
    assert not [w for kind, w, _ in r["forward"] if kind == "all_gather" and ".mlp" in w], (name, r["forward"])
    # backward: one hidden-sized all-reduce per MoE block input (routed and shared experts share it); the
    # routing weights' gradient (top-k floats per token) and a shared-expert gate's (1 float) are all-reduced too
    moe_inputs = [(where, n) for where, n in r["backward_hidden"] if ".mlp" in where]
    assert len(moe_inputs) == 1 and moe_inputs[0][1] == layers and "mlp.experts" in moe_inputs[0][0], (name, moe_inputs)
    # the loader read exactly this rank's slices (experts: 1/tp of every expert's tensors)
    assert r["bytes_read"] == r["shard_bytes"], (name, r["bytes_read"], r["shard_bytes"])


@pytest.mark.parametrize("tp, types", [(2, TYPES), (4, TP4)])
def test_moe_matches_single_device_with_experts_sharded(moe_checkpoints, tp, types):
    results = run_ranks(tp, _check_all, {t: moe_checkpoints[t] for t in types}, timeout=900)
    for rank, rank_result in enumerate(results):
        for name in types:
            _assert_moe(name, tp, rank, rank_result[name])


def _grouped_mm(rank, tp, path):
    """transformers' grouped_mm kernel (its default off CPU), run on CPU: its integer histogram of tokens per
    expert has no CPU kernel, so the histogram is counted in float here, and the CPU kernel switch is off."""
    import warnings

    import torch
    import torch.distributed as dist

    warnings.filterwarnings("ignore")
    import fxparallel
    import fxparallel.api as api
    from checks import batch, compare
    from models import reference

    api._for_device = lambda config, device: config
    # split inside, as asked (the planner's choice with grouped_mm is whole experts: tests/test_expert_parallel.py)
    model = fxparallel.parallelize(path, dist.group.WORLD, dtype=torch.float32, expert_parallel=False)
    assert all("grouped_mm" in g.code and "bmm" not in g.code for g in model.graphs())
    errors = compare(model, reference(path), rank, tp, ids=batch(model.config.vocab_size), gather_logits=True)
    return _summary(model, errors, rank, tp)


def test_grouped_mm_experts_are_sharded_too(moe_checkpoints, tmp_path):
    import shutil

    path = shutil.copytree(moe_checkpoints["qwen2_moe"], str(tmp_path / "grouped"))
    with open(os.path.join(path, "config.json")) as f:
        config = json.load(f)
    config["experts_implementation"] = "grouped_mm"
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f)
    for rank, r in enumerate(run_ranks(2, _grouped_mm, path)):
        _assert_moe("qwen2_moe grouped_mm", 2, rank, r)


@pytest.mark.parametrize("kernel", ["batched_mm", "grouped_mm"])
def test_interleaved_gate_up_is_column_parallel_with_either_kernel(kernel):
    """GPT-OSS interleaves gate and up (``gate_up[..., ::2]``, ``gate_up[..., 1::2]``): with either experts
    kernel the experts split by columns and rows, Megatron's 2L+1 all-reduces forward (grouped_mm's plan
    sharded the hidden dim before: 7 per layer). Numbers on ranks: tests/test_coverage.py (batched_mm)."""
    import fxparallel
    from tiny_configs import tiny_config

    config = tiny_config("gpt_oss")
    config._experts_implementation = kernel  # as parallelize() picks it by device (grouped_mm off CPU)
    plan, local = fxparallel.plan_model(config, 2, expert_parallel=False)  # (grouped_mm's default: whole experts)
    assert ("grouped_mm" in local.code) == (kernel == "grouped_mm")
    layers = config.num_hidden_layers
    for i in range(layers):
        assert str(plan.param(f"model.layers.{i}.mlp.experts.gate_up_proj").placement) == "S(2)"
        assert str(plan.param(f"model.layers.{i}.mlp.experts.down_proj").placement) == "S(1)"
    assert plan.count("all_reduce", "forward") == 2 * layers + 1 and not plan.fallbacks
    assert plan.count("all_gather", "forward") == 1  # the vocab-parallel cross-entropy statistics


@pytest.mark.parametrize("kernel", ["batched_mm", "grouped_mm"])
def test_narrow_experts_keep_megatrons_minimum(kernel):
    """Experts narrower than the hidden size (16 columns on hidden 64; the 768-on-2048 ratio of Qwen3-30B-A3B and
    smaller): the solver charged the gradient of the block's rows (``x[perm // top_k]``, ``x.repeat_interleave``)
    at top_k times the hidden size where the rewrite reduces it once on ``x``, and chose to shard the hidden size
    instead (15 forward all-reduces for 2 layers). It now charges what the rewrite does: 2L+1."""
    import fxparallel
    from tiny_configs import tiny_config

    config = tiny_config("qwen3_moe", num_experts=16, moe_intermediate_size=16)
    config._experts_implementation = kernel
    plan, _ = fxparallel.plan_model(config, 2, expert_parallel=False)
    assert plan.count("all_reduce", "forward") == 2 * config.num_hidden_layers + 1, plan
    for i in range(config.num_hidden_layers):
        assert str(plan.param(f"model.layers.{i}.self_attn.q_proj.weight").placement) == "S(0)"
