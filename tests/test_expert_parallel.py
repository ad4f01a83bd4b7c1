"""Expert parallelism within the tensor-parallel group (``parallelize(..., expert_parallel=True)``): each rank
holds whole experts (rank r experts [r*E/tp, (r+1)*E/tp), the first ranks one more where tp does not divide E),
reads only those, and the MoE block keeps its one forward all-reduce. Loss, logits and every gradient equal one
device for Mixtral, Qwen2-MoE (shared expert), Qwen3-MoE, OLMoE, GPT-OSS (interleaved gate / up, biases) and
DeepSeek-V3 (shared experts, grouped routing) at tp=2, and an uneven 6 experts at tp=4, with transformers'
batched_mm and grouped_mm kernels; greedy generate gives transformers' tokens; save_pretrained writes the weights
transformers loads; under FSDP2 (dp=2 x tp=2) training equals one process and its checkpoint loads at tp=4. The
rules: ``fxparallel/plan/rules/expert_rows.py``."""
from __future__ import annotations

import json
import os
import sys

import pytest

from distributed import run_ranks

sys.path.insert(0, os.path.join(os.path.dirname(__file__), os.pardir, "benchmarks"))

TYPES = ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "gpt_oss", "deepseek_v3")
UNEVEN = ("qwen3_moe", dict(num_experts=6))  # 6 experts at tp=4: 2/2/1/1


def _experts(config) -> int:
    return getattr(config, "n_routed_experts", None) or getattr(config, "num_local_experts", None) \
        or config.num_experts


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    from models import save_checkpoint
    from tiny_configs import tiny_config

    root = tmp_path_factory.mktemp("ep")
    paths = {t: save_checkpoint(tiny_config(t), str(root / t)) for t in TYPES}
    name, overrides = UNEVEN
    paths["uneven"] = save_checkpoint(tiny_config(name, **overrides), str(root / "uneven"))
    return paths


def _run(rank, tp, paths, generate, export_root=None, expert_parallel=True):
    import warnings

    import torch
    import torch.distributed as dist

    warnings.filterwarnings("ignore")
    import fxparallel
    from checks import batch, compare
    from models import reference

    out = {}
    for name, path in paths.items():
        model = fxparallel.parallelize(path, dist.group.WORLD, dtype=torch.float32, expert_parallel=expert_parallel)
        ref = reference(path)
        ids = batch(model.config.vocab_size)
        errors = compare(model, ref, rank, tp, ids=ids, gather_logits=True)
        local = dict(model.named_parameters())
        code = "".join(g.code for g in model.graphs())
        result = {
            "kernel": ("roll_to_local_rows" in code, "gather_local_experts" in code),
            "errors": {k: errors[k] for k in ("loss", "logits", "grad")},
            "experts": {n: (str(p.placement), tuple(local[n].shape), tuple(p.shape)) for n, p in
                        ((p.name, p) for p in model.plan.params) if ".experts." in n},
            "forward": sorted((c.kind, c.where, c.count, c.bytes_per_token) for c in model.plan.collectives
                              if c.direction == "forward"),
            "backward": sorted((c.kind, c.where, c.count, c.bytes_per_token) for c in model.plan.collectives
                               if c.direction == "backward"),
            "bytes_read": model.bytes_read,
            "shard_bytes": sum(p.numel() * p.element_size() for p in model.parameters()),
            "buffer_bytes": sum(b.numel() * b.element_size() for b in model.buffers()),
            "count": _experts(model.config),
            "layers": model.config.num_hidden_layers,
            "top_k": model.config.num_experts_per_tok,
            "why": model.plan.experts,
        }
        if export_root is not None:  # save_pretrained gathers whole experts: transformers loads the same weights
            from transformers import AutoModelForCausalLM

            model.save_pretrained(os.path.join(export_root, name))
            if rank == 0:
                saved = AutoModelForCausalLM.from_pretrained(os.path.join(export_root, name), dtype=torch.float32)
                mine, theirs = saved.state_dict(), ref.state_dict()  # (DeepSeek-V3's routing-bias buffer too)
                assert set(mine) == set(theirs), set(mine) ^ set(theirs)
                result["export"] = max((mine[n].float() - t.float()).abs().max().item() for n, t in theirs.items())
        if name in generate:
            mask = torch.ones_like(ids[:, :5])
            mask[0, :2] = 0  # left padding
            kwargs = dict(attention_mask=mask, max_new_tokens=6, do_sample=False)
            result["generate"] = torch.equal(model.generate(input_ids=ids[:, :5], **kwargs),
                                             ref.generate(input_ids=ids[:, :5], **kwargs))
        out[name] = result
    return out


