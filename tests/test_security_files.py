"""No code runs from data, and no write or read leaves its folder: the attacker's side of four defences.

1. DCP's ``.metadata`` (a pickle) is read with a restricted unpickler: a crafted one, with the digest
   in ``fxparallel.json`` recomputed to match (whoever writes one writes both), is refused by
   ``load_checkpoint`` naming the global, and its code never runs.
2. ``latest`` and ``fxparallel.json`` are written through new temporary files: a symlink planted at
   ``latest.tmp`` or ``fxparallel.json.tmp`` does not lead the save to overwrite a file elsewhere.
3. Shard names of a safetensors index stay in the index's folder and name regular files.
4. Agreement values cross torch.distributed's store as JSON: a pickle planted there is not run.

The checkpoint and store cases share one spawn of 2 gloo ranks (tp=2); the rest run in this process.
"""
from __future__ import annotations

import builtins
import hashlib
import json
import os
import pickle
import re
import shutil

import pytest

from distributed import run_ranks
from fxparallel.errors import CheckpointError, GroupError
from fxparallel.load import resolve_checkpoint
from fxparallel.runtime.checkpoint import DCP_METADATA, META, _write_text, metadata_reader, step_dir_name
from hub import add_to_cache, checkpoint_files
from test_checkpoint_faults import _case, _case_results, _Crafted, _error, _on_rank0, _raised, _setup

S1, S2 = step_dir_name(1), step_dir_name(2)
INDEX = "model.safetensors.index.json"
MARKER = "pwned"  # what a crafted payload creates (``_Crafted``: os.mkdir) if it ever runs


class _Exec:
    """A payload through ``builtins.exec`` rather than ``os``: writes the marker file."""

    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return builtins.exec, (f"open({self.path!r}, 'w').write('ran')",)


# ---- 1. a crafted .metadata, digest recomputed: refused by name, never run ----------------------
def _with_digest(directory: str) -> None:
    """Record the sha256 of ``directory``'s .metadata in its fxparallel.json, as an attacker would."""
    with open(os.path.join(directory, DCP_METADATA), "rb") as f:
        digest = hashlib.sha256(f.read()).hexdigest()
    with open(os.path.join(directory, META)) as f:
        meta = json.load(f)
    meta["metadata_sha256"] = digest
    with open(os.path.join(directory, META), "w") as f:
        json.dump(meta, f)


