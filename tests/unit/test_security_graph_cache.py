"""The graph cache and generated code, attacked: nothing a checkpoint or another user writes runs.

- a data-only checkpoint whose config strings become module names (X-MOD's `languages`) is refused by
  name before capture, and its payload never runs;
- a planted cache entry (code that writes a marker file) with a recomputed plain checksum, an authentic
  entry behind a symlink, owned by another uid, in a folder writable by others: never decoded, a warning
  names it, the graph is rebuilt;
- the decoder's allow-list: an authentic entry that imports an unlisted module, reaches a dunder, or
  carries code FX does not generate is refused."""
from __future__ import annotations

import glob
import hashlib
import json
import logging
import os

import pytest

from test_graph_cache import _mac_of, _only_file, _plan, cache_dir  # noqa: F401 - the fixture


def _marker_code(marker: str) -> str:
    return f"open({marker!r}, 'w').close()"


def _payload(code: str) -> str:
    """A name component that breaks out of torch.fx's getattr(r, "<component>") (no dots, which
    nn.ModuleDict refuses)."""
    return 'a",exec(bytes((' + ",".join(str(b) for b in code.encode()) + ')))or"'


def test_config_strings_cannot_become_code(tmp_path):
    from transformers import XmodConfig

    import fxparallel
    from fxparallel.errors import CaptureError

    marker = tmp_path / "ran"
    config = XmodConfig(vocab_size=100, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                        intermediate_size=64, is_decoder=True, default_language="en_XX",
                        languages=["en_XX", _payload(_marker_code(str(marker)))])
    # refused on the meta model, before capture (the code generator's own check is the second line)
    with pytest.raises(CaptureError, match=r"the model's module '.*adapter_modules\.a\\?\",exec.*not a Python "
                                           r"identifier or integer"):
        fxparallel.plan_model(config, 1)
    assert not marker.exists()
    plain = XmodConfig(vocab_size=100, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                       intermediate_size=64, is_decoder=True, default_language="en_XX", languages=["en_XX", "de_DE"])
    assert fxparallel.plan_model(plain, 1)[0] is not None  # identifiers are fine


def test_generated_code_checks_every_target():
    import torch.fx as fx

    from fxparallel.capture.names import unsafe_component
    from fxparallel.errors import CaptureError
    from fxparallel.rewrite.bind import generate_forward

    assert unsafe_component("model.layers.0.mlp") is None
    assert [unsafe_component(p) for p in ("a.b-c", 'x."y', "class.weight", "a..b")] == ["b-c", '"y', "class", ""]
    graph = fx.Graph()
    graph.output(graph.get_attr('w",exec("1")or"'))
    with pytest.raises(CaptureError, match="graph get_attr target"):
        generate_forward(graph)


def _plant(path: str, stored: dict) -> None:
    os.chmod(path, 0o600)
    with open(path, "w") as f:
        json.dump(stored, f)


def _planted_code(path: str, marker: str) -> dict:
    """The stored file with code that runs as soon as the entry's source is compiled (a default argument)."""
    with open(path) as f:
        stored = json.load(f)
    src = stored["entry"]["code"]["src"]
    stored["entry"]["code"]["src"] = src.replace("):", f", _ran={_marker_code(marker)}):", 1)
    return stored


def _replanned(config, caplog, message: str):
    from fxparallel import graph_cache

    misses = graph_cache.stats["misses"]
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="fxparallel"):
        planned = _plan(config)
    assert graph_cache.stats["misses"] == misses + 1, "the planted entry was used"
    assert any(message in r.getMessage() for r in caplog.records), [r.getMessage() for r in caplog.records]
    return planned


def test_planted_entries_never_run(cache_dir, tmp_path, caplog):  # noqa: F811
    from fxparallel.graph_cache import store
    from models import tiny_config

    config = tiny_config("llama")
    reference = _plan(config)
    path = _only_file(cache_dir)
    marker = str(tmp_path / "ran")
    assert stat_mode(cache_dir) == 0o700 and stat_mode(cache_dir / store.SECRET) == 0o600

    # 1. code planted with the plain sha256 an attacker can recompute (the old format's checksum)
    stored = _planted_code(path, marker)
    stored.pop("mac")
    stored["sha256"] = hashlib.sha256(json.dumps([stored["key"], stored["entry"]], sort_keys=True).encode()).hexdigest()
    _plant(path, stored)
    again = _replanned(config, caplog, "is not authenticated by this user's key")
    assert again[0] == reference[0] and not os.path.exists(marker)

    # 2. an authentic entry (as if this user's key leaked) behind a symlink: not followed
    elsewhere = str(tmp_path / "elsewhere.json")
    authentic = _planted_code(path, marker)
    authentic["mac"] = _mac_of(cache_dir, authentic)
    with open(elsewhere, "w") as f:
        json.dump(authentic, f)
    os.unlink(path)
    os.symlink(elsewhere, path)
    _replanned(config, caplog, "cannot be opened without following links")
    assert not os.path.exists(marker) and not os.path.islink(path)  # replaced by a rebuilt file

    # 3. the same authentic entry in a file writable by others, then in a subfolder writable by others
    _plant(path, authentic)
    os.chmod(path, 0o666)
    _replanned(config, caplog, "is writable by others (mode 0666)")
    assert not os.path.exists(marker)
    _plant(path, authentic)
    os.chmod(os.path.dirname(path), 0o777)
    _replanned(config, caplog, "is writable by others")
    os.chmod(os.path.dirname(path), 0o700)
    assert not os.path.exists(marker)

    # 4. a shared cache folder (group-writable): not used at all, nothing written into it
    os.chmod(cache_dir, 0o770)
    _plant(path, authentic)
    _replanned(config, caplog, "graph cache: not used")
    assert not os.path.exists(marker) and json.load(open(path)) == authentic
    os.chmod(cache_dir, 0o700)