def _grouped(rank, tp, paths, generate):
    """transformers' grouped_mm kernel (its default off CPU), run on CPU as tests/test_moe.py runs it: each rank
    computes only its experts' rows. ``expert_parallel`` left to the planner, which picks whole experts."""
    import fxparallel.api as api

    api._for_device = lambda config, device: config
    return _run(rank, tp, paths, generate, expert_parallel=None)


def _plain_plans(paths: dict, tp: int, kernel: str = "batched_mm") -> dict:
    """Collectives of the same models planned without expert parallelism (each expert split like an MLP)."""
    import fxparallel
    from transformers import AutoConfig

    out = {}
    for name, path in paths.items():
        config = AutoConfig.from_pretrained(path)
        config._experts_implementation = kernel  # (what parallelize picks on CPU: batched_mm)
        plan, _ = fxparallel.plan_model(config, tp, expert_parallel=False)
        out[name] = {d: sorted((c.kind, c.where, c.count, c.bytes_per_token) for c in plan.collectives
                               if c.direction == d) for d in ("forward", "backward")}
    return out


def _assert_rank(name, tp, rank, r, plain, kernel="batched_mm"):
    from fxparallel.plan.layout import balanced

    for key, err in r["errors"].items():
        assert err < 1e-5, (name, tp, key, r["errors"])
    mine = balanced(r["count"], tp)[rank]
    assert r["experts"], name
    # grouped_mm: the kernel runs on this rank's rows, rolled to the front; batched_mm: gathers this rank's experts
    assert r["kernel"][0] == (kernel == "grouped_mm") and (r["kernel"][1] or kernel == "grouped_mm"), (name, r["kernel"])
    for param, (placement, local, full) in r["experts"].items():
        assert placement == "S(0)", (name, param, placement)
        assert local == (mine,) + full[1:], (name, param, rank, local, full)
    # no new collective per layer: forward, the calls of splitting each expert like a dense MLP, no more bytes
    # (GPT-OSS's down bias made that plan reduce per (token, expert) pair: twice the bytes); backward, at most
    # the routing weights' gradient (top-k floats per token and layer) more
    calls = lambda cs: sum(c[2] for c in cs)  # noqa: E731
    per_token = lambda cs: sum(c[2] * c[3] for c in cs)  # noqa: E731
    assert calls(r["forward"]) == calls(plain["forward"]), (name, r["forward"], plain["forward"])
    assert per_token(r["forward"]) <= per_token(plain["forward"]), (name, r["forward"], plain["forward"])
    assert calls(r["backward"]) <= calls(plain["backward"]) + r["layers"], (name, r["backward"], plain["backward"])
    assert per_token(r["backward"]) <= per_token(plain["backward"]) + 4 * r["top_k"] * r["layers"], \
        (name, r["backward"], plain["backward"])
    # the loader read this rank's experts only (and buffers the checkpoint holds: DeepSeek-V3's routing bias)
    assert r["shard_bytes"] <= r["bytes_read"] <= r["shard_bytes"] + r["buffer_bytes"], \
        (name, r["bytes_read"], r["shard_bytes"], r["buffer_bytes"])
    if "generate" in r:
        assert r["generate"], name
    if "export" in r:
        assert r["export"] == 0, (name, r["export"])