def _bytes_entry(good: str, path: str) -> bytes:
    """The real metadata with one model tensor turned into a non-tensor entry (BytesStorageMetadata) whose
    bytes are a pickle in a new data file: only DCP's own classes in .metadata, but DCP would load those
    bytes with ``torch.load(weights_only=False)``, which runs the pickle."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata, MetadataIndex

    with open(os.path.join(good, DCP_METADATA), "rb") as f:
        metadata = pickle.load(f)  # our own save, in the test: trusted
    key = next(k for k in metadata.state_dict_metadata if k.startswith("model."))
    payload = pickle.dumps(_Crafted(os.path.join(path, MARKER)))
    with open(os.path.join(path, "evil.distcp"), "wb") as f:
        f.write(payload)
    metadata.state_dict_metadata[key] = BytesStorageMetadata()
    metadata.storage_data[MetadataIndex(key)] = _StorageInfo("evil.distcp", 0, len(payload))
    return pickle.dumps(metadata)


def _class_attribute() -> bytes:
    """A pickle built from allowed globals only that sets an attribute on DCP's Metadata class itself
    (BUILD with slot state on a class), which would change it for the whole process."""
    def short(text: bytes) -> bytes:  # SHORT_BINUNICODE
        return b"\x8c" + bytes([len(text)]) + text

    # PROTO 4, STACK_GLOBAL Metadata, state (None, {"tampered": True}), BUILD, STOP
    return (b"\x80\x04" + short(b"torch.distributed.checkpoint.metadata") + short(b"Metadata") + b"\x93"
            + b"N}" + short(b"tampered") + b"\x88s\x86b.")


def _crafted_copies(base: str, good: str) -> dict:
    """{case: checkpoint directory}: copies of ``good`` with a crafted .metadata and a matching digest."""
    payloads = {
        "os_mkdir": lambda path: pickle.dumps(_Crafted(os.path.join(path, MARKER))),
        "builtins_exec": lambda path: pickle.dumps(_Exec(os.path.join(path, MARKER))),
        "bytes_entry": lambda path: _bytes_entry(good, path),
        "class_attribute": lambda path: _class_attribute(),
    }
    cases = {}
    for case, payload in payloads.items():
        path = os.path.join(base, "crafted", case, S1)
        shutil.copytree(good, path)
        with open(os.path.join(path, DCP_METADATA), "wb") as f:
            f.write(payload(path))
        _with_digest(path)
        cases[case] = path
    return cases


def _crafted(rank, base, mesh, model, opt):
    import torch.distributed as dist

    from fxparallel.runtime import checkpoint, load_checkpoint, save_checkpoint
    from torch.distributed.checkpoint.metadata import Metadata

    good = save_checkpoint(os.path.join(base, "good"), model, opt, mesh, 1)
    box = [None]
    _on_rank0(rank, lambda: box.__setitem__(0, _crafted_copies(base, good)))
    dist.broadcast_object_list(box, src=0)
    cases = box[0]
    out = {case: _error(lambda: load_checkpoint(path, model, opt, mesh)) for case, path in sorted(cases.items())}
    # dcp.load reads .metadata again: its reader is the restricted one too (the check before it skipped here)
    check = checkpoint._check_against_metadata
    checkpoint._check_against_metadata = lambda state, directory: None
    try:
        out["dcp_load_reader"] = _error(lambda: load_checkpoint(cases["builtins_exec"], model, opt, mesh))
    finally:
        checkpoint._check_against_metadata = check
    out["ran"] = sorted(c for c, p in cases.items() if os.path.exists(os.path.join(p, MARKER)))
    out["class_tampered"] = hasattr(Metadata, "tampered")
    out["good_step"] = load_checkpoint(good, model, opt, mesh)["step"]  # a real save still loads
    return out


# ---- 2. symlinks planted at the temporary names of a save ----------------------------------------
def _planted(rank, base, mesh, model, opt):
    """Before the save, ``latest.tmp`` is a symlink to a file outside the root; while DCP writes, so is
    ``fxparallel.json.tmp`` in the step's temporary directory (the name the marker was written through)."""
    from fxparallel.runtime import checkpoint, latest_checkpoint, save_checkpoint

    root, victims = os.path.join(base, "planted", "root"), {}
    for name in ("latest", "json"):
        victims[name] = os.path.join(base, "planted", f"victim-{name}.txt")

    def plant():
        os.makedirs(root)
        for path in victims.values():
            with open(path, "w") as f:
                f.write("precious")
        os.symlink(victims["latest"], os.path.join(root, "latest.tmp"))

    _on_rank0(rank, plant)
    digest = checkpoint._metadata_digest

    def digest_and_plant(directory):  # runs on rank 0 right before fxparallel.json is written
        os.symlink(victims["json"], os.path.join(directory, META + ".tmp"))
        return digest(directory)

    if rank == 0:
        checkpoint._metadata_digest = digest_and_plant
    try:
        out = {"save": _error(lambda: save_checkpoint(root, model, opt, mesh, 2))}
    finally:
        checkpoint._metadata_digest = digest
    out["victims"] = {}
    for name, path in victims.items():
        with open(path) as f:
            out["victims"][name] = f.read()
    out["latest"] = latest_checkpoint(root)
    out["latest_is_link"] = os.path.islink(os.path.join(root, "latest"))
    with open(os.path.join(root, S2, META)) as f:
        out["step"] = json.load(f)["step"]
    return out


# ---- 4. a pickle planted in the store ------------------------------------------------------------
def _store_pickle(rank, base):
    """Rank 1 writes a pickle at the key its value of the next agreement point goes to (what any
    process reaching the store's port can do); rank 0 exchanges as usual."""
    import torch.distributed as dist

    from fxparallel.load import coordinate

    group = dist.group.WORLD
    dist.barrier()
    marker = os.path.join(base, "store-" + MARKER)
    if rank == 0:
        error = _error(lambda: coordinate.exchange(group, "mine", "a step", timeout=60))
    else:
        ranks = coordinate._ranks(group)
        seq = coordinate._entered.get(ranks, 0)
        coordinate._entered[ranks] = seq + 1
        store = coordinate._store()
        store.set(f"{coordinate._point_prefix(ranks, seq)}/value/1", pickle.dumps(_Crafted(marker)))
        error = None
    dist.barrier()
    return {"error": error, "ran": os.path.exists(marker)}


def _ranks(rank, world, path, base):
    mesh, model, opt = _setup(path, tp=2, dp=1)
    return {"crafted": _case(_crafted, rank, base, mesh, model, opt),
            "planted": _case(_planted, rank, base, mesh, model, opt),
            "store": _case(_store_pickle, rank, base)}


