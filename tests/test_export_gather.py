"""An export gathers every full tensor on the writer alone (``runtime/export.py``), on 4 real gloo ranks.

Two exports of freshly parallelized models, so the written tensors must equal the source checkpoint's:

* dp=2 x tp=2 under FSDP (``export_pretrained``): FSDP's chunks are gathered over dp to the writer's tp
  group, the tp shards to the writer (global rank 0);
* plain tp=2 on both tp groups of the mesh, a Phi-3 whose fused qkv / gate_up weights are segmented and
  uneven (``save_pretrained`` with transformers' ``is_main_process``: True on global rank 0 alone): the
  writer's group gathers, the other group (no writer) gathers nothing.

Each parameter's gather is recorded under a dispatch mode: the largest tensor any op makes or any
collective fills or sends on the rank (a DTensor counted by its local piece). No rank but the writer
ever holds as many elements as a full tensor it does not already hold (a sharded parameter).
"""
from __future__ import annotations

import math
import os

import pytest
import torch

from distributed import run_ranks

# 9 query heads in 3 kv groups, MLP width 100, vocabulary 1001: uneven at tp=2 (as tests/test_uneven.py)
UNEVEN = dict(hidden_size=72, num_attention_heads=9, num_key_value_heads=3, intermediate_size=100, vocab_size=1001)


class _Largest(torch.utils._python_dispatch.TorchDispatchMode):
    """The most elements of one tensor made by an op, or filled or sent by a collective, while active."""

    def __init__(self):
        super().__init__()
        self.numel = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        seen = [out] + (list(args) if func.namespace in ("c10d", "_c10d_functional") else [])
        for t in torch.utils._pytree.tree_leaves(seen):
            if isinstance(t, torch.Tensor):
                self.numel = max(self.numel, _local_numel(t))
        return out


def _local_numel(t) -> int:
    from torch.distributed.tensor import DTensor

    return t._local_tensor.numel() if isinstance(t, DTensor) else t.numel()


def _recording(log: list):
    """``export._full_on_writer`` that appends (name, largest tensor seen, full numel, local numel, returned)."""
    from fxparallel.runtime import export

    gather = export._full_on_writer

    def recorded(param, plan, tp_mesh, route):
        with _Largest() as seen:
            full = gather(param, plan, tp_mesh, route)
        log.append((plan.name, seen.numel, math.prod(plan.shape), _local_numel(param), full is not None))
        return full

    return recorded


def _exports(rank, world, paths, root):
    import fxparallel
    from fxparallel.runtime import apply_data_parallel, export, export_pretrained, init_mesh

    mesh = init_mesh(tp=2, dp=2)
    out = {}
    logs = {"fsdp": [], "tp": []}
    original = export._full_on_writer
    try:
        export._full_on_writer = _recording(logs["fsdp"])
        model = apply_data_parallel(fxparallel.parallelize(paths["llama"], mesh.tp_mesh, dtype=torch.float32), mesh)
        export_pretrained(model, mesh, os.path.join(root, "fsdp"))
        export._full_on_writer = _recording(logs["tp"])
        model = fxparallel.parallelize(paths["phi3"], mesh.tp_mesh, dtype=torch.float32)
        model.save_pretrained(os.path.join(root, "tp"), is_main_process=rank == 0)
    finally:
        export._full_on_writer = original
    out["logs"] = logs
    return out


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    from transformers import Phi3Config

    from models import save_checkpoint, tiny_config

    root = tmp_path_factory.mktemp("export_gather")
    paths = {"llama": save_checkpoint(tiny_config("llama"), str(root / "llama")),
             "phi3": save_checkpoint(Phi3Config(num_hidden_layers=2, max_position_embeddings=64, pad_token_id=0,
                                                eos_token_id=1, bos_token_id=1, **UNEVEN), str(root / "phi3"))}
    results = run_ranks(4, _exports, paths, str(root / "out"), timeout=600)
    return paths, str(root / "out"), [r["logs"] for r in results]


def _tensors(directory: str) -> dict:
    from safetensors.torch import load_file

    out = {}
    for name in sorted(os.listdir(directory)):
        if name.endswith(".safetensors"):
            out.update(load_file(os.path.join(directory, name)))
    return out


@pytest.mark.parametrize("kind, source", [("fsdp", "llama"), ("tp", "phi3")])
def test_export_writes_the_source_tensors(exported, kind, source):
    paths, out, _ = exported
    written, expected = _tensors(os.path.join(out, kind)), _tensors(paths[source])
    assert written.keys() == expected.keys()
    for name, tensor in expected.items():
        assert torch.equal(written[name], tensor), name


@pytest.mark.parametrize("kind", ["fsdp", "tp"])
def test_only_the_writer_holds_full_tensors(exported, kind):
    _, _, logs = exported
    writer = logs[0][kind]
    assert writer and all(returned for *_, returned in writer)
    for name, seen, full, local, _ in writer:
        assert seen >= full, (name, seen, full)  # the recording sees what the writer receives
    for rank in (1, 2, 3):
        for name, seen, full, local, returned in logs[rank][kind]:
            assert not returned, (rank, name)
            if local < full:  # a tensor this rank does not hold whole: it never sees as many elements
                assert seen < full, (kind, rank, name, seen, full)
    # plain tp: the tp group without a writer (ranks 2 and 3) gathers nothing at all
    if kind == "tp":
        assert logs[2][kind] == [] and logs[3][kind] == []
        assert any(local < full for _, _, full, local, _ in logs[1][kind])  # rank 1 sent its shards