def test_expert_parallel_matches_single_device(checkpoints, tmp_path):
    paths = {t: checkpoints[t] for t in TYPES}
    plain = _plain_plans(paths, 2)
    results = run_ranks(2, _run, paths, ("mixtral", "gpt_oss"), str(tmp_path), timeout=900)
    assert all("export" in results[0][name] for name in TYPES)
    for rank, rank_result in enumerate(results):
        for name in TYPES:
            _assert_rank(name, 2, rank, rank_result[name], plain[name])


@pytest.mark.parametrize("tp, names", [(2, ("gpt_oss", "deepseek_v3")), (4, ("uneven",))])
def test_expert_parallel_grouped_mm_computes_each_ranks_rows(checkpoints, tmp_path, tp, names):
    import shutil

    paths = {}
    for name in names:  # the checkpoints with transformers' grouped_mm kernel chosen in their config
        paths[name] = shutil.copytree(checkpoints[name], str(tmp_path / name))
        with open(os.path.join(paths[name], "config.json")) as f:
            config = json.load(f)
        config["experts_implementation"] = "grouped_mm"
        with open(os.path.join(paths[name], "config.json"), "w") as f:
            json.dump(config, f)
    plain = _plain_plans(paths, tp, "grouped_mm")
    # generate too (its static cache is filled on meta with batched_mm: meta's grouped_mm takes bfloat16 only)
    results = run_ranks(tp, _grouped, paths, ("gpt_oss",) if tp == 2 else (), timeout=900)
    for rank, rank_result in enumerate(results):
        for name in names:
            _assert_rank(name, tp, rank, rank_result[name], plain[name], "grouped_mm")
            assert rank_result[name]["why"].startswith("whole experts per rank (chosen: transformers' grouped_mm"), \
                rank_result[name]["why"]


def test_expert_parallel_uneven_expert_count(checkpoints, tmp_path):
    paths = {"uneven": checkpoints["uneven"]}
    plain = _plain_plans(paths, 4)
    results = run_ranks(4, _run, paths, ("uneven",), str(tmp_path), timeout=900)
    assert "export" in results[0]["uneven"]
    for rank, rank_result in enumerate(results):
        _assert_rank("uneven", 4, rank, rank_result["uneven"], plain["uneven"])


def test_expert_parallel_plan_report():
    """GPT-OSS (interleaved gate / up, biases): weights and biases split by whole experts, the plan says why,
    nothing falls back to gathering, and the MoE block's one forward all-reduce is on [tokens, hidden]."""
    import fxparallel
    from tiny_configs import tiny_config

    config = tiny_config("gpt_oss")
    plan, local = fxparallel.plan_model(config, 2, expert_parallel=True)
    for i in range(config.num_hidden_layers):
        for name in ("gate_up_proj", "gate_up_proj_bias", "down_proj", "down_proj_bias"):
            p = plan.param(f"model.layers.{i}.mlp.experts.{name}")
            assert str(p.placement) == "S(0)" and p.reason == "expert parallel: whole experts per rank", (name, p)
    assert not plan.fallbacks
    assert "gather_local_experts" in local.code and "mask_foreign_rows" in local.code
    mlp = [c for c in plan.collectives if c.direction == "forward" and c.where == "model.layers.*.mlp"]
    assert len(mlp) == 1 and mlp[0].count == config.num_hidden_layers
    assert mlp[0].bytes_per_token == 4 * config.hidden_size


def test_expert_parallel_bad_input():
    """Refused before any capture, naming what is wrong."""
    import fxparallel
    from fxparallel.errors import ShardingError
    from tiny_configs import tiny_config

    with pytest.raises(ShardingError, match="expert_parallel=True, but the llama model has no mixture-of-experts"):
        fxparallel.plan_model(tiny_config("llama"), 2, expert_parallel=True)
    with pytest.raises(ShardingError, match="has 2 experts in a layer, fewer than the tp size 4"):
        fxparallel.plan_model(tiny_config("mixtral", num_experts=2), 4, expert_parallel=True)