@pytest.fixture(scope="module")
def ranks(checkpoints, tmp_path_factory):
    return run_ranks(2, _ranks, checkpoints["llama"], str(tmp_path_factory.mktemp("security")))


@pytest.mark.parametrize("case, refused", [
    ("os_mkdir", r"posix\.mkdir"),
    ("builtins_exec", r"builtins\.exec"),
    ("bytes_entry", r"torch\.distributed\.checkpoint\.metadata\.BytesStorageMetadata \(a non-tensor entry, which "
                    r"DCP would load with torch\.load\(weights_only=False\)"),
])
def test_crafted_metadata_with_a_matching_digest_is_refused_naming_the_global(ranks, case, refused):
    with pytest.raises(CheckpointError, match=rf"{S1}/\.metadata refers to the global {refused}.*refusing to "
                                              r"unpickle it, as a crafted file runs code that way\. Nothing of it "
                                              r"was run"):
        _raised(ranks, "crafted", case)
    assert _case_results(ranks, "crafted")["ran"] == []


def test_metadata_setting_attributes_of_a_class_is_refused_and_undone(ranks):
    with pytest.raises(CheckpointError, match=rf"{S1}/\.metadata sets attributes of Metadata \(process-wide objects, "
                                              r"put back now\); refusing it"):
        _raised(ranks, "crafted", "class_attribute")
    assert not any(_case_results(ranks, "crafted", r)["class_tampered"] for r in range(len(ranks)))


def test_dcp_load_reads_metadata_with_the_restricted_unpickler_too(ranks):
    with pytest.raises(CheckpointError, match=r"loading .* failed \(rank 0: .*\.metadata refers to the global "
                                              r"builtins\.exec"):
        _raised(ranks, "crafted", "dcp_load_reader")
    assert _case_results(ranks, "crafted")["ran"] == []
    assert all(_case_results(ranks, "crafted", r)["good_step"] == 1 for r in range(len(ranks)))


def test_reader_refuses_a_crafted_metadata_before_running_it(tmp_path):
    """The reader alone, without ranks: a payload through os.system-like globals never runs."""
    (tmp_path / DCP_METADATA).write_bytes(pickle.dumps(_Exec(str(tmp_path / MARKER))))
    with pytest.raises(CheckpointError, match=r"\.metadata refers to the global builtins\.exec"):
        metadata_reader(str(tmp_path)).read_metadata()
    assert not (tmp_path / MARKER).exists()


# ---- 2. ------------------------------------------------------------------------------------------
def test_save_does_not_write_through_planted_temporary_symlinks(ranks):
    for rank in range(len(ranks)):
        r = _case_results(ranks, "planted", rank)
        assert r["save"] is None, r["save"]
        assert r["victims"] == {"latest": "precious", "json": "precious"}
        assert os.path.basename(r["latest"]) == S2 and not r["latest_is_link"] and r["step"] == 2


def test_write_text_replaces_the_file_without_following_a_planted_symlink(tmp_path):
    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    folder = tmp_path / "root"
    folder.mkdir()
    os.symlink(victim, folder / "latest.tmp")
    _write_text(str(folder / "latest"), S1)
    assert victim.read_text() == "precious"
    assert (folder / "latest").read_text() == S1 and not (folder / "latest").is_symlink()
    leftovers = sorted(p.name for p in folder.iterdir())
    assert leftovers == ["latest", "latest.tmp"], leftovers  # the planted link is left alone, no temporary file


# ---- 3. shard names of a safetensors index -------------------------------------------------------
def _index_copy(sharded: str, dst, rename) -> tuple:
    """A copy of the sharded checkpoint whose index maps the first shard's tensors to ``rename(dst)``."""
    directory = dst / "ck"
    shutil.copytree(sharded, directory)
    index = directory / INDEX
    data = json.loads(index.read_text())
    first = sorted(set(data["weight_map"].values()))[0]
    name = rename(dst, directory / first)
    data["weight_map"] = {t: (name if f == first else f) for t, f in data["weight_map"].items()}
    index.write_text(json.dumps(data))
    return str(directory), str(index), name


def _outside(dst, shard):
    shutil.copy(shard, dst / "outside.safetensors")
    return "../outside.safetensors"


def _absolute(dst, shard):
    shutil.copy(shard, dst / "outside.safetensors")
    return str(dst / "outside.safetensors")


def _fifo(dst, shard):
    os.mkfifo(shard.parent / "fifo.safetensors")
    return "fifo.safetensors"


def _directory(dst, shard):
    (shard.parent / "dir.safetensors").mkdir()
    return "dir.safetensors"