def stat_mode(path) -> int:
    return os.stat(path).st_mode & 0o777


@pytest.mark.skipif(os.geteuid() != 0, reason="giving a file to another uid needs root (CI runs as root)")
def test_entries_of_another_user_never_run(cache_dir, tmp_path, caplog):  # noqa: F811
    from fxparallel.graph_cache import store
    from models import tiny_config

    config = tiny_config("llama")
    _plan(config)
    path = _only_file(cache_dir)
    marker = str(tmp_path / "ran")
    authentic = _planted_code(path, marker)
    authentic["mac"] = _mac_of(cache_dir, authentic)
    _plant(path, authentic)
    os.chown(path, 4242, 4242)
    _replanned(config, caplog, "is owned by uid 4242")
    assert not os.path.exists(marker)
    os.chown(cache_dir / store.SECRET, 4242, 4242)  # a key someone else made: the cache is not used
    _plant(path, authentic)
    _replanned(config, caplog, "secret.key is owned by uid 4242")
    assert not os.path.exists(marker)


@pytest.fixture(scope="module")
def llama_entry(tmp_path_factory) -> str:
    """A tiny Llama's stored cache entry (JSON), planned once for the decoder's cases."""
    from models import tiny_config

    with pytest.MonkeyPatch.context() as patch:
        cache = tmp_path_factory.mktemp("entry") / "graphs"
        patch.setenv("FXPARALLEL_GRAPH_CACHE", str(cache))
        _plan(tiny_config("llama"))
    with open(_only_file(cache)) as f:
        return json.dumps(json.load(f)["entry"])


@pytest.mark.parametrize("edit, message", [
    (lambda e: e["code"]["globals"].update(os=["module", "os"]), "module os is not on the graph cache's allow-list"),
    (lambda e: e["code"]["globals"].update(
        f=["object", "fxparallel.ops.collectives", "all_reduce.__globals__"]), "not on the graph cache's allow-list"),
    (lambda e: e["code"].update(src=e["code"]["src"].replace("def forward", "import os\ndef forward", 1)),
     "the keyword import"),
    (lambda e: e["code"].update(src=e["code"]["src"] + "\nx = torch.load('f')\n"), "not a single function named forward"),
    (lambda e: e["code"].update(src=e["code"]["src"].replace("):\n", "):\n    torch.__dict__\n", 1)),
     "the name __dict__"),
    (lambda e: e["code"].update(src=e["code"]["src"].replace("):\n", "):\n    eval('1')\n", 1)),
     "a call of eval"),
    (lambda e: e["code"].update(src=e["code"]["src"].replace("):\n", "):\n    for i in range(2): pass\n", 1)),
     "a For statement"),
    (lambda e: e["code"].update(src=e["code"]["src"].replace("):", ", _x=print()):", 1)), "defaults"),
    (lambda e: e["code"].update(src=e["code"]["src"].replace("):\n", "):\n    torch.x += 1\n", 1)),
     "a AugAssign statement"),
    (lambda e: e["code"]["globals"].update(f=["builtin", "open"]), "builtin open is not on the graph cache's"),
    (lambda e: e["guards"]["guards"].append(["call", "os", "system", [["int", 1]]]),
     "os.system is not on the graph cache's allow-list"),
])
def test_decoder_allow_list(llama_entry, edit, message):
    from fxparallel.graph_cache import codec

    entry = json.loads(llama_entry)
    codec.decode(json.loads(llama_entry))  # as stored: decodes
    edit(entry)
    with pytest.raises(ValueError, match=message):
        codec.decode(entry)


def test_every_cached_graph_passes_the_code_check(cache_dir):  # noqa: F811
    """The code check accepts what fxparallel generates (GPT-2's fused projections, sequence parallelism,
    Mixtral's in-place router division ``x /= s`` and, the planner comparing its two expert forms, both its plans:
    experts split inside and whole per rank; Falcon's ``weight.T`` through getattr): a false refusal would
    silently turn every launch into a cache miss."""
    from transformers import FalconConfig, GPT2Config, MixtralConfig

    from fxparallel import graph_cache
    from models import TINY, tiny_config

    for config, kwargs in [(tiny_config("qwen3"), {"sequence_parallel": True}),
                           (GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=128, n_positions=64), {}),
                           (MixtralConfig(**TINY, num_local_experts=4, num_experts_per_tok=2), {}),
                           (FalconConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, vocab_size=128),
                            {})]:
        _plan(config, **kwargs)
        hits = graph_cache.stats["hits"]
        _plan(config, **kwargs)
        assert graph_cache.stats["hits"] == hits + (2 if config.model_type == "mixtral" else 1), config.model_type
    assert len(glob.glob(str(cache_dir / "*" / "*.json"))) == 5