def _collectives(plan) -> dict:
    return {d: (sum(c.count for c in plan.collectives if c.direction == d),
                sum(c.count * c.bytes_per_token for c in plan.collectives if c.direction == d))
            for d in ("forward", "backward")}


def test_the_planner_chooses_whole_experts_with_grouped_mm_and_says_why(kind="qwen3_moe"):
    """``expert_parallel`` left out: with transformers' grouped_mm kernel (its default off CPU, and what a plan
    without a device gets) the planner takes whole experts per rank, the plan asked for with ``True``, at the
    collectives and bytes of splitting every expert; with batched_mm (parallelize's kernel on CPU) it splits every
    expert, the plan asked for with ``False``. The report says which and why; a dense model says nothing."""
    import fxparallel
    from fxparallel.plan.plan import ShardingPlan
    from tiny_configs import tiny_config

    experts = "model.layers.1.mlp.experts.gate_up_proj"
    plans = {}
    for kernel in ("grouped_mm", "batched_mm"):
        config = tiny_config(kind)
        config._experts_implementation = kernel
        plans[kernel] = {ep: fxparallel.plan_model(config, 2, expert_parallel=ep)[0] for ep in (None, True, False)}
    whole, split = plans["grouped_mm"][None], plans["batched_mm"][None]
    count = _experts(tiny_config(kind))
    assert str(whole.param(experts).placement) == "S(0)" and str(split.param(experts).placement) != "S(0)"
    assert whole.experts.startswith("whole experts per rank (chosen: transformers' grouped_mm kernel runs each "
                                    f"expert on its routed rows only, so {count // 2} whole experts"), whole.experts
    split_cost = plans["grouped_mm"][False]  # the collectives of both plans, said in the reason
    calls = sum(c.count for c in split_cost.collectives)
    assert f"against {calls} collectives per step, {split_cost.bytes_per_token():.0f} bytes per token" in whole.experts
    assert split.experts.startswith("every expert split inside (like a dense MLP) (chosen: transformers' "
                                    "batched_mm experts kernel gathers"), split.experts
    for kernel, chosen in (("grouped_mm", True), ("batched_mm", False)):
        asked = plans[kernel][chosen]
        placed = [[(p.name, p.placement) for p in plan.params] for plan in (plans[kernel][None], asked)]
        assert placed[0] == placed[1], kernel
        assert asked.experts.endswith(f"(expert_parallel={chosen})"), asked.experts
    assert _collectives(whole) == _collectives(plans["grouped_mm"][False]), (whole.collectives,)
    assert f"\nexperts: {whole.experts}\n" in str(whole)
    assert ShardingPlan.from_json(whole.to_json()).experts == whole.experts
    dense, _ = fxparallel.plan_model(tiny_config("llama"), 2)
    assert dense.experts == "" and "experts:" not in str(dense)


