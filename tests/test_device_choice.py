"""The device of each rank and the tensors of its collectives, as a first multi-GPU run needs them (CPU only):

* the CUDA device follows LOCAL_RANK (else a launcher's local rank, else the global rank) modulo the visible
  devices and is made current with ``torch.cuda.set_device``, whatever was current before; ``device=`` and a
  device bound to the group are kept (``group.choose_device``, with CUDA mocked);
* a group's backend is recognised from torch's description of it: "nccl", "cpu:gloo,cuda:nccl" (torchtitan's and
  vLLM's), a default-initialized group ("undefined": torch records "cuda:nccl" on a GPU machine, "cpu:gloo"
  here) run on CUDA over NCCL where CUDA is there; "gloo" on the CPU; "cuda:gloo" on CUDA with ranks free to
  share a device;
* two ranks of one host on one CUDA device of an NCCL group are refused on every rank, naming both and the
  device (the pure check, and its exchange at parallelize's agreement point on 2 real ranks);
* every collective of ``generate`` (and of a forward call's argument check) gets tensors on the model's device:
  recorded on 2 gloo ranks, and every tensor factory in a function that calls a collective passes ``device=``
  (checked in the source, which is what makes NCCL work: NCCL takes no CPU tensors).
"""
from __future__ import annotations

import ast
import json
import logging
import os
import pathlib
import subprocess
import sys
import textwrap

import pytest
import torch

from distributed import run_ranks
from fxparallel import group as groups
from fxparallel.errors import GroupError
from fxparallel.group import (TPGroup, choose_device, cuda_index, device_backends, device_type_of, local_rank_from,
                              process_group_backends, shared_devices, uses_nccl)

ROOT = pathlib.Path(__file__).resolve().parents[1]


# ---- backend recognition ---------------------------------------------------------------------------

@pytest.mark.parametrize("description, accelerator, expected", [
    ("nccl", None, ("cuda", True)),
    ("cpu:gloo,cuda:nccl", None, ("cuda", True)),  # torchtitan's and vLLM's form
    ("cuda:nccl,cpu:gloo", None, ("cuda", True)),
    ("cuda:nccl", None, ("cuda", True)),  # what torch records for init_process_group() on a GPU machine
    ("undefined", "cuda", ("cuda", True)),  # init_process_group() without a backend, by torch's default
    ("", "cuda", ("cuda", True)),
    ("undefined", None, ("cpu", False)),
    ("cpu:gloo", None, ("cpu", False)),  # init_process_group() on a CPU machine
    ("gloo", None, ("cpu", False)),
    ("cpu:gloo,cuda:gloo", None, ("cpu", False)),  # what torch records for "gloo"
    ("cuda:gloo", None, ("cuda", False)),  # CUDA tensors only over gloo: ranks may share one GPU
    ("GLOO", None, ("cpu", False)),
    ("mpi", None, ("cpu", False)),
])
def test_backend_description_maps_to_device_type(description, accelerator, expected):
    assert device_type_of(device_backends(description, accelerator)) == expected


def test_backend_descriptions_parse_to_device_maps():
    assert device_backends("cpu:gloo,cuda:nccl") == {"cpu": "gloo", "cuda": "nccl"}
    assert device_backends("nccl") == {"cuda": "nccl"}
    assert device_backends("gloo") == {"cpu": "gloo", "cuda": "gloo"}
    assert device_backends("undefined", "cuda") == {"cuda": "nccl"}


class ProcessGroupNCCL:  # named as torch's backend classes: process_group_backends reads the class name
    pass


class ProcessGroupGloo:
    pass


class FakeProcessGroup:
    """Answers what torch's ProcessGroup answers about its backends (``_device_types``, ``_get_backend``), and
    nothing else: torch has no config recorded for it, so ``process_group_backends`` asks the group itself."""

    def __init__(self, backends: dict, bound=None):
        self.backends, self.bound_device_id = backends, bound

    @property
    def _device_types(self):
        return [torch.device(d) for d in self.backends]

    def _get_backend(self, device):
        if device.type not in self.backends:
            raise RuntimeError(f"No backend type associated with device type {device.type}")
        return self.backends[device.type]()


def test_process_group_backends_asks_the_group_when_torch_has_no_config():
    both = FakeProcessGroup({"cpu": ProcessGroupGloo, "cuda": ProcessGroupNCCL})
    assert process_group_backends(both) == {"cpu": "gloo", "cuda": "nccl"}
    assert uses_nccl(TPGroup(both, 0, 2, -1))
    assert not uses_nccl(TPGroup(FakeProcessGroup({"cuda": ProcessGroupGloo}), 0, 2, -1))
    assert not uses_nccl(TPGroup(None, 0, 2, -1))