def _link_outside(dst, shard):
    shutil.copy(shard, dst / "outside.safetensors")
    os.symlink(dst / "outside.safetensors", shard.parent / "link.safetensors")
    return "link.safetensors"


@pytest.mark.timeout(60, method="thread")  # a FIFO opened in Rust code ignores signals
@pytest.mark.parametrize("rename, why", [
    (_outside, r"which leads out of the index's folder \('\.\.'\)"),
    (_absolute, r"an absolute path"),
    (_fifo, None),
    (_directory, None),
    (_link_outside, r"which resolves to .*outside\.safetensors, outside .*"),
], ids=["dotdot", "absolute", "fifo", "directory", "symlink_outside"])
def test_index_shard_names_are_confined_to_regular_files_of_its_folder(checkpoints, tmp_path, rename, why):
    directory, index, name = _index_copy(checkpoints["llama-sharded"], tmp_path, rename)
    if why is None:  # a FIFO (opening it would wait forever) or a directory
        kind = "a FIFO" if "fifo" in name else "a directory"
        message = rf"the shard '{re.escape(name)}' of {re.escape(index)} is {kind}, not a regular file; refusing"
    else:
        message = rf"{re.escape(index)} maps tensors to the shard '{re.escape(name)}', {why}; refusing to read it"
    with pytest.raises(CheckpointError, match=message):
        resolve_checkpoint(directory, {})


@pytest.mark.timeout(60, method="thread")  # a FIFO opened in Rust code ignores signals
def test_single_safetensors_file_that_is_a_fifo_is_refused(checkpoints, tmp_path):
    directory = tmp_path / "ck"
    directory.mkdir()
    shutil.copy(os.path.join(checkpoints["llama"], "config.json"), directory)
    os.mkfifo(directory / "model.safetensors")
    with pytest.raises(CheckpointError, match=r"model\.safetensors is a FIFO, not a regular file"):
        resolve_checkpoint(str(directory), {})


def test_hub_cache_shards_are_symlinks_into_blobs_and_still_load(checkpoints, tmp_path):
    cache = str(tmp_path / "hub")
    ck = checkpoints["llama-sharded"]
    snapshot = add_to_cache(cache, "org/tiny", checkpoint_files(ck))
    files = resolve_checkpoint("org/tiny", {"cache_dir": cache, "local_files_only": True})
    assert files.source == os.path.join(snapshot, INDEX)
    assert all(os.path.islink(p) and os.path.dirname(p) == snapshot for p in files.weight_map.values())
    assert resolve_checkpoint(snapshot, {}).weight_map == files.weight_map  # the snapshot given as a directory


def test_hub_index_naming_a_file_outside_the_repo_is_refused_before_download(checkpoints, tmp_path):
    cache = str(tmp_path / "hub")
    directory, _, _ = _index_copy(checkpoints["llama-sharded"], tmp_path, lambda *_: "../../../outside.safetensors")
    snapshot = add_to_cache(cache, "org/evil", checkpoint_files(directory))
    with pytest.raises(CheckpointError, match=rf"{re.escape(os.path.join(snapshot, INDEX))} maps tensors to the shard "
                                              r"'\.\./\.\./\.\./outside\.safetensors', which leads out of the index's "
                                              r"folder"):
        resolve_checkpoint("org/evil", {"cache_dir": cache, "local_files_only": True})


# ---- 4. ------------------------------------------------------------------------------------------
def test_pickle_planted_in_the_store_is_refused_and_not_run(ranks):
    r = _case_results(ranks, "store")
    assert not r["ran"] and not _case_results(ranks, "store", 1)["ran"]
    assert r["error"] is not None and r["error"]["type"] == "fxparallel.errors.GroupError", r["error"]
    assert "at fxparallel/agree/0,1/" in r["error"]["message"]
    assert "not the JSON [step, what, value] fxparallel writes there" in r["error"]["message"]


def test_store_values_decode_as_json_only(tmp_path):
    from fxparallel.load import coordinate

    marker = str(tmp_path / MARKER)
    with pytest.raises(GroupError, match=r"at k, not the JSON \[step, what, value\] fxparallel writes there: another "
                                         r"program writes to this store"):
        coordinate._entry(pickle.dumps(_Crafted(marker)), "k")
    assert not os.path.exists(marker)
    with pytest.raises(GroupError, match=r"not the \[message, late ranks\]"):
        coordinate._verdict(b'{"message": 1}', "v")
    assert coordinate._entry(coordinate._encode(["s", "w", ("host", 0, 1)]), "k") == ["s", "w", ["host", 0, 1]]