def test_the_planner_splits_experts_it_cannot_place_whole():
    """Fewer experts than ranks: split inside, said so (``expert_parallel=True`` refuses it); a plan with whole
    experts that costs more collectives, or fails, leaves the split plan; a saved plan decides by its own
    placements, and a contradicting ``expert_parallel`` is refused naming both."""
    import torch

    from fxparallel.capture import build_meta_model
    from fxparallel.errors import ShardingError
    from fxparallel.plan.expert_choice import ExpertChoice, choose_experts, saved_whole_experts, settle
    from fxparallel.plan.placement import S
    from tiny_configs import tiny_config

    import fxparallel

    plan, _ = fxparallel.plan_model(tiny_config("mixtral", num_experts=2), 4)
    assert plan.experts.endswith("(chosen: a layer has 2 experts, fewer than the 4 ranks)"), plan.experts
    assert all(str(p.placement) != "S(0)" for p in plan.params if ".experts." in p.name)
    # the tiny Qwen3-Next with grouped_mm: its split plan replicates the experts' down projections (under 1% of
    # their layer here), so whole experts would cost two collectives more: the planner keeps the split plan, and
    # the line says the form that plan holds and both costs
    config = tiny_config("qwen3_next")
    config._experts_implementation = "grouped_mm"
    plan, _ = fxparallel.plan_model(config, 2)
    down = "model.layers.0.mlp.experts.down_proj"
    assert str(plan.param(down).placement) == "R"
    assert plan.experts == f"the experts' weights partly split ({down} kept whole on every rank) (chosen: whole " \
        "experts per rank would cost 17 collectives per step, 2592 bytes per token + 704 per step against 15 " \
        "collectives per step, 2576 bytes per token + 704 per step; expert_parallel=True forces them)", plan.experts
    # a plan with whole experts that fails: the split plan serves, the report names the error
    pending = ExpertChoice(True, "products", pending=True)
    for error, said in ((ShardingError("expert rows of x come from no expert gather"), "expert rows of x come from "
                         "no expert gather"), (KeyError("y"), "KeyError: 'y'")):
        choice = settle(pending, error, plan, [down])
        assert not choice.whole and choice.why == f"chosen: whole experts per rank cannot be planned for this " \
            f"model: {said}", choice
    meta = build_meta_model(tiny_config("qwen3_moe"), dtype=torch.float32)
    saved = {"model.layers.0.mlp.experts.gate_up_proj": S(0)}
    assert saved_whole_experts(meta, saved) is True and saved_whole_experts(meta, {}) is None
    assert saved_whole_experts(meta, {"model.layers.0.mlp.experts.gate_up_proj": S(1)}) is False
    choice = choose_experts(meta, 2, None, saved_whole=True)
    assert choice.whole and choice.why == "as the saved plan places them"
    with pytest.raises(ShardingError, match=r"expert_parallel=False, but the saved plan \(plan=\) places the "
                                            "experts whole"):
        choose_experts(meta, 2, False, saved_whole=True)


def _sequence_parallel(rank, tp, paths):
    import torch
    import torch.distributed as dist

    import fxparallel
    from checks import batch, compare
    from models import reference

    out = {}
    for name, path in paths.items():
        model = fxparallel.parallelize(path, dist.group.WORLD, dtype=torch.float32, expert_parallel=True,
                                       sequence_parallel=True)
        errors = compare(model, reference(path), rank, tp, ids=batch(model.config.vocab_size, 2, 8),
                         gather_logits=True)
        code = "".join(g.code for g in model.graphs())
        out[name] = dict(errors, scattered=code.count("collectives_reduce_scatter_seq("),
                         experts=str(model.plan.param(next(p.name for p in model.plan.params
                                                           if p.name.endswith("experts.gate_up_proj"))).placement))
    return out


def test_expert_parallel_with_sequence_parallelism(checkpoints):
    """Sequence parallelism keeps the MoE blocks' rows whole (plain TP there), so whole experts per rank compose
    with it: loss, logits and every gradient as one device; DeepSeek-V3's dense first layer and attention run on
    sequence shards (reduce-scatters in its code)."""
    paths = {name: checkpoints[name] for name in ("qwen3_moe", "deepseek_v3")}
    for r in run_ranks(2, _sequence_parallel, paths, timeout=600):
        for name, got in r.items():
            assert got["loss"] < 1e-5 and got["logits"] < 1e-5 and got["grad"] < 1e-5, (name, got)
            assert got["experts"].startswith("S(0)"), (name, got["experts"])
        assert r["deepseek_v3"]["scattered"] > 0, r["deepseek_v3"]


# ---- with FSDP over data-parallel ranks, and checkpoints across expert layouts ----------------------------
STEPS, SAVE_AT, GLOBAL_BATCH, SEQ, MAX_NORM = 3, 2, 8, 16, 0.8


