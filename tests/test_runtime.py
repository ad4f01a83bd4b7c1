"""Training runtime on real gloo ranks: TP -> FSDP2 training equals single-process transformers
(losses, clipped gradients, global grad norms, parameters) for DPxTPxCP = 2x2x1, 4x1x1, 2x1x1,
1x2x1, HSDP (4x1x1 with FSDP over pairs of dp ranks, replicated over the pairs) and 2x2x1 in replicate
mode; checkpoints load across layouts and resume exactly; a failed save keeps the previous one;
the consolidated export loads in transformers with the same logits.

Two spawns share all checks: world 4 (2x2, 4x1, 4x1 HSDP, 2x2 replicate, the dp_shard error) and world 2
(1x2, 2x1 in replicate mode, the mesh error). The 2x2 run saves the checkpoint the other layouts load and the
export; the HSDP run also saves its own and loads it back. The model has tied embeddings (one parameter under two
names through FSDP, clipping, checkpoints and export).
"""
from __future__ import annotations

import os

import pytest
import torch

from checks import full_values, mask_some_labels, max_diff
from distributed import run_ranks

STEPS = 4  # two optimizer steps after the resume: a lost optimizer state shows in the second
SAVE_AT = 2  # checkpoint after this many steps
LR, WD, MAX_NORM = 1e-3, 0.1, 0.8
GLOBAL_BATCH, SEQ = 8, 16
TOL = 1e-5
PARAM_TOL = 3e-5  # parameters after AdamW steps: Adam's normalization amplifies 1e-7 gradient noise


# ---- shared pieces (used inside ranks and by the reference) ------------------------------
def _rows():
    from fxparallel.runtime import pack_tokens, synthetic_token_stream

    return pack_tokens(synthetic_token_stream(128, 40 * SEQ, seed=3, mean_doc_len=12), SEQ)


def _optimizer(params):
    return torch.optim.AdamW(params, lr=LR, weight_decay=WD)


# ---- inside ranks ----------------------------------------------------------------------
def _setup(path, tp, dp, mode="shard", dp_shard=None):
    import fxparallel
    from fxparallel.runtime import StepBatches, apply_data_parallel, init_mesh

    mesh = init_mesh(tp=tp, dp=dp, cp=1, dp_shard=dp_shard)
    model = fxparallel.parallelize(path, mesh.tp_mesh, dtype=torch.float32)
    model = apply_data_parallel(model, mesh, mode=mode)
    return mesh, model, _optimizer(model.parameters()), StepBatches(_rows(), GLOBAL_BATCH, mesh.dp_rank, mesh.dp)


def _train(model, opt, data, mesh, start, stop, record):
    from fxparallel.runtime import train_step

    for step in range(start, stop):
        m = train_step(model, opt, mask_some_labels(data.batch(step)), mesh, max_norm=MAX_NORM)
        record.append((m.loss, m.grad_norm))


def _layout_run(path, ckpt_root, tp, dp, mode="shard", save=False, export_dir=None, dp_shard=None):
    """Train STEPS steps; then load the (2x2) checkpoint of step SAVE_AT and train the rest again.

    With ``save`` (the 2x2 run): save at SAVE_AT, and after the last step try a save that fails
    and export the model, before loading. ``dp_shard``: HSDP, FSDP shard groups of that many dp ranks."""
    from fxparallel.runtime import export_pretrained, load_checkpoint, save_checkpoint

    mesh, model, opt, data = _setup(path, tp, dp, mode, dp_shard)
    run = {"fsdp": type(model).__name__, "mesh_ranks": (mesh.dp_rank, mesh.tp_rank),
           "rows": data.indices(0).tolist(), "mesh": repr(mesh).split(", rank=")[0],
           "fsdp_mesh": tuple(next(p for p in model.parameters()).device_mesh.shape)}
    history = []
    _train(model, opt, data, mesh, 0, SAVE_AT, history)
    if save:
        run["saved_params"] = full_values(model, mesh)
        run["saved_optim"] = _optimizer_states(model, opt, mesh)
        save_checkpoint(ckpt_root, model, opt, mesh, SAVE_AT)
    _train(model, opt, data, mesh, SAVE_AT, STEPS, history)
    run["history"] = history
    run["grads"] = full_values(model, mesh, lambda p: p.grad)
    run["params"] = full_values(model, mesh)
    ids = data.global_batch_at(STEPS)["input_ids"]
    run["logits"] = model(input_ids=ids).logits.detach().clone()
    if save:
        run["failed_save"] = _simulate_failed_save(model, opt, mesh, ckpt_root)
    if export_dir:
        export_pretrained(model, mesh, export_dir)
    meta = load_checkpoint(ckpt_root, model, opt, mesh)  # back to step SAVE_AT, from the 2x2 layout
    run["loaded_meta"] = {k: meta[k] for k in ("step", "layout")}
    run["loaded_params"] = full_values(model, mesh)
    run["loaded_optim"] = _optimizer_states(model, opt, mesh)
    run["resumed"] = []
    _train(model, opt, data, mesh, SAVE_AT, STEPS, run["resumed"])
    if dp_shard:  # a checkpoint saved in this layout (each shard's replicas hold the same pieces) loads back exactly
        own = ckpt_root + "_hsdp"
        expected = (full_values(model, mesh), _optimizer_states(model, opt, mesh))
        save_checkpoint(own, model, opt, mesh, STEPS)
        _train(model, opt, data, mesh, STEPS, STEPS + 1, [])
        load_checkpoint(own, model, opt, mesh)
        run["own checkpoint"] = (max_diff(full_values(model, mesh), expected[0]),
                                 max_diff(_optimizer_states(model, opt, mesh), expected[1]))
    return run


