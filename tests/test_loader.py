"""The streaming safetensors loader: each rank reads exactly its pieces, from local directories,
a hub cache laid out as huggingface_hub lays it out, or a loopback hub; bad checkpoints give
clear errors on every rank and leave nothing half-loaded."""
from __future__ import annotations

import json
import math
import os
import random
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

import fxparallel
from distributed import run_ranks
from fxparallel.errors import CheckpointError
from fxparallel.group import fake_group
from fxparallel.load import load_from_files, local_checkpoint, resolve_checkpoint, resolve_source
from fxparallel.load import safetensors_io
from fxparallel.module import ParallelCausalLM
from hub import FakeHub, add_to_cache, checkpoint_files
from models import edited_copy, save_checkpoint, tiny_config

TIED = dict(tie_word_embeddings=True)


# ---- helpers ---------------------------------------------------------------------
@pytest.fixture(scope="module")
def plans():
    """Real plans (captured and solved) of the tiny llama (untied) and qwen3 (tied) at tp 2 and 4."""
    return {(family, tp): fxparallel.plan_model(tiny_config(family, **kw), tp)[0]
            for family, kw in (("llama", {}), ("qwen3", TIED)) for tp in (2, 4)}


@pytest.fixture(scope="module")
def sharded_tied(tmp_path_factory):
    return save_checkpoint(tiny_config("qwen3", **TIED), str(tmp_path_factory.mktemp("qt") / "ck"),
                           max_shard_size="20KB")


def shard_module(plan, tp, rank, dtype=torch.float32, family="llama"):
    """The module parallelize would build for ``rank``, parameters filled with NaN (to see what was written)."""
    module = ParallelCausalLM(tiny_config(family), plan, fake_group(tp, rank), "cpu", dtype, None)
    with torch.no_grad():
        for p in module.parameters():
            p.fill_(float("nan"))
    return module


def full_tensors(directory) -> dict:
    out = {}
    for f in os.listdir(directory):
        if f.endswith(".safetensors"):
            out.update(load_file(os.path.join(directory, f)))
    return out


def check_shards(module, plan, full, rank, tp, dtype=torch.float32):
    """Every parameter equals its rank slice of the full tensor; returns the bytes the rank should read."""
    expected_bytes = 0
    for p in plan.params:
        stored = next(full[n] for n in p.names if n in full)
        want = stored[p.local_slices(rank, tp)].to(dtype)
        got = module.get_parameter(p.name)
        assert got.dtype == dtype and torch.equal(got, want), (p.name, rank, tp)
        for alias in p.aliases:  # tied: one tensor under every name
            assert module.get_parameter(alias) is got
        expected_bytes += math.prod(want.shape) * stored.element_size()
    return expected_bytes


def no_nan_written(module) -> bool:
    return all(torch.isnan(p).all() for p in module.parameters())


# ---- the reader ------------------------------------------------------------------
def test_reader_reads_exact_pieces_in_any_dtype(tmp_path, monkeypatch):
    monkeypatch.setattr(safetensors_io, "STAGING_BYTES", 40)  # force several staging rounds
    tensors = {"a": torch.randn(6, 10), "b": torch.randn(3, 4, 5).to(torch.bfloat16), "c": torch.tensor(2.5),
               "d": torch.arange(7, dtype=torch.int64)}
    path = str(tmp_path / "t.safetensors")
    save_file(tensors, path)
    rng = random.Random(0)
    with safetensors_io.SafetensorsFile(path) as f:
        for _ in range(150):
            name = rng.choice(sorted(tensors))
            t = tensors[name]
            index = []
            for s in t.shape:
                a = rng.randrange(s)
                index.append(slice(a, rng.randrange(a + 1, s + 1)))
            index = tuple(index)
            for dtype in (t.dtype, torch.float64):
                out = torch.empty(t[index].shape, dtype=dtype)
                assert f.read_into(name, index, out) == t[index].numel() * t.element_size()
                assert torch.equal(out, t[index].to(dtype)), (name, index, dtype)
                # a strided destination (one piece of a larger shard)
                big = torch.zeros(tuple(2 * s for s in out.shape), dtype=dtype)
                dest = big[tuple(slice(0, 2 * s, 2) for s in out.shape)]
                f.read_into(name, index, dest)
                assert torch.equal(dest, t[index].to(dtype))
    # a row slice is one run, a column slice one run per row, a replicated tensor one run
    assert safetensors_io.byte_runs((6, 10), ((2, 4), (0, 10)), 4) == [(80, 80)]
    assert safetensors_io.byte_runs((6, 10), ((0, 6), (5, 10)), 4) == [(r * 40 + 20, 20) for r in range(6)]
    assert safetensors_io.byte_runs((6, 10), ((0, 6), (0, 10)), 4) == [(0, 240)]