def _rows():
    from fxparallel.runtime import pack_tokens, synthetic_token_stream

    return pack_tokens(synthetic_token_stream(64, 30 * SEQ, seed=3, mean_doc_len=12), SEQ)


def _optimizer(params):
    import torch

    return torch.optim.AdamW(params, lr=1e-3, weight_decay=0.1)


def _numpy(values: dict) -> dict:
    return {k: v.numpy() for k, v in values.items()}


def _data_parallel(rank, world, path, ckpt):
    """dp=2 x tp=2 with whole experts per rank and FSDP2 over dp: train, saving a checkpoint; then that
    checkpoint loaded at tp=4 (one expert per rank) and at dp=2 x tp=2 with the experts split inside (gate / up
    stored as two parts there), whose checkpoint loads back with whole experts at dp=2 x tp=2 and at tp=4."""
    import warnings

    import torch

    warnings.filterwarnings("ignore")
    import fxparallel
    from checks import full_values
    from fxparallel.runtime import (StepBatches, apply_data_parallel, init_mesh, load_checkpoint, save_checkpoint,
                                    split_for_context_parallel, train_step)

    def setup(tp, dp, ep, cp=1):
        mesh = init_mesh(tp=tp, dp=dp, cp=cp)
        model = apply_data_parallel(fxparallel.parallelize(path, mesh.tp_mesh, dtype=torch.float32,
                                                           expert_parallel=ep,
                                                           cp_group=mesh.cp_mesh if cp > 1 else None), mesh)
        return mesh, model, _optimizer(model.parameters())

    mesh, model, opt = setup(2, 2, True)
    data = StepBatches(_rows(), GLOBAL_BATCH, mesh.dp_rank, mesh.dp)
    out = {"history": [], "experts": str(model.plan.param("model.layers.0.mlp.experts.gate_up_proj").placement)}
    for step in range(STEPS):
        if step == SAVE_AT:
            saved, moments = full_values(model, mesh), _moments(model, opt, mesh)
            save_checkpoint(ckpt, model, opt, mesh, SAVE_AT)
            with torch.no_grad():  # every rank routes the whole rows of the next global batch
                counts = model(input_ids=data.global_batch_at(SAVE_AT)["input_ids"],
                               output_tokens_per_expert=True).tokens_per_expert
        m = train_step(model, opt, data.batch(step), mesh, max_norm=MAX_NORM)
        out["history"].append((m.loss, m.grad_norm))
    params = full_values(model, mesh)
    if rank == 0:
        out["saved"], out["params"] = _numpy(saved), _numpy(params)
    mesh, model, opt = setup(4, 1, True)
    load_checkpoint(ckpt, model, opt, mesh)
    loaded = full_values(model, mesh)
    if rank == 0:
        out["loaded at tp=4"] = _numpy(loaded)
    # the other form: gate / up split inside, stored as two parts (one tensor with whole experts), and back
    mesh, model, opt = setup(2, 2, False)
    load_checkpoint(ckpt, model, opt, mesh)
    out["split form"] = _differences(model, opt, mesh, saved, moments)
    save_checkpoint(ckpt + "-split", model, opt, mesh, SAVE_AT)
    for tp, dp in ((2, 2), (4, 1)):
        mesh, model, opt = setup(tp, dp, True)
        load_checkpoint(ckpt + "-split", model, opt, mesh)
        out[f"whole again at dp={dp} x tp={tp}"] = _differences(model, opt, mesh, saved, moments)
    # whole experts with context parallelism (tp=2 x cp=2: each tp group routes its chunks' rows): resumed from
    # the checkpoint, the last steps as one process takes them
    mesh, model, opt = setup(2, 1, True, cp=2)
    load_checkpoint(ckpt, model, opt, mesh)
    data = StepBatches(_rows(), GLOBAL_BATCH, mesh.dp_rank, mesh.dp)
    with torch.no_grad():  # the cp ranks' chunks of those rows: their counts summed over cp are the rows'
        chunks = split_for_context_parallel({"input_ids": data.global_batch_at(SAVE_AT)["input_ids"]},
                                            mesh.cp_rank, mesh.cp)
        cp_counts = model(**chunks, output_tokens_per_expert=True).tokens_per_expert
    out["cp"] = {"counts": torch.equal(cp_counts, counts) and int(counts.sum()),
                 "experts": str(model.plan.param("model.layers.0.mlp.experts.gate_up_proj").placement),
                 "history": [(m.loss, m.grad_norm) for m in (train_step(model, opt, data.batch(step), mesh,
                                                                          max_norm=MAX_NORM)
                                                               for step in range(SAVE_AT, STEPS))]}
    params = full_values(model, mesh)
    if rank == 0:
        out["cp"]["params"] = _numpy(params)
    return out