_REAL_GROUPS = textwrap.dedent("""
    import json, torch, torch.distributed as dist
    from fxparallel.group import TPGroup, choose_device, device_type_of, process_group_backends
    dist.init_process_group(store=dist.HashStore(), rank=0, world_size=1)  # no backend: "undefined"
    out = {"get_backend": str(dist.get_backend())}
    groups = {"default": dist.group.WORLD, "gloo": dist.new_group([0], backend="gloo"),
              "cuda:gloo": dist.new_group([0], backend="cuda:gloo")}
    for name, pg in groups.items():
        out[name] = [process_group_backends(pg), list(device_type_of(process_group_backends(pg)))]
    out["device of default"] = str(choose_device(TPGroup(dist.group.WORLD, 0, 1, -1)))
    dist.destroy_process_group()
    print(json.dumps(out))
""")


def test_real_groups_of_torch_are_recognised():
    """Groups torch creates here (CPU build): a default-initialized one ("undefined"), "gloo", "cuda:gloo"."""
    env = dict(os.environ, PYTHONPATH=str(ROOT), CUDA_VISIBLE_DEVICES="")
    done = subprocess.run([sys.executable, "-c", _REAL_GROUPS], capture_output=True, text=True, env=env, timeout=300,
                          cwd=str(ROOT))
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert out["get_backend"] == "undefined"  # what the old check compared with "nccl"
    assert out["default"] == [{"cpu": "gloo"}, ["cpu", False]]
    assert out["gloo"][1] == ["cpu", False]
    assert out["cuda:gloo"] == [{"cuda": "gloo"}, ["cuda", False]]
    assert out["device of default"] == "cpu"


# ---- the CUDA device of a rank ---------------------------------------------------------------------

def test_local_rank_from_launchers():
    assert local_rank_from({"LOCAL_RANK": "3", "SLURM_LOCALID": "1"}) == (3, "LOCAL_RANK")
    assert local_rank_from({"OMPI_COMM_WORLD_LOCAL_RANK": "2"}) == (2, "OMPI_COMM_WORLD_LOCAL_RANK")
    assert local_rank_from({"SLURM_LOCALID": "1"}) == (1, "SLURM_LOCALID")
    assert local_rank_from({"LOCAL_RANK": ""}) == (None, None)
    assert local_rank_from({}) == (None, None)


def test_cuda_index_follows_local_rank_modulo_devices():
    assert cuda_index(8, {"LOCAL_RANK": "5"}, rank=13)[0] == 5
    assert cuda_index(1, {"LOCAL_RANK": "3"}, rank=3)[0] == 0  # one device shown per process
    assert cuda_index(4, {"LOCAL_RANK": "6"}, rank=6)[0] == 2
    assert cuda_index(4, {}, rank=6)[0] == 2  # no launcher: the global rank
    assert cuda_index(4, {"LOCAL_RANK": "1"}, rank=1, bound=3)[0] == 3  # init_process_group(device_id=...)
    with pytest.raises(GroupError, match="no CUDA device"):
        cuda_index(0, {"LOCAL_RANK": "0"}, rank=0)


@pytest.fixture
def fake_cuda(monkeypatch):
    """CUDA as a 4-GPU machine shows it; records set_device."""
    calls = {"set_device": [], "current": 0, "initialized": False}
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: calls["set_device"].append(torch.device("cuda", d).index
                                                                                       if isinstance(d, int) else
                                                                                       torch.device(d).index))
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: calls["initialized"])
    monkeypatch.setattr(torch.cuda, "current_device", lambda: calls["current"])
    for name in groups.LOCAL_RANK_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    return calls


NCCL = {"cpu": ProcessGroupGloo, "cuda": ProcessGroupNCCL}


def _group(backends, rank=0, size=2, bound=None):
    return TPGroup(FakeProcessGroup(backends, bound), rank, size, -1)


def test_nccl_rank_goes_to_local_rank_and_sets_it(fake_cuda, monkeypatch, caplog):
    monkeypatch.setenv("LOCAL_RANK", "3")
    fake_cuda["initialized"] = True  # the user (or a library) touched CUDA: cuda:0 is current on every rank
    with caplog.at_level(logging.INFO, logger="fxparallel"):
        device = choose_device(_group(NCCL, rank=1))
    assert device == torch.device("cuda", 3)
    assert fake_cuda["set_device"] == [3]
    assert "cuda:3" in caplog.text and "LOCAL_RANK=3" in caplog.text