def test_byte_runs_cover_exactly_the_slice_in_order():
    """For random boxes of random 1-4 d shapes: the runs, expanded to element offsets, are the row-major
    offsets of ``tensor[box]``, and no two runs could merge (each is as long as it can be)."""
    g = torch.Generator().manual_seed(0)
    for _ in range(400):
        shape = tuple(int(n) for n in torch.randint(1, 6, (int(torch.randint(1, 5, (1,), generator=g)),), generator=g))
        box = []
        for n in shape:
            a = int(torch.randint(0, n + 1, (1,), generator=g))
            box.append((a, int(torch.randint(a, n + 1, (1,), generator=g))))
        expected = torch.arange(math.prod(shape)).reshape(shape)[tuple(slice(a, b) for a, b in box)].flatten()
        runs = safetensors_io.byte_runs(shape, tuple(box), 2)
        got = [o // 2 + k for o, n in runs for k in range(n // 2)]
        assert got == expected.tolist(), (shape, box)
        assert all(o1 + n1 < o2 for (o1, n1), (o2, _) in zip(runs, runs[1:])), (shape, box, runs)


# ---- correct shards ----------------------------------------------------------------
@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("kind", ["single", "sharded", "tied-single", "tied-sharded"])
def test_every_shard_equals_its_slice_and_only_its_bytes_are_read(checkpoints, sharded_tied, plans, kind, tp):
    directory = {"single": checkpoints["llama"], "sharded": checkpoints["llama-sharded"],
                 "tied-single": checkpoints["qwen3-tied"], "tied-sharded": sharded_tied}[kind]
    family = "qwen3" if kind.startswith("tied") else "llama"
    plan = plans[(family, tp)]
    files = resolve_checkpoint(directory, {})
    assert len(set(files.weight_map.values())) == (1 if "single" in kind else len(
        [f for f in os.listdir(directory) if f.endswith(".safetensors")])) > 0
    full = full_tensors(directory)
    stored = sum(t.numel() * t.element_size() for t in full.values())
    replicated = sum(full[p.name].numel() * 4 for p in plan.params if p.placement.is_replicate)
    total = 0
    for rank in range(tp):
        module = shard_module(plan, tp, rank, family=family)
        nbytes = load_from_files(module, plan, files, rank, tp)
        assert nbytes == check_shards(module, plan, full, rank, tp)
        total += nbytes
    # all ranks together read the checkpoint once, plus (tp - 1) extra copies of the replicated tensors
    assert total == stored + (tp - 1) * replicated
    assert replicated < stored / 10


@pytest.mark.parametrize("stored,wanted", [(torch.float32, torch.bfloat16), (torch.bfloat16, torch.float32)])
def test_dtype_is_converted_on_the_fly(checkpoints, plans, tmp_path, monkeypatch, stored, wanted):
    monkeypatch.setattr(safetensors_io, "STAGING_BYTES", 1000)  # stream through a small staging buffer
    directory = checkpoints["llama-sharded"]
    if stored != torch.float32:
        directory = str(tmp_path / "bf16")
        shutil.copytree(checkpoints["llama-sharded"], directory)
        for f in os.listdir(directory):
            if f.endswith(".safetensors"):
                path = os.path.join(directory, f)
                save_file({k: v.to(stored) for k, v in load_file(path).items()}, path, metadata={"format": "pt"})
    plan = plans[("llama", 2)]
    files, full = local_checkpoint(directory), full_tensors(directory)
    for rank in range(2):
        module = shard_module(plan, 2, rank, dtype=wanted)
        assert load_from_files(module, plan, files, rank, 2) == check_shards(module, plan, full, rank, 2, wanted)


# ---- bad checkpoints: clear errors, nothing written ----------------------------------


def test_missing_weights_are_all_listed(checkpoints, plans, tmp_path):
    gone = ["model.layers.1.mlp.up_proj.weight", "model.norm.weight"]
    directory = edited_copy(checkpoints["llama"], str(tmp_path / "ck"), lambda t: [t.pop(n) for n in gone])
    module = shard_module(plans[("llama", 2)], 2, 0)
    with pytest.raises(CheckpointError, match=r"has no weights for 2 parameter\(s\): " + ", ".join(gone)):
        load_from_files(module, plans[("llama", 2)], local_checkpoint(directory), 0, 2)
    assert no_nan_written(module)


def test_extra_tensors_give_a_warning_that_lists_them(checkpoints, plans, tmp_path):
    extra = {"model.layers.0.self_attn.rotary_emb.scale": torch.ones(2), "vision.proj.weight": torch.ones(2, 2)}
    directory = edited_copy(checkpoints["llama"], str(tmp_path / "ck"), lambda t: t.update(extra))
    module = shard_module(plans[("llama", 2)], 2, 1)
    with pytest.warns(UserWarning, match="2 tensor.* does not use: model.layers.0.self_attn.rotary_emb.scale, "
                                         "vision.proj.weight"):
        load_from_files(module, plans[("llama", 2)], local_checkpoint(directory), 1, 2)
    check_shards(module, plans[("llama", 2)], full_tensors(directory), 1, 2)


def test_shape_that_disagrees_with_the_config_names_file_and_tensor(plans, tmp_path):
    directory = save_checkpoint(tiny_config("llama", intermediate_size=96), str(tmp_path / "ck"))
    module = shard_module(plans[("llama", 2)], 2, 0)
    with pytest.raises(CheckpointError) as info:
        load_from_files(module, plans[("llama", 2)], local_checkpoint(directory), 0, 2)
    message = str(info.value)
    assert "tensor 'model.layers.0.mlp.gate_proj.weight' in " + os.path.join(directory, "model.safetensors") in message
    assert "has shape [96, 64] but the config gives [128, 64]" in message
    assert message.count("but the config gives") == 6  # gate, up, down of both layers: all listed
    assert no_nan_written(module)


@pytest.mark.parametrize("damage", ["truncated", "header"])
def test_truncated_or_corrupted_file_names_the_file(checkpoints, plans, tmp_path, damage):
    directory = str(tmp_path / "ck")
    shutil.copytree(checkpoints["llama-sharded"], directory)
    victim = os.path.join(directory, "model-00003-of-00014.safetensors")
    with open(victim, "rb") as f:
        data = f.read()
    with open(victim, "wb") as f:
        f.write(data[:-100] if damage == "truncated" else data[:8] + b"{not json" + data[17:])
    module = shard_module(plans[("llama", 2)], 2, 0)
    with pytest.raises(CheckpointError, match=f"{victim} is not a readable safetensors file .truncated or corrupted"):
        load_from_files(module, plans[("llama", 2)], local_checkpoint(directory), 0, 2)
    assert no_nan_written(module)


def test_index_pointing_to_an_absent_file_names_index_and_file(checkpoints, tmp_path):
    directory = str(tmp_path / "ck")
    shutil.copytree(checkpoints["llama-sharded"], directory)
    os.remove(os.path.join(directory, "model-00002-of-00014.safetensors"))
    index = os.path.join(directory, "model.safetensors.index.json")
    with pytest.raises(CheckpointError, match=f"{index} points to file.* absent from {directory}: "
                                              r"model-00002-of-00014.safetensors \(holding 1 tensor"):
        resolve_checkpoint(directory, {})


def test_bin_only_checkpoint_is_refused_with_a_conversion_hint(checkpoints, tmp_path):
    directory = str(tmp_path / "bin")
    os.makedirs(directory)
    shutil.copy(os.path.join(checkpoints["llama"], "config.json"), directory)
    with open(os.path.join(directory, "pytorch_model.bin"), "wb") as f:
        f.write(b"never unpickled")
    hint = r"has only pytorch_model.bin weights.*never unpickles.*save_pretrained\(out_dir\) writes safetensors"
    with pytest.raises(CheckpointError, match=hint):
        resolve_checkpoint(directory, {})
    cache = str(tmp_path / "cache")
    add_to_cache(cache, "org/binonly", checkpoint_files(directory))
    with pytest.raises(CheckpointError, match="hub repo 'org/binonly' " + hint):
        resolve_checkpoint("org/binonly", {"cache_dir": cache})


def test_hub_id_that_cannot_be_resolved_offline(tmp_path):
    cache = str(tmp_path / "cache")
    os.makedirs(cache)
    offline = r"hub id 'org/absent' cannot be resolved offline \(HF_HUB_OFFLINE=1 or local_files_only=True\)"
    with pytest.raises(CheckpointError, match=offline + f": its config.json is not in the hub cache {cache}"):
        resolve_source("org/absent", cache_dir=cache)
    with pytest.raises(CheckpointError, match=offline + f": neither model.safetensors nor .* in the hub cache {cache}"):
        resolve_checkpoint("org/absent", {"cache_dir": cache})


# ---- ranks: hub cache, loopback hub, failures shared by the group -------------------
def _hub_cache_ranks(rank, tp, repo_id, cache, commit):
    import torch.distributed as dist

    model = fxparallel.parallelize(repo_id, dist.group.WORLD, dtype=torch.float32)  # HF_HUB_CACHE from the env
    shards = {n: p.detach().numpy().copy() for n, p in model.named_parameters()}  # tensors can't cross
    # cache_dir= and a revision given as a commit hash
    files = resolve_checkpoint(repo_id, {"cache_dir": cache, "revision": commit})
    return shards, model.bytes_read, model.plan.to_dict(), files.source


def test_parallelize_loads_from_an_offline_hub_cache(checkpoints, tmp_path, monkeypatch):
    cache = str(tmp_path / "hub")
    ck = checkpoints["llama-sharded"]
    extras = {"pytorch_model.bin": os.path.join(ck, "config.json")}
    snapshot = add_to_cache(cache, "org/tiny", {**checkpoint_files(ck), **extras})
    commit = os.path.basename(snapshot)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", cache)
    per_rank = run_ranks(2, _hub_cache_ranks, "org/tiny", cache, commit, fresh=True)  # hub reads its env on import
    full = full_tensors(ck)
    for rank, (shards, nbytes, plan, source) in enumerate(per_rank):
        plan = fxparallel.ShardingPlan.from_dict(plan)
        expected = 0
        for p in plan.params:
            want = full[p.name][p.local_slices(rank, 2)]
            assert torch.equal(torch.from_numpy(shards[p.name]), want), p.name
            expected += want.numel() * 4
        assert nbytes == expected
        assert source == os.path.join(snapshot, "model.safetensors.index.json")


def _loopback_ranks(rank, tp, plan_dict, cache):
    """Online against the loopback hub: a good repo, a repo whose index names a file it lacks, and a
    failure on one rank only (rank 1 is given a .bin-only directory)."""
    import torch.distributed as dist

    from fxparallel.group import resolve_tp_group

    plan = fxparallel.ShardingPlan.from_dict(plan_dict)
    source = resolve_source("org/tiny", cache_dir=cache, token="hf_token_for_the_test")
    files = resolve_checkpoint("org/tiny", source.hub_kwargs, group=dist.group.WORLD)
    module = ParallelCausalLM(source.config, plan, resolve_tp_group(dist.group.WORLD), "cpu", torch.float32, None)
    nbytes = load_from_files(module, plan, files, rank, tp)
    shards = {n: p.detach().numpy().copy() for n, p in module.named_parameters()}
    errors = []
    for name in ("org/broken", cache + "/rank-asymmetric"):
        target = name if name.startswith("org/") else (name + f"-{rank}")
        try:
            resolve_checkpoint(target, {"cache_dir": cache})
            errors.append(None)
        except CheckpointError as err:
            errors.append(str(err))
    return shards, nbytes, errors


def test_one_download_per_node_and_failures_reach_every_rank(checkpoints, plans, tmp_path, monkeypatch):
    ck = checkpoints["llama-sharded"]
    cache = str(tmp_path / "hub")
    os.makedirs(os.path.join(cache, "rank-asymmetric-0"))
    shutil.copytree(ck, os.path.join(cache, "rank-asymmetric-0"), dirs_exist_ok=True)
    bin_only = os.path.join(cache, "rank-asymmetric-1")
    os.makedirs(bin_only)
    shutil.copy(os.path.join(ck, "config.json"), bin_only)
    shutil.copy(os.path.join(ck, "config.json"), os.path.join(bin_only, "pytorch_model.bin"))
    good = {**checkpoint_files(ck), "pytorch_model.bin": os.path.join(ck, "config.json"),
            "consolidated.safetensors": os.path.join(ck, "model-00001-of-00014.safetensors")}
    broken = checkpoint_files(ck, skip=("model-00005-of-00014.safetensors",))
    plan = plans[("llama", 2)]
    with FakeHub({"org/tiny": good, "org/broken": broken}) as hub:
        monkeypatch.setenv("HF_ENDPOINT", hub.url)
        monkeypatch.setenv("HF_HUB_OFFLINE", "0")
        per_rank = run_ranks(2, _loopback_ranks, plan.to_dict(), cache, fresh=True)
    # every needed file was downloaded exactly once for the two ranks; nothing else was
    weights = {name for name in good if name.endswith(".safetensors") and name.startswith("model-")}
    assert {f for (repo, f), n in hub.gets.items() if repo == "org/tiny"} == weights | {
        "config.json", "model.safetensors.index.json"}
    assert all(hub.gets[("org/tiny", f)] == 1 for f in weights | {"config.json", "model.safetensors.index.json"})
    assert "Bearer hf_token_for_the_test" in hub.authorizations  # token= reached the hub
    assert ("org/tiny", "pytorch_model.bin") not in hub.gets and ("org/tiny", "consolidated.safetensors") not in hub.gets
    full = full_tensors(ck)
    for rank, (shards, nbytes, errors) in enumerate(per_rank):
        for p in plan.params:
            assert torch.equal(torch.from_numpy(shards[p.name]), full[p.name][p.local_slices(rank, 2)]), p.name
        broken_error, asymmetric_error = errors
        assert "maps 1 tensor(s) to model-00005-of-00014.safetensors, which is absent from hub repo 'org/broken'" \
            in broken_error
        assert ("failed on rank 0" in broken_error) == (rank == 1)  # rank 0 downloads; rank 1 learns of it
        assert "has only pytorch_model.bin weights" in asymmetric_error
        assert ("failed on rank 1" in asymmetric_error) == (rank == 0)


def test_the_index_weight_map_decides_the_files(checkpoints):
    """The weight map comes from the index: every tensor of the index resolves to an existing file."""
    index = os.path.join(checkpoints["llama-sharded"], "model.safetensors.index.json")
    with open(index) as f:
        names = set(json.load(f)["weight_map"])
    files = resolve_checkpoint(checkpoints["llama-sharded"], {})
    assert set(files.weight_map) == names and all(os.path.exists(p) for p in files.weight_map.values())
    assert files.total_bytes == sum(os.path.getsize(p) for p in set(files.weight_map.values()))
