"""Checkpoint faults: crashes while saving or pruning, leftovers, a ``latest`` pointing elsewhere,
damaged or crafted files, runs of different layouts sharing a root. Each gives a clear
CheckpointError (or is recovered from) instead of a raw exception, a silent older step, or code
run by unpickling.

File-system-only cases (listing, ``latest``) run in this process on hand-made directories; the
rest share one spawn of 2 gloo ranks (tp=2, then dp=2 for the layout cases) that saves tiny
checkpoints and damages copies of them. Errors come back as (type, message, seconds) and are
raised again here, so each test matches the text every rank saw.
"""
from __future__ import annotations

import json
import logging
import os
import pickle
import re
import shutil
import time

import pytest
import torch

from distributed import run_ranks
from fxparallel.errors import CheckpointError
from fxparallel.runtime import latest_checkpoint, list_checkpoints
from fxparallel.runtime.checkpoint import FORMAT, META, step_dir_name

S1, S2, S3, S4 = (step_dir_name(s) for s in (1, 2, 3, 4))


# ---- in this process: listing and `latest` on hand-made directories ----------------------
def _fake(root, step: int, marker=None) -> str:
    """A directory that listing sees as the checkpoint of ``step`` (only its marker matters here)."""
    path = root / step_dir_name(step)
    path.mkdir(parents=True)
    (path / META).write_text(json.dumps({"format": FORMAT, "step": step}) if marker is None else marker)
    return str(path)


def test_latest_naming_a_missing_directory_warns_and_uses_the_newest_complete(tmp_path, caplog):
    for step in (1, 2, 3):
        _fake(tmp_path, step)
    (tmp_path / "latest").write_text(S3)
    shutil.rmtree(tmp_path / S3)  # deleted by hand (e.g. to roll back)
    with caplog.at_level(logging.WARNING, logger="fxparallel"):
        assert latest_checkpoint(str(tmp_path)) == str(tmp_path / S2)
    assert re.search(rf"latest names {S3}, but .*{S3} does not exist; using the newest complete checkpoint, "
                     rf".*{S2}, instead", caplog.text), caplog.text


@pytest.mark.parametrize("pointer", ["../other/" + S1, "{other}/" + S1, S1 + "/../../other/" + S1, "..", "step_1",
                                     S1 + "/"])
def test_latest_outside_the_root_is_refused(tmp_path, pointer):
    root, other = tmp_path / "root", tmp_path / "other"
    _fake(root, 2)
    _fake(other, 1)  # a complete checkpoint elsewhere that `latest` must not lead to
    (root / "latest").write_text(pointer.format(other=other))
    with pytest.raises(CheckpointError, match=r"latest names .*, which is not a checkpoint directory of .* "
                                              r"\(a name like step_00000010: no '/', no '..'\); refusing to follow it"):
        latest_checkpoint(str(root))


@pytest.mark.parametrize("marker, why", [
    ("", r"is not valid JSON \(JSONDecodeError"),
    ('{"format": "fxparallel-dcp/1", "st', r"is not valid JSON \(JSONDecodeError"),
    ("[1, 2]", r"has format 'list', expected 'fxparallel-dcp/1'"),
    ('{"format": "fxparallel-dcp/1"}', r"records no integer step"),
])
def test_a_checkpoint_is_complete_only_with_a_valid_marker(tmp_path, caplog, marker, why):
    _fake(tmp_path, 1)
    _fake(tmp_path, 2, marker=marker)  # e.g. a delete interrupted, or a damaged marker
    (tmp_path / "latest").write_text(S2)
    assert list_checkpoints(str(tmp_path)) == [(1, str(tmp_path / S1))]
    with caplog.at_level(logging.WARNING, logger="fxparallel"):
        assert latest_checkpoint(str(tmp_path)) == str(tmp_path / S1)
    assert re.search(rf"latest names {S2}, but .*{S2}/{META} {why}", caplog.text), caplog.text


# ---- inside the ranks ----------------------------------------------------------------------
class _Crafted:
    """Unpickling this creates ``path``: stands for any code a crafted .metadata runs."""

    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return os.mkdir, (self.path,)