def test_nccl_rank_without_local_rank_uses_the_global_rank(fake_cuda):
    assert choose_device(_group({"cuda": ProcessGroupNCCL}, rank=1)) == torch.device("cuda", 1)
    assert fake_cuda["set_device"] == [1]
    fake_cuda["set_device"].clear()
    assert choose_device(_group({"cuda": ProcessGroupNCCL}, rank=6, size=8)) == torch.device("cuda", 2)  # 6 mod 4


def test_launcher_local_rank_is_used_without_local_rank(fake_cuda, monkeypatch):
    monkeypatch.setenv("SLURM_LOCALID", "2")
    assert choose_device(_group(NCCL, rank=5, size=8)) == torch.device("cuda", 2)


def test_device_bound_to_the_group_is_kept(fake_cuda, monkeypatch):
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert choose_device(_group(NCCL, bound=torch.device("cuda", 2))) == torch.device("cuda", 2)
    assert fake_cuda["set_device"] == [2]


def test_explicit_device_is_respected(fake_cuda, monkeypatch):
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert choose_device(_group(NCCL), "cuda:2") == torch.device("cuda", 2)
    assert fake_cuda["set_device"] == [2]
    assert choose_device(_group(NCCL), "cuda") == torch.device("cuda", 1)  # no index: this rank's
    assert choose_device(_group(NCCL), torch.device("cpu")) == torch.device("cpu")
    assert fake_cuda["set_device"] == [2, 1]


def test_gloo_stays_on_cpu_and_cuda_gloo_goes_to_cuda(fake_cuda, monkeypatch):
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert choose_device(_group({"cpu": ProcessGroupGloo, "cuda": ProcessGroupGloo})) == torch.device("cpu")
    assert fake_cuda["set_device"] == []
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)  # 2 ranks on one GPU over gloo: intended
    assert choose_device(_group({"cuda": ProcessGroupGloo}, rank=1)) == torch.device("cuda", 0)
    assert fake_cuda["set_device"] == [0]