def _optimizer_states(model, opt, mesh) -> dict:
    """Every AdamW state of every parameter as a full tensor ("<name>/exp_avg", ...), and the step counts."""
    states = {}
    for key in ("exp_avg", "exp_avg_sq"):
        for name, value in full_values(model, mesh, lambda p, k=key: opt.state[p][k]).items():
            states[f"{name}/{key}"] = value
    states["steps"] = torch.tensor(sorted({float(s["step"]) for s in opt.state.values()}))
    return states


def _public(run, rank):
    """What goes back to the test process (rank 0 sends tensors, others only numbers)."""
    keep = ("history", "resumed", "loaded_meta", "fsdp", "mesh_ranks", "rows", "failed_save", "mesh", "fsdp_mesh",
            "own checkpoint")
    out = {k: run[k] for k in keep if k in run}
    if rank == 0:  # as numpy: tensors would travel through shared memory that dies with the rank
        for k in ("grads", "params", "logits", "loaded_params", "saved_params", "saved_optim", "loaded_optim"):
            if k in run:
                out[k] = {n: t.numpy() for n, t in run[k].items()} if isinstance(run[k], dict) else run[k].numpy()
    return out


def _simulate_failed_save(model, opt, mesh, ckpt_root):
    """Rank 1's writer raises mid-save: every rank gets the error; the previous checkpoint stays."""
    import torch.distributed.checkpoint as dcp

    from fxparallel.runtime import latest_checkpoint, save_checkpoint

    original = dcp.FileSystemWriter.write_data

    def broken(self, plan, planner):
        raise OSError("disk full (simulated)")

    if mesh.rank == 1:
        dcp.FileSystemWriter.write_data = broken
    try:
        save_checkpoint(ckpt_root, model, opt, mesh, STEPS + 1)
        error = None
    except Exception as err:  # noqa: BLE001
        error = f"{type(err).__name__}: {err}"
    finally:
        dcp.FileSystemWriter.write_data = original
    return {"error": error, "latest": os.path.basename(latest_checkpoint(ckpt_root)),
            "entries": sorted(os.listdir(ckpt_root))}


def _world4(rank, world, path, ckpt_root, export_dir):
    from checks import raised
    from fxparallel.runtime import init_mesh

    return {"2x2x1": _public(_layout_run(path, ckpt_root, tp=2, dp=2, save=True, export_dir=export_dir), rank),
            "4x1x1": _public(_layout_run(path, ckpt_root, tp=1, dp=4), rank),
            # HSDP: FSDP over pairs of dp ranks, the pairs replicas of each other; and replicas over dp at tp=2
            "4x1x1 hsdp": _public(_layout_run(path, ckpt_root, tp=1, dp=4, dp_shard=2,
                                              export_dir=export_dir + "_hsdp"), rank),
            "2x2x1 replicate": _public(_layout_run(path, ckpt_root, tp=2, dp=2, mode="replicate"), rank),
            "bad dp_shard": raised(lambda: init_mesh(tp=1, dp=4, dp_shard=3))}


def _world2(rank, world, path, ckpt_root, example_dir):
    from fxparallel.errors import GroupError
    from fxparallel.runtime import init_mesh

    results = {}
    try:
        init_mesh(tp=2, dp=2, cp=1)
        results["mesh_error"] = None
    except GroupError as err:
        results["mesh_error"] = str(err)
    results["1x2x1"] = _public(_layout_run(path, ckpt_root, tp=2, dp=1), rank)
    results["2x1x1"] = _public(_layout_run(path, ckpt_root, tp=1, dp=2, mode="replicate"), rank)
    results["example"] = _run_example(rank, path, example_dir)
    return results