def _setup(path, tp, dp):
    import fxparallel
    from fxparallel.runtime import apply_data_parallel, init_mesh
    from fxparallel.runtime.checkpoint import init_optimizer_state

    mesh = init_mesh(tp=tp, dp=dp, cp=1)
    model = apply_data_parallel(fxparallel.parallelize(path, mesh.tp_mesh, dtype=torch.float32), mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    init_optimizer_state(model, opt)
    return mesh, model, opt


def _first_param(model):
    return next(iter(model.parameters()))


def _mark(model, value: float) -> None:
    """Tell saves apart: the first parameter becomes ``value`` everywhere."""
    with torch.no_grad():
        _first_param(model).fill_(value)


def _mark_of(model) -> float:
    p = _first_param(model).detach()
    return float((p.to_local() if hasattr(p, "to_local") else p).flatten()[0])


def _error(fn):
    start = time.perf_counter()
    try:
        fn()
    except Exception as err:  # noqa: BLE001 - the test process checks type and text
        return {"type": f"{type(err).__module__}.{type(err).__qualname__}", "message": str(err),
                "seconds": time.perf_counter() - start}
    return None


def _on_rank0(rank, fn):
    import torch.distributed as dist

    if rank == 0:
        fn()
    dist.barrier()


def _resave_crash(rank, base, mesh, model, opt):
    """Saving step 2 again dies between moving the old step 2 aside and renaming the new one in."""
    from fxparallel.runtime import load_checkpoint, save_checkpoint

    root = os.path.join(base, "resave")
    _mark(model, 1.0)
    save_checkpoint(root, model, opt, mesh, 1)
    _mark(model, 2.0)
    save_checkpoint(root, model, opt, mesh, 2)
    _mark(model, 3.0)
    tmp, rename, replace = os.path.join(root, ".tmp-" + S2), os.rename, os.replace

    def crashing(original):  # renaming the new step 2 into place dies
        def rename_or_die(src, dst, *args, **kwargs):
            if os.path.abspath(src) == os.path.abspath(tmp):
                raise OSError("simulated crash")
            return original(src, dst, *args, **kwargs)
        return rename_or_die

    if rank == 0:
        os.rename, os.replace = crashing(rename), crashing(replace)
    try:
        out = {"error": _error(lambda: save_checkpoint(root, model, opt, mesh, 2))}
    finally:
        os.rename, os.replace = rename, replace
    out["entries"] = sorted(os.listdir(root))
    out["latest"] = os.path.basename(latest_checkpoint(root))
    out["listed"] = [(s, os.path.basename(p)) for s, p in list_checkpoints(root)]
    _mark(model, 0.0)
    meta = load_checkpoint(root, model, opt, mesh)
    out["loaded"] = (meta["step"], _mark_of(model))
    save_checkpoint(root, model, opt, mesh, 3)  # puts step 2 back in place, keeps 2 and 3
    out["after_next_save"] = sorted(os.listdir(root))
    return out


def _interrupted_prune(rank, base, mesh, model, opt):
    """Pruning step 1 dies after deleting its data files; then the next save meets the leftovers
    and a stale temporary directory of a save that crashed long ago."""
    from fxparallel.runtime import save_checkpoint

    root = os.path.join(base, "prune")
    for step in (1, 2):
        save_checkpoint(root, model, opt, mesh, step)
    rmtree = shutil.rmtree

    def dies_midway(path, *args, **kwargs):
        if S1 not in os.path.basename(path):
            return rmtree(path, *args, **kwargs)
        for entry in sorted(os.listdir(path)):
            if entry != META:  # the data goes first, as rmtree may order it
                os.remove(os.path.join(path, entry))
        raise OSError("simulated crash while deleting")

    if rank == 0:
        shutil.rmtree = dies_midway
    try:
        out = {"error": _error(lambda: save_checkpoint(root, model, opt, mesh, 3, keep=2))}
    finally:
        shutil.rmtree = rmtree
    out["listed"] = [s for s, _ in list_checkpoints(root)]
    out["entries_after_prune"] = sorted(os.listdir(root))
    _on_rank0(rank, lambda: os.makedirs(os.path.join(root, ".tmp-step_00000099", "junk")))
    save_checkpoint(root, model, opt, mesh, 4, keep=2)
    out["entries_after_next_save"] = sorted(os.listdir(root))
    return out


def _damaged_copies(base, good):
    """{case: checkpoint directory}: copies of ``good`` with one thing wrong each (rank 0 writes)."""
    cases = {}

    def copy(case, edit_meta=None):
        path = os.path.join(base, "damaged", case, S1)
        shutil.copytree(good, path)
        if edit_meta is not None:
            with open(os.path.join(path, META)) as f:
                meta = json.load(f)
            edit_meta(meta)
            with open(os.path.join(path, META), "w") as f:
                json.dump(meta, f)
        cases[case] = path
        return path

    def no_digest(meta):
        meta.pop("metadata_sha256", None)  # (older checkpoints have none)

    with open(os.path.join(copy("garbage_json"), META), "w") as f:
        f.write("{garbage")
    for case, edit in (("garbage_metadata", None), ("garbage_metadata_no_digest", no_digest)):
        with open(os.path.join(copy(case, edit), ".metadata"), "wb") as f:
            f.write(b"garbage")
    copy("no_digest", no_digest)
    for case, edit in (("crafted_metadata", None), ("crafted_metadata_no_digest", no_digest)):
        path = copy(case, edit)
        with open(os.path.join(path, ".metadata"), "wb") as f:
            pickle.dump(_Crafted(os.path.join(path, "pwned")), f)
    data = sorted(f for f in os.listdir(good) if f.endswith(".distcp"))
    path = copy("truncated_distcp")
    with open(os.path.join(path, data[-1]), "r+b") as f:
        f.truncate(os.path.getsize(os.path.join(path, data[-1])) // 2)
    os.remove(os.path.join(copy("missing_distcp"), data[0]))
    outside = os.path.join(base, "damaged", "latest_outside")
    shutil.copytree(good, os.path.join(outside, "root", S1))
    shutil.copytree(good, os.path.join(outside, "elsewhere", S1))
    with open(os.path.join(outside, "root", "latest"), "w") as f:
        f.write(f"../elsewhere/{S1}")
    cases["latest_outside"] = os.path.join(outside, "root")
    return cases


def _damaged(rank, base, mesh, model, opt):
    """Load copies of a good checkpoint, each damaged in one way."""
    import torch.distributed as dist

    from fxparallel.runtime import checkpoint, load_checkpoint, save_checkpoint

    good = save_checkpoint(os.path.join(base, "good"), model, opt, mesh, 1)
    box = [None]
    _on_rank0(rank, lambda: box.__setitem__(0, _damaged_copies(base, good)))
    dist.broadcast_object_list(box, src=0)
    out = {case: _error(lambda: load_checkpoint(path, model, opt, mesh)) for case, path in sorted(box[0].items())}
    out["crafted_ran"] = any(os.path.exists(os.path.join(box[0][c], "pwned"))
                             for c in ("crafted_metadata", "crafted_metadata_no_digest"))
    trusted = {}
    out["garbage_metadata_trusted"] = _error(
        lambda: load_checkpoint(box[0]["garbage_metadata_no_digest"], model, opt, mesh, trust_metadata=True))
    out["no_digest_trusted"] = _error(
        lambda: trusted.update(load_checkpoint(box[0]["no_digest"], model, opt, mesh, trust_metadata=True)))
    out["no_digest_trusted_step"] = trusted.get("step")
    resolve = checkpoint._resolve
    other = os.path.join(base, "prune", S4)  # saved by _interrupted_prune
    if rank == 1:  # this rank sees another checkpoint under the same name
        checkpoint._resolve = lambda path: other if path == good else resolve(path)
    try:
        out["ranks_disagree"] = _error(lambda: load_checkpoint(good, model, opt, mesh))
    finally:
        checkpoint._resolve = resolve
    return out


def _run_example(workdir, args):
    import contextlib
    import io

    from checks import load_example

    example = load_example("train_3d")
    os.makedirs(workdir, exist_ok=True)
    cwd = os.getcwd()
    os.chdir(workdir)
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            example.main(args)
    finally:
        os.chdir(cwd)


def _layouts(rank, base, path, mesh, model, opt):
    """The tp=2 run has saved step 2 where the example used to save by default; the example then
    runs at dp=2 without --save-dir; then the tp=2 run saves into the example's directory."""
    from fxparallel.runtime import load_checkpoint, save_checkpoint

    workdir = os.path.join(base, "example")
    save_checkpoint(os.path.join(workdir, "out", "train_3d", "checkpoints"), model, opt, mesh, 2)
    _run_example(workdir, ["--model", path, "--tp", "1", "--dp", "2", "--cp", "1", "--steps", "2", "--global-batch",
                           "2", "--seq-len", "16", "--save-every", "1"])
    out = {"saved": {}}
    for top, _, files in os.walk(workdir):
        if META in files:
            with open(os.path.join(top, META)) as f:
                out["saved"][os.path.relpath(top, workdir)] = json.load(f)["layout"]
    root = os.path.join(workdir, "out", "train_3d", "dp2_tp1_cp1", "checkpoints")
    out["overwrite"] = _error(lambda: save_checkpoint(root, model, opt, mesh, 2))
    out["other_step"] = _error(lambda: save_checkpoint(root, model, opt, mesh, 3))
    out["same_layout_again"] = _error(lambda: save_checkpoint(root, model, opt, mesh, 3))
    meta = load_checkpoint(os.path.join(root, S2), model, opt, mesh)  # any layout still loads any other
    out["loaded"] = (meta["step"], meta["layout"])
    return out


def _case(fn, *args):
    """One case's results, or the traceback that ended it (the other cases still run)."""
    import traceback

    try:
        return fn(*args)
    except Exception:  # noqa: BLE001
        return {"crashed": traceback.format_exc()}


def _faults(rank, world, path, base):
    mesh, model, opt = _setup(path, tp=2, dp=1)
    return {"resave": _case(_resave_crash, rank, base, mesh, model, opt),
            "prune": _case(_interrupted_prune, rank, base, mesh, model, opt),
            "damaged": _case(_damaged, rank, base, mesh, model, opt),
            "layouts": _case(_layouts, rank, base, path, mesh, model, opt)}


@pytest.fixture(scope="module")
def faults(tmp_path_factory):
    from models import save_checkpoint, tiny_config

    base = tmp_path_factory.mktemp("faults")
    path = save_checkpoint(tiny_config("llama"), str(base / "llama"))
    return run_ranks(2, _faults, path, str(base / "ranks"))


def _case_results(faults, case, rank=0):
    r = faults[rank][case]
    assert "crashed" not in r, r["crashed"]
    return r


def _raised(ranks, case, key):
    """Raise again the error every rank saw (the same text on each)."""
    errors = [_case_results(ranks, case, rank)[key] for rank in range(len(ranks))]
    assert errors[0] is not None, f"{case}/{key}: no error was raised"
    assert all(e is not None and e["message"] == errors[0]["message"] for e in errors), errors
    if errors[0]["type"] == "fxparallel.errors.CheckpointError":
        raise CheckpointError(errors[0]["message"])
    raise AssertionError(f"{errors[0]['type']}: {errors[0]['message']}")


# ---- 1. a re-save that crashes between its renames loses nothing ------------------------------
def test_crashed_resave_keeps_the_step_and_the_next_save_restores_it(faults):
    with pytest.raises(CheckpointError, match=rf"finishing checkpoint .*{S2} failed: OSError: simulated crash; the "
                                              r"checkpoints saved before it are kept"):
        _raised(faults, "resave", "error")
    r = _case_results(faults, "resave")
    assert r["entries"] == [".old-" + S2, ".tmp-" + S2, "latest", S1], r["entries"]
    assert r["latest"] == ".old-" + S2 and r["listed"] == [(1, S1), (2, ".old-" + S2)]
    assert r["loaded"] == (2, 2.0)  # step 2 as first saved, not step 1
    assert r["after_next_save"] == ["latest", S2, S3], r["after_next_save"]


# ---- 2. / 3. an interrupted prune is not a checkpoint; leftovers go with the next save -------
def test_interrupted_prune_leaves_no_checkpoint_that_looks_complete(faults):
    r = _case_results(faults, "prune")
    assert r["error"] is None, r["error"]  # the new checkpoint is complete: a failed prune only warns
    assert r["listed"] == [2, 3]
    assert S1 not in r["entries_after_prune"], r["entries_after_prune"]


def test_next_save_removes_stale_temporary_and_trash_directories(faults):
    r = _case_results(faults, "prune")
    assert ".trash-" + S1 in r["entries_after_prune"]
    assert r["entries_after_next_save"] == ["latest", S3, S4], r["entries_after_next_save"]


# ---- 5. damaged files name the file and what to do ---------------------------------------------
@pytest.mark.parametrize("case, message", [
    ("garbage_json", rf"{S1}/{META} is not valid JSON \(JSONDecodeError: .*\); the checkpoint cannot be loaded\. "
                     r"Restore .* from a copy, or load another step"),
    ("garbage_metadata_trusted", rf"{S1}/\.metadata cannot be read as DCP metadata \(UnpicklingError: .*\); the file "
                                 r"is damaged\. Restore .* from a copy, or load another step"),
    ("truncated_distcp", rf"{S1}/__\d+_\d+\.distcp is truncated: \d+ bytes, but .*\.metadata places tensor data up "
                         r"to byte \d+ in it\. Restore .* from a complete copy, or load another step"),
    ("missing_distcp", rf"{S1}/__\d+_\d+\.distcp is missing; .*\.metadata places tensor data in it\. The checkpoint "
                       r"is incomplete"),
])
def test_damaged_files_give_a_checkpoint_error_naming_the_file(faults, case, message):
    with pytest.raises(CheckpointError, match=message):
        _raised(faults, "damaged", case)


# ---- 6. .metadata is unpickled only when its digest matches --------------------------------
@pytest.mark.parametrize("case", ["garbage_metadata", "crafted_metadata"])
def test_modified_metadata_is_not_unpickled(faults, case):
    with pytest.raises(CheckpointError, match=rf"{S1}/\.metadata was modified after it was written \(its sha256 is "
                                              r"[0-9a-f]{16}\.\.\., fxparallel\.json records [0-9a-f]{16}\.\.\.\); "
                                              r"refusing to unpickle it"):
        _raised(faults, "damaged", case)
    assert not _case_results(faults, "damaged")["crafted_ran"]


@pytest.mark.parametrize("case", ["no_digest", "crafted_metadata_no_digest"])
def test_metadata_without_a_digest_needs_trust_metadata(faults, case):
    with pytest.raises(CheckpointError, match=r"fxparallel\.json records no sha256 of .*\.metadata \(a checkpoint from "
                                              r"before fxparallel recorded one\); .* pass trust_metadata=True"):
        _raised(faults, "damaged", case)
    assert not _case_results(faults, "damaged")["crafted_ran"]
    for rank in range(len(faults)):  # the opt-in loads it
        r = _case_results(faults, "damaged", rank)
        assert r["no_digest_trusted"] is None and r["no_digest_trusted_step"] == 1


def test_load_refuses_latest_outside_the_root_on_every_rank(faults):
    with pytest.raises(CheckpointError, match=rf"latest names '\.\./elsewhere/{S1}', which is not a checkpoint "
                                              r"directory .*; refusing to follow it"):
        _raised(faults, "damaged", "latest_outside")


def test_ranks_that_find_different_checkpoints_refuse_together(faults):
    with pytest.raises(CheckpointError, match=r"the ranks found different checkpoints for .*good.*\(rank 0: \(1, "
                                              r"'[0-9a-f]{64}'\); rank 1: \(4, '[0-9a-f]{64}'\)\); the checkpoint root "
                                              r"must be one directory that every rank sees"):
        _raised(faults, "damaged", "ranks_disagree")


# ---- 7. runs of different layouts ---------------------------------------------------------
TP2, DP2 = {"dp": 1, "tp": 2, "cp": 1}, {"dp": 2, "tp": 1, "cp": 1}


def test_example_saves_under_a_directory_named_after_the_layout(faults):
    checkpoints = os.path.join("out", "train_3d", "checkpoints")  # the former default of every layout
    own = os.path.join("out", "train_3d", "dp2_tp1_cp1", "checkpoints")
    assert _case_results(faults, "layouts")["saved"] == {os.path.join(checkpoints, S2): TP2, os.path.join(own, S1): DP2,
                                             os.path.join(own, S2): DP2}


def test_a_step_written_by_another_layout_is_not_overwritten(faults):
    with pytest.raises(CheckpointError, match=rf"refusing to overwrite .*dp2_tp1_cp1/checkpoints/{S2}: it was written "
                                              r"with layout dp=2, tp=1, cp=1 \(model llama, parameter fingerprint "
                                              r"[0-9a-f]{16}\), this run has layout dp=1, tp=2, cp=1 \(model llama, "
                                              r"parameter fingerprint [0-9a-f]{16}\)\. Save runs of different layouts"):
        _raised(faults, "layouts", "overwrite")
    for rank in range(len(faults)):  # a new step, or a step of this layout, is saved; any layout loads any other
        r = _case_results(faults, "layouts", rank)
        assert r["other_step"] is None and r["same_layout_again"] is None and r["loaded"] == (2, DP2)