def _moments(model, opt, mesh) -> dict:
    from checks import full_values

    return {k: full_values(model, mesh, of=lambda p: opt.state[p][k]) for k in ("exp_avg", "exp_avg_sq")}


def _differences(model, opt, mesh, params, moments) -> dict:
    """The largest difference of every parameter and Adam moment from those saved, and the expert weights' form."""
    from checks import full_values, max_diff

    found = {"params": max_diff(full_values(model, mesh), params)}
    found.update({k: max_diff(v, moments[k]) for k, v in _moments(model, opt, mesh).items()})
    found["experts"] = str(model.plan.param("model.layers.0.mlp.experts.gate_up_proj").placement)
    return found


def test_expert_parallel_with_fsdp_trains_like_one_process_and_checkpoints_load_at_other_layouts(
        checkpoints, tmp_path):
    from checks import max_diff, single_process_training

    path = checkpoints["qwen3_moe"]
    ranks = run_ranks(4, _data_parallel, path, str(tmp_path / "ckpt"), timeout=900)
    ref = single_process_training(path, steps=STEPS, save_at=SAVE_AT, optimizer=_optimizer, rows=_rows(),
                                  global_batch=GLOBAL_BATCH, mask=lambda batch: batch, max_norm=MAX_NORM)
    assert ranks[0]["experts"] == "S(0)"
    for r in ranks:  # every rank logs the global loss and the global (clipped) gradient norm
        for (loss, norm), (ref_loss, ref_norm) in zip(r["history"], ref["history"]):
            assert abs(loss - ref_loss) < 1e-5 and abs(norm - ref_norm) < 1e-5, (r["history"], ref["history"])
    assert max_diff(ranks[0]["params"], ref["params"]) < 3e-5
    assert max_diff(ranks[0]["saved"], ref["saved_params"]) < 3e-5
    assert max_diff(ranks[0]["loaded at tp=4"], ranks[0]["saved"]) == 0  # one expert per rank now
    for r in ranks:  # across the two forms, both ways: every parameter and Adam moment bit-exact
        assert r["split form"]["experts"].startswith("S(1)[") and r["split form"]["params"] == 0, r["split form"]
        for key in ("split form", "whole again at dp=2 x tp=2", "whole again at dp=1 x tp=4"):
            assert r[key]["params"] == r[key]["exp_avg"] == r[key]["exp_avg_sq"] == 0, (key, r[key])
        assert r["whole again at dp=1 x tp=4"]["experts"] == "S(0)"
        # tp=2 x cp=2, whole experts: the steps after the checkpoint as one process's
        assert r["cp"]["experts"] == "S(0)", r["cp"]
        assert r["cp"]["counts"] == 2 * 2 * GLOBAL_BATCH * SEQ, r["cp"]  # layers x top-2 x tokens, all counted
        for (loss, norm), (ref_loss, ref_norm) in zip(r["cp"]["history"], ref["history"][SAVE_AT:], strict=True):
            assert abs(loss - ref_loss) < 1e-5 and abs(norm - ref_norm) < 1e-5, (r["cp"]["history"], ref["history"])
    assert max_diff(ranks[0]["cp"]["params"], ref["params"]) < 3e-5
