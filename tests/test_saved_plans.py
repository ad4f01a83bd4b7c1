"""parallelize(..., plan=): a saved ShardingPlan is applied (an edited one too: its placements, not
the solver's, with logits and loss equal to the single-device model) and a plan that does not fit
the model or the group is refused naming the first mismatch, before anything is captured."""
from __future__ import annotations

import json

import pytest

from distributed import run_ranks


def _edited(plan, edit):
    from fxparallel import ShardingPlan

    d = plan.to_dict()
    edit(d)
    return ShardingPlan.from_dict(d)


def _replicate_mlp(d):
    for p in d["params"]:
        if ".mlp." in p["name"]:
            p["placement"], p["split"] = "R", []


def _error(path, plan) -> str:
    import fxparallel

    with pytest.raises(fxparallel.ShardingError) as err:
        fxparallel.parallelize(path, fxparallel.fake_group(1), plan=plan)
    return str(err.value)


def test_plans_that_do_not_fit_are_refused(checkpoints, tmp_path):
    import fxparallel
    from models import tiny_config

    path = checkpoints["llama"]
    plan, _ = fxparallel.plan_model(path, 1)
    assert "splits over tp=2 ranks, this tp_group has 1" in _error(path, fxparallel.plan_model(path, 2)[0])
    assert "is for model type 'qwen2', this model is 'llama'" in _error(path, fxparallel.plan_model(checkpoints["qwen2"], 1)[0])
    wider, _ = fxparallel.plan_model(tiny_config("llama", intermediate_size=192), 1)
    assert ("parameter 'model.layers.0.mlp.gate_proj.weight': the saved plan has shape (192, 64), this model (128, 64)"
            in _error(path, wider))

    def drop_norm(d):
        d["params"] = [p for p in d["params"] if p["name"] != "model.norm.weight"]

    assert "parameter 'model.norm.weight' of this llama model is not in the saved plan" in _error(path, _edited(plan, drop_norm))

    def rename(d):
        d["params"][0]["name"] = "model.embed.weight"

    assert "names parameter 'model.embed.weight', which this llama model does not have" in _error(path, _edited(plan, rename))

    def bad_dim(d):
        next(p for p in d["params"] if p["name"] == "lm_head.weight")["placement"] = "S(2)"

    assert "parameter 'lm_head.weight': the saved plan shards dim 2 of a 2-D tensor (128, 64)" in _error(path, _edited(plan, bad_dim))

    def blocked(d):  # the loader would read a contiguous shard where this layout means a piece of every block
        next(p for p in d["params"] if p["name"] == "lm_head.weight")["placement"] = "S(0)[*16]"

    assert "parameter 'lm_head.weight': a parameter cannot be placed S(0)[*16] in a saved plan" in _error(
        path, _edited(plan, blocked))
    assert "no such file" in _error(path, str(tmp_path / "missing.json"))
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"tp": 1}))
    assert "is not a saved ShardingPlan (KeyError" in _error(path, str(bad))
    assert "plan= must be a ShardingPlan or the path of one saved as JSON, got dict" in _error(path, {"tp": 1})


def _apply_saved(rank, tp, path, plan_path):
    import torch
    import torch.distributed as dist

    import fxparallel
    from models import reference

    default = fxparallel.parallelize(path, dist.group.WORLD, dtype=torch.float32)
    from_file = fxparallel.parallelize(path, dist.group.WORLD, dtype=torch.float32, plan=plan_path)
    edited_plan = _edited(from_file.plan, _replicate_mlp)
    edited = fxparallel.parallelize(path, dist.group.WORLD, dtype=torch.float32, plan=edited_plan)
    ids = torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(3))
    reference_model = reference(path)
    ref = reference_model(input_ids=ids, labels=ids)
    out = edited(input_ids=ids, labels=ids, gather_logits=True)
    out.loss.backward()
    ref.loss.backward()
    full = dict(reference_model.named_parameters())
    grads = max(float((p.grad - edited.plan.param(n).shard_of(full[n].grad, rank, tp)).abs().max())
                for n, p in edited.named_parameters())
    return {
        "grads": grads,
        "same as solved": from_file.plan == default.plan,
        "mlp replicated": all(str(p.placement) == "R" for p in edited.plan.params if ".mlp." in p.name),
        "attention still split": all(str(p.placement) != "R" for p in edited.plan.params if "q_proj" in p.name),
        "forward all-reduces": (default.plan.count("all_reduce", "forward"), edited.plan.count("all_reduce", "forward")),
        "logits": float((out.logits - ref.logits).abs().max().detach()),
        "loss": abs(float(out.loss.detach()) - float(ref.loss.detach())),
    }


def test_saved_and_edited_plans_are_applied(checkpoints, tmp_path):
    import fxparallel

    plan_path = str(tmp_path / "plan.json")
    fxparallel.plan_model(checkpoints["llama"], 2)[0].save(plan_path)
    for out in run_ranks(2, _apply_saved, checkpoints["llama"], plan_path):
        assert out["same as solved"] and out["mlp replicated"] and out["attention still split"], out
        solved, edited = out["forward all-reduces"]
        assert edited == solved - 2, out  # the two MLPs' row-parallel all-reduces are gone
        assert out["logits"] < 1e-5 and out["loss"] < 1e-6 and out["grads"] < 1e-5, out
