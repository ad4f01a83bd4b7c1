"""The graph cache (fxparallel/graph_cache): a planned graph read back from disk is the graph planning
builds (same code, plan, guards; bit-identical logits, loss, gradients and generated tokens on real
ranks, and nothing captured); a damaged, edited or stale file is rebuilt with a warning naming it; ranks writing the same
file at once leave a valid one; FXPARALLEL_GRAPH_CACHE=off writes nothing."""
from __future__ import annotations

import glob
import json
import logging
import os

import pytest

from distributed import run_ranks


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    from fxparallel import graph_cache

    monkeypatch.setenv("FXPARALLEL_GRAPH_CACHE", str(tmp_path / "graphs"))
    for k in graph_cache.stats:
        monkeypatch.setitem(graph_cache.stats, k, 0)
    return tmp_path / "graphs"


def _plan(config, **kwargs):
    import fxparallel

    return fxparallel.plan_model(config, 2, **kwargs)


def _same_graph(a, b) -> bool:
    key_a, key_b = (a.pieces.key, b.pieces.key) if a.pieces else ("", "")
    shapes = [{"input_ids": (2, 16), "labels": (2, 16)}, {"input_ids": (1, 16), "labels": (1, 16)},
              {"input_ids": (2, 9), "labels": (3, 9)}]
    return (a.code == b.code.replace(repr(key_b), repr(key_a)) and a.guards == b.guards
            and [a.guards.holds_for(s) for s in shapes] == [b.guards.holds_for(s) for s in shapes]
            and a.output_placements == b.output_placements and a.output_sizes == b.output_sizes
            and (a.pieces is None or a.pieces.code == b.pieces.code))


def test_cached_graph_is_the_planned_graph(cache_dir):
    from transformers import GPT2Config

    from fxparallel import graph_cache
    from models import tiny_config

    for config, kwargs in [(tiny_config("llama"), {}), (tiny_config("llama"), {"sequence_parallel": True}),
                           (GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=128, n_positions=64), {})]:
        built = _plan(config, **kwargs)
        read = _plan(config, **kwargs)
        assert read[0] == built[0] and _same_graph(built[1], read[1]), config.model_type
        assert read[1].pieces.key != built[1].pieces.key  # a fresh key per graph in one process
    assert graph_cache.stats == {"hits": 3, "misses": 3, "uncacheable": 0, "received": 0}
    assert len(glob.glob(str(cache_dir / "*" / "*.json"))) == 3
    _plan(tiny_config("llama", intermediate_size=192))  # another config: another key
    assert graph_cache.stats["misses"] == 4


def test_patched_model_code_is_planned_again(cache_dir, monkeypatch):
    """A runtime patch of the model's code (here a forward that flips the MLP's hidden units, which has no
    sharding rule) changes the key: the cached graph of the unpatched model is not used."""
    import torch
    from transformers.models.llama import modeling_llama

    from fxparallel import graph_cache
    from models import tiny_config

    plain, _ = _plan(tiny_config("llama"))

    def flipped_mlp(self, x):
        return self.down_proj(torch.flip(self.act_fn(self.gate_proj(x)) * self.up_proj(x), dims=[-1]))

    monkeypatch.setattr(modeling_llama.LlamaMLP, "forward", flipped_mlp)
    patched, _ = _plan(tiny_config("llama"))
    assert graph_cache.stats["misses"] == 2 and graph_cache.stats["hits"] == 0
    assert not plain.fallbacks and any("flip" in f for f in patched.fallbacks), patched.fallbacks


def _only_file(cache_dir) -> str:
    files = glob.glob(str(cache_dir / "*" / "*.json"))
    assert len(files) == 1
    return files[0]


def _mac_of(cache_dir, stored) -> str:
    """The MAC this user's key gives a stored file (what only this user can compute)."""
    from fxparallel.graph_cache import store

    return store._mac((cache_dir / store.SECRET).read_bytes(), stored["key"], stored["entry"])


def _rewrite(path, edit):
    with open(path) as f:
        stored = json.load(f)
    edit(stored)
    with open(path, "w") as f:
        json.dump(stored, f)