def _run_example(rank, path, directory):
    """examples/train_3d.py at 1x2x1: train 3 steps (checkpoints at 2 and 3), lose the step-3
    checkpoint, then --resume: step 3 again from the step-2 checkpoint."""
    import contextlib
    import io
    import shutil

    import torch.distributed as dist

    from checks import load_example

    example = load_example("train_3d")
    save_dir = os.path.join(directory, "ckpt")
    args = ["--model", path, "--tp", "2", "--dp", "1", "--cp", "1", "--steps", "3", "--global-batch", "4",
            "--seq-len", "16", "--save-dir", save_dir, "--save-every", "2"]
    logs = io.StringIO()
    with contextlib.redirect_stdout(logs):
        first = example.main(args)
        if rank == 0:
            shutil.rmtree(os.path.join(save_dir, "step_00000003"))  # as if the job died while saving step 3
        dist.barrier()
        resumed = example.main(args + ["--resume"])
    return {"first": [(m.loss, m.grad_norm) for m in first], "resumed": [(m.loss, m.grad_norm) for m in resumed],
            "log": logs.getvalue()}


# ---- the single-process reference ------------------------------------------------------
def _reference(path):
    from checks import single_process_training

    return single_process_training(path, steps=STEPS, save_at=SAVE_AT, optimizer=_optimizer, rows=_rows(),
                                   global_batch=GLOBAL_BATCH, mask=mask_some_labels, max_norm=MAX_NORM)


# ---- fixtures: one spawn per world size --------------------------------------------------
@pytest.fixture(scope="module")
def paths(tmp_path_factory):
    from models import save_checkpoint, tiny_config

    root = tmp_path_factory.mktemp("runtime")
    # tied embeddings: one parameter under two names through FSDP, clipping, checkpoints and export
    model = save_checkpoint(tiny_config("llama", tie_word_embeddings=True), str(root / "llama-tied"))
    return {"model": model, "ckpt": str(root / "ckpt"), "export": str(root / "export"),
            "example": str(root / "example")}


@pytest.fixture(scope="module")
def reference(paths):
    return _reference(paths["model"])


@pytest.fixture(scope="module")
def world4(paths):
    return run_ranks(4, _world4, paths["model"], paths["ckpt"], paths["export"])


@pytest.fixture(scope="module")
def world2(paths, world4):  # loads the checkpoint world4 saved
    return run_ranks(2, _world2, paths["model"], paths["ckpt"], paths["example"])


def _layouts(world4, world2):
    for per_rank in (world4, world2):
        for key in per_rank[0]:
            if key.count("x") == 2:
                yield key, [r[key] for r in per_rank]


def _t(x):
    return torch.as_tensor(x)


# ---- tests -----------------------------------------------------------------------------
def test_every_layout_trains_like_single_process(world4, world2, reference):
    seen = []
    for layout, ranks in _layouts(world4, world2):
        seen.append(layout)
        first = ranks[0]
        assert first["fsdp"].startswith("FSDP"), first["fsdp"]
        for r in ranks:  # every rank reports the same global loss and norm
            assert r["history"] == first["history"], layout
        for (loss, norm), (ref_loss, ref_norm) in zip(first["history"], reference["history"]):
            assert abs(loss - ref_loss) < TOL, (layout, first["history"], reference["history"])
            assert abs(norm - ref_norm) < TOL, (layout, norm, ref_norm)  # global grad norm before clipping
        assert max_diff(first["grads"], reference["grads"]) < TOL, layout  # clipped gradients of the last step
        assert max_diff(first["params"], reference["params"]) < PARAM_TOL, layout
        assert (_t(first["logits"]) - reference["logits"]).abs().max().item() < TOL, layout
    assert sorted(seen) == ["1x2x1", "2x1x1", "2x2x1", "2x2x1 replicate", "4x1x1", "4x1x1 hsdp"]
    assert any(norm > MAX_NORM for _, norm in reference["history"])  # clipping was active
    hsdp = world4[0]["4x1x1 hsdp"]
    assert hsdp["mesh"] == "ParallelMesh(dp=4, dp_shard=2, tp=1, cp=1" and hsdp["fsdp_mesh"] == (2, 2), hsdp["mesh"]
    assert world4[0]["4x1x1"]["fsdp_mesh"] == (4,) and world4[0]["2x2x1 replicate"]["fsdp_mesh"] == (2, 1)
    assert all(r["4x1x1 hsdp"]["own checkpoint"] == (0.0, 0.0) for r in world4), hsdp["own checkpoint"]


def test_dp_shard_sizes_are_checked(world4):
    for r in world4:
        assert r["bad dp_shard"].startswith("GroupError: DP_SHARD size (3) must divide DP size (4)"), r["bad dp_shard"]