def test_cuda_group_without_cuda_is_an_error(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(GroupError, match="cpu:gloo,cuda:nccl.*no CUDA device is visible"):
        choose_device(_group(NCCL))


# ---- ranks sharing a CUDA device ---------------------------------------------------------------------

def test_shared_device_is_named():
    message = shared_devices([["node-a", 0], ["node-a", 0]])
    assert message.startswith("ranks 0 and 1 of tp_group are all on cuda:0 of host 'node-a'")
    assert "NCCL" in message and "cuda:gloo" in message
    message = shared_devices([("h", 1), ("h", 2), ("h", 1), ("h", 2)], global_ranks=[4, 5, 6, 7], name="cp_group")
    assert "ranks 0 (global rank 4) and 2 (global rank 6) of cp_group are all on cuda:1 of host 'h'" in message
    assert "ranks 1 (global rank 5) and 3 (global rank 7) of cp_group are all on cuda:2" in message
    assert shared_devices([["a", 0], ["b", 0]]) is None  # two hosts
    assert shared_devices([["h", 0], ["h", 1]]) is None
    assert shared_devices([["h", None], ["h", None]]) is None  # not on CUDA (device="cpu")


def _shared_device_exchange(rank, world):
    import torch.distributed as dist

    import fxparallel.api as api
    from fxparallel.errors import GroupError
    from fxparallel.group import resolve_tp_group

    sent = []
    real_exchange = api.exchange

    def json_exchange(group, value, what, step=None):  # the values must survive JSON (coordinate.py's next codec)
        sent.append(value)
        return real_exchange(group, json.loads(json.dumps(value)), what, step=step)

    api.exchange, api.uses_nccl = json_exchange, lambda g: True  # an NCCL group as the check sees it
    group = resolve_tp_group(dist.group.WORLD)
    out = {}
    api.choose_device = lambda g, d: torch.device("cuda", rank)  # one device each: accepted
    out["distinct"] = str(api._choose_device(group, None))
    api.choose_device = lambda g, d: torch.device("cuda", 0)  # both on cuda:0: refused on every rank
    try:
        api._choose_device(group, None)
        out["shared"] = "no error"
    except GroupError as err:
        out["shared"] = str(err)
    out["sent"] = sent
    return out


def test_shared_device_is_refused_on_every_rank_of_an_nccl_group():
    for rank, out in enumerate(run_ranks(2, _shared_device_exchange)):
        assert out["distinct"] == f"cuda:{rank}"
        assert out["shared"].startswith("ranks 0 and 1 of tp_group are all on cuda:0 of host "), out["shared"]
        assert [entry[1] for entry in out["sent"]] == [rank, 0]


# ---- the tensors of the collectives ------------------------------------------------------------------

COLLECTIVES = ("all_gather", "all_gather_into_tensor", "all_gather_single", "all_reduce", "broadcast",
               "reduce_scatter", "reduce_scatter_tensor", "reduce_scatter_single", "all_to_all_single", "all_to_all",
               "reduce", "gather", "scatter")
FACTORIES = ("tensor", "as_tensor", "randint", "rand", "randn", "randperm", "empty", "zeros", "ones", "full",
             "arange")


def _generate_collectives(rank, world, path):
    import torch.distributed as dist

    import fxparallel

    model = fxparallel.parallelize(path, dist.group.WORLD, dtype=torch.float32)
    seen, originals = [], {name: getattr(dist, name) for name in COLLECTIVES if hasattr(dist, name)}

    def recording(name, collective):
        def call(*args, **kwargs):
            tensors = [a for a in args if isinstance(a, torch.Tensor)]
            tensors += [t for a in args if isinstance(a, (list, tuple)) for t in a if isinstance(t, torch.Tensor)]
            seen.append((name, sorted({str(t.device) for t in tensors}), [str(t.dtype) for t in tensors[:1]],
                         [list(t.shape) for t in tensors[:1]]))
            return collective(*args, **kwargs)
        return call

    for name, collective in originals.items():
        setattr(dist, name, recording(name, collective))
    ids = torch.randint(1, 100, (2, 5), generator=torch.Generator().manual_seed(0))
    try:
        model(input_ids=ids)  # the argument check's fingerprint
        tokens = [model.generate(input_ids=ids, max_new_tokens=3, do_sample=False, pad_token_id=0),
                  model.generate(input_ids=ids, max_new_tokens=3, do_sample=True, top_k=5, pad_token_id=0),
                  model.generate(input_ids=ids, max_new_tokens=3, do_sample=True, top_k=0, repetition_penalty=1.3,
                                 pad_token_id=0)]
    finally:
        for name, collective in originals.items():
            setattr(dist, name, collective)
    return {"device": str(model.device_), "seen": seen, "tokens": [t.tolist() for t in tokens]}


def test_generate_collectives_run_on_the_model_device(checkpoints):
    from fxparallel.inputs import FIELDS

    results = run_ranks(2, _generate_collectives, checkpoints["llama"])
    for out in results:
        assert out["seen"]
        wrong = [s for s in out["seen"] if s[1] != [out["device"]]]
        assert not wrong, wrong
        names = {s[0] for s in out["seen"]}
        assert {"all_gather", "all_reduce", "broadcast"} <= names  # greedy choice / check, layers, sampling seed
        # generate's arguments are compared through the store (load/coordinate.py), each call's through a collective
        assert ["all_gather", [out["device"]], ["torch.int64"], [[FIELDS]]] in [list(s) for s in out["seen"]]
    assert results[0]["tokens"] == results[1]["tokens"]  # sampling draws alike on both ranks


def _factories_without_device(source: str) -> list:
    """(function, line) of every torch tensor factory without ``device=`` in a function that calls a
    torch.distributed tensor collective (``dist.<collective>``)."""
    def called(node, base, names):
        return (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                and isinstance(node.func.value, ast.Name) and node.func.value.id == base and node.func.attr in names)

    found = []
    for fn in ast.walk(ast.parse(source)):
        if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            calls = [n for n in ast.walk(fn) if isinstance(n, ast.Call)]
            if any(called(c, "dist", COLLECTIVES) for c in calls):
                found += [(fn.name, c.lineno) for c in calls
                          if called(c, "torch", FACTORIES) and not any(k.arg == "device" for k in c.keywords)]
    return found


def test_no_collective_gets_a_tensor_made_on_a_fixed_device():
    """Every tensor made next to a collective is made on a device given to it (the model's, the mesh's, its
    input's), never on the CPU by default: NCCL refuses CPU tensors. Over all of fxparallel; and the whole of
    the generation and argument-check modules, whose factories all feed collectives."""
    bad = []
    for path in sorted((ROOT / "fxparallel").rglob("*.py")):
        bad += [(str(path.relative_to(ROOT)), *where) for where in _factories_without_device(path.read_text())]
    assert not bad, bad
    for name in ("generation/loop.py", "generation/select.py", "inputs.py"):
        tree = ast.parse((ROOT / "fxparallel" / name).read_text())
        for node in ast.walk(tree):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and isinstance(node.func.value,
                ast.Name) and node.func.value.id == "torch" and node.func.attr in FACTORIES):
                assert any(k.arg == "device" for k in node.keywords), f"{name}:{node.lineno}"
    # the check finds what generate did before (a CPU digest and seed)
    before = ("def f(group, text):\n    digest = torch.tensor(list(text), dtype=torch.int64)\n"
              "    dist.all_gather([digest], digest, group=group)\n")
    assert _factories_without_device(before) == [("f", 2)]