def test_damaged_edited_or_stale_files_are_rebuilt(cache_dir, caplog):
    from fxparallel import graph_cache
    from models import tiny_config

    config = tiny_config("llama")
    reference = _plan(config)
    path = _only_file(cache_dir)

    def tamper(stored):  # edited code: the MAC no longer matches
        stored["entry"]["code"]["src"] = stored["entry"]["code"]["src"].replace("all_reduce", "copy_to_tp", 1)

    def stale(stored):  # an authentic file built for other versions
        stored["key"]["versions"]["torch"] = "0.0"
        stored["mac"] = _mac_of(cache_dir, stored)

    def wrong_code(stored):  # authentic, for this key, but its code does not load: still rebuilt
        stored["entry"]["code"]["globals"]["torch"] = ["module", "torch.no_such_module_anywhere"]
        stored["mac"] = _mac_of(cache_dir, stored)

    unauthenticated = "is not authenticated by this user's key"
    cases = [(tamper, unauthenticated), (stale, "was built for another key (versions differ)"),
             (wrong_code, "does not load (ModuleNotFoundError"), (lambda stored: stored.clear(), unauthenticated)]
    for edit, message in cases:
        _rewrite(path, edit)
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="fxparallel"):
            again = _plan(config)
        assert any(message in r.getMessage() and os.path.basename(path)[:-5] in r.getMessage() for r in caplog.records), \
            (message, [r.getMessage() for r in caplog.records])
        assert again[0] == reference[0] and _same_graph(reference[1], again[1])
    with open(path, "w") as f:
        f.write("{not json")
    with caplog.at_level(logging.WARNING, logger="fxparallel"):
        _plan(config)
    assert any("is unreadable" in r.getMessage() for r in caplog.records)
    hits = graph_cache.stats["hits"]
    _plan(config)  # the rebuilt file is good again
    assert graph_cache.stats["hits"] == hits + 1


def test_cache_off_writes_nothing(tmp_path, monkeypatch):
    from fxparallel.graph_cache import store
    from models import tiny_config

    monkeypatch.setenv("FXPARALLEL_GRAPH_CACHE", "off")
    assert store.cache_dir() is None
    monkeypatch.setenv("FXPARALLEL_GRAPH_CACHE", "1")  # on, in the default place (not a directory named 1)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))  # often shared by a team: not used
    assert store.cache_dir() == str(tmp_path / "xdg" / "fxparallel" / "graphs")
    monkeypatch.delenv("FXPARALLEL_GRAPH_CACHE")
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert store.cache_dir() == str(tmp_path / "home" / ".cache" / "fxparallel" / "graphs")  # the user's own cache
    monkeypatch.setenv("FXPARALLEL_GRAPH_CACHE", "off")
    _plan(tiny_config("llama"))
    assert not os.path.exists(tmp_path / "home") and not os.path.exists(tmp_path / "xdg")


def _cached_vs_built(rank, world, path, root):
    import torch
    import torch.distributed as dist

    import fxparallel
    from fxparallel import graph_cache

    os.environ["FXPARALLEL_GRAPH_CACHE"] = root
    os.environ["FXPARALLEL_PLANNING"] = "each"  # every rank plans (and captures) alone
    out = {}
    # every rank alone (tp = 1): both write the same file at the same moment
    solo = dist.new_subgroups(group_size=1)[0]
    for _ in range(2):
        dist.barrier()
        fxparallel.parallelize(path, solo, dtype=torch.float32)
    out["solo"] = dict(graph_cache.stats)
    ids = torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(1))
    runs, captures = [], []
    capture = fxparallel.api.capture
    fxparallel.api.capture = lambda *a, **k: (captures.append(a[1].arguments), capture(*a, **k))[1]
    for _ in range(2):  # built, then read back
        model = fxparallel.parallelize(path, dist.group.WORLD, dtype=torch.float32)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        logits = model(input_ids=ids).logits
        tokens = model.generate(input_ids=ids[:, :5], max_new_tokens=6, do_sample=False)
        runs.append((loss.detach(), logits.detach(), {n: p.grad for n, p in model.named_parameters()}, tokens))
        out.setdefault("captures", []).append(len(captures))
    (loss_a, logits_a, grads_a, tokens_a), (loss_b, logits_b, grads_b, tokens_b) = runs
    out["identical"] = (torch.equal(loss_a, loss_b) and torch.equal(logits_a, logits_b) and torch.equal(tokens_a, tokens_b)
                        and grads_a.keys() == grads_b.keys() and all(torch.equal(grads_a[n], grads_b[n]) for n in grads_a))
    out["stats"] = dict(graph_cache.stats)
    return out


def test_cached_graphs_run_bit_identical_on_ranks(checkpoints, tmp_path):
    root = str(tmp_path / "graphs")
    results = run_ranks(2, _cached_vs_built, checkpoints["llama"], root)
    for rank, out in enumerate(results):
        assert out["identical"], rank
        # training graph, logits graph, prefill and decode: built once, read back once
        assert out["stats"]["hits"] - out["solo"]["hits"] == 4, out
        assert out["stats"]["misses"] - out["solo"]["misses"] == 4, out
        # captured: training, prefill, decode (the logits graph is cut from the training capture); then nothing
        assert out["captures"] == [3, 3], out
    assert sum(out["solo"]["misses"] for out in results) >= 1  # the shared tp=1 file was written ...
    assert all(out["solo"]["hits"] >= 1 for out in results)  # ... and read back whole by both
    for path in glob.glob(os.path.join(root, "*", "*.json")):
        with open(path) as f:
            json.load(f)  # every file whole
    assert not glob.glob(os.path.join(root, "*", ".tmp-*"))