def test_tp_ranks_of_a_dp_group_share_the_batch(world4):
    by_dp = {}
    for r in world4:
        dp_rank, tp_rank = r["2x2x1"]["mesh_ranks"]
        by_dp.setdefault(dp_rank, []).append(r["2x2x1"]["rows"])
    assert sorted(by_dp) == [0, 1]
    for rows in by_dp.values():
        assert len(rows) == 2 and rows[0] == rows[1]  # both tp ranks of a dp group: the same rows
    assert not set(by_dp[0][0]) & set(by_dp[1][0])  # dp groups: disjoint rows
    assert len(by_dp[0][0]) == GLOBAL_BATCH // 2
    four = sorted(tuple(r["4x1x1"]["rows"]) for r in world4)
    assert len({i for rows in four for i in rows}) == GLOBAL_BATCH  # dp=4: the global batch, split in 4


def test_checkpoint_loads_into_every_layout(world4, world2, reference):
    saved = world4[0]["2x2x1"]["saved_params"]
    assert max_diff(saved, reference["saved_params"]) < TOL
    for layout, ranks in _layouts(world4, world2):
        first = ranks[0]
        assert first["loaded_meta"] == {"step": SAVE_AT, "layout": {"dp": 2, "tp": 2, "cp": 1}}, layout
        assert max_diff(first["loaded_params"], saved) == 0.0, layout  # bit-exact, whatever the layout
        # every optimizer state of every parameter, bit for bit (a load that skipped them would start Adam anew)
        optim = world4[0]["2x2x1"]["saved_optim"]
        assert sorted(first["loaded_optim"]) == sorted(optim) and len(optim) == 2 * len(saved) + 1, layout
        assert max_diff(first["loaded_optim"], optim) == 0.0, layout
        assert first["loaded_optim"]["steps"].tolist() == [float(SAVE_AT)], layout


def test_resume_gives_the_same_losses(world4, world2):
    uninterrupted = world4[0]["2x2x1"]["history"][SAVE_AT:]
    # same layout: bit-identical; other layouts: same within fp32 reduction-order noise
    assert world4[0]["2x2x1"]["resumed"] == uninterrupted
    for layout, ranks in _layouts(world4, world2):
        resumed = ranks[0]["resumed"]
        assert len(resumed) == STEPS - SAVE_AT
        for (loss, norm), (ref_loss, ref_norm) in zip(resumed, uninterrupted):
            assert abs(loss - ref_loss) < TOL and abs(norm - ref_norm) < TOL, (layout, resumed, uninterrupted)


def test_failed_save_keeps_the_previous_checkpoint(world4):
    for r in world4:
        failed = r["2x2x1"]["failed_save"]
        assert failed["error"] is not None and "disk full (simulated)" in failed["error"], failed
        assert failed["latest"] == f"step_{SAVE_AT:08d}"
    entries = world4[0]["2x2x1"]["failed_save"]["entries"]
    assert f"step_{STEPS + 1:08d}" not in entries and f"step_{SAVE_AT:08d}" in entries, entries


def test_export_loads_in_transformers_with_the_same_logits(world4, paths):
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    from fxparallel.runtime import StepBatches

    ids = StepBatches(_rows(), GLOBAL_BATCH, 0, 1).global_batch_at(STEPS)["input_ids"]
    for layout, directory in (("4x1x1 hsdp", paths["export"] + "_hsdp"), ("2x2x1", paths["export"])):
        trained = world4[0][layout]
        exported = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32)
        # the export holds the model as it was after the last step (2x2, and under HSDP), and computes its logits
        assert max_diff({n: p.detach() for n, p in exported.named_parameters()}, trained["params"]) == 0.0, layout
        with torch.no_grad():
            assert (exported(input_ids=ids).logits - _t(trained["logits"])).abs().max().item() < TOL, layout
    # tied weights: stored once, under the name transformers expects, and tied again on load
    assert exported.lm_head.weight.data_ptr() == exported.model.embed_tokens.weight.data_ptr()
    with safe_open(os.path.join(paths["export"], "model.safetensors"), "pt") as f:
        keys = set(f.keys())
    assert "model.embed_tokens.weight" in keys and "lm_head.weight" not in keys
    assert len(keys) == len(trained["params"])


def test_mesh_error_names_the_sizes(world2):
    for r in world2:
        assert r["mesh_error"] == "World size (2) must equal TP size (2) * DP size (2) * CP size (1)"


def test_train_3d_example_logs_and_resumes(world2):
    first, resumed, log = (world2[0]["example"][k] for k in ("first", "resumed", "log"))
    assert len(first) == 3 and len(resumed) == 1
    assert resumed[0] == first[2]  # same layout: the resumed step is bit-identical
    assert "step     3 | loss" in log and "grad norm" in log and "tokens/s" in log
    assert "resumed from" in log and "(step 2, saved with layout {'dp': 1, 'tp': 2, 'cp': 1})" in log
    assert world2[1]["example"]["log"] == ""  # only rank 0 logs


