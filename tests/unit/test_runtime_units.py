"""Runtime pieces that need no process group: mesh sizes, loss token counting, data packing and
per-dp-rank batches, the lazy `datasets` path, and the refusal of context parallelism."""
from __future__ import annotations

import sys
import types

import pytest
import torch

from fxparallel.errors import GroupError
from fxparallel.runtime import StepBatches, dataset_token_stream, label_tokens, pack_tokens, synthetic_token_stream
from fxparallel.runtime.mesh import resolve_sizes, world_size_error


# ---- mesh sizes --------------------------------------------------------------------------
@pytest.fixture
def no_size_env(monkeypatch):
    for name in ("TP_SIZE", "DP_SIZE", "CP_SIZE"):
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


def test_world_size_error_message(no_size_env):
    assert world_size_error(4, 2, 2, 1) is None
    with pytest.raises(GroupError, match=r"^World size \(3\) must equal TP size \(2\) \* DP size \(2\) \* CP size \(1\)$"):
        resolve_sizes(3, tp=2, dp=2, cp=1)


def test_sizes_from_environment_and_arguments(no_size_env):
    no_size_env.setenv("TP_SIZE", "2")
    no_size_env.setenv("DP_SIZE", "2")
    no_size_env.setenv("CP_SIZE", "1")
    assert resolve_sizes(4) == (2, 2, 1)  # (dp, tp, cp)
    assert resolve_sizes(4, tp=4, dp=1) == (1, 4, 1)  # arguments override the environment
    with pytest.raises(GroupError, match=r"World size \(8\) must equal TP size \(2\) \* DP size \(2\) \* CP size \(1\)"):
        resolve_sizes(8)
    no_size_env.setenv("TP_SIZE", "two")
    with pytest.raises(GroupError, match="TP_SIZE='two' is not an integer"):
        resolve_sizes(4)


def test_dp_fills_the_world_when_unset(no_size_env):
    assert resolve_sizes(8, tp=2) == (4, 2, 1)
    assert resolve_sizes(4) == (4, 1, 1)
    with pytest.raises(GroupError, match="must be >= 1"):
        resolve_sizes(4, tp=0)


# ---- loss token counting -------------------------------------------------------------------
def test_label_tokens_count_shifted_labels():
    labels = torch.tensor([[5, 6, -100, 7], [-100, -100, -100, 8]])
    # the loss predicts labels[:, 1:] (the first label of a row is never a target)
    assert int(label_tokens(labels)) == 2 + 1


# ---- data ----------------------------------------------------------------------------------
def test_synthetic_stream_is_deterministic_and_in_vocabulary():
    a = synthetic_token_stream(128, 1000, seed=1)
    assert torch.equal(a, synthetic_token_stream(128, 1000, seed=1))
    assert not torch.equal(a, synthetic_token_stream(128, 1000, seed=2))
    assert a.numel() == 1000 and a.dtype == torch.long
    assert int(a.min()) >= 0 and int(a.max()) <= 127
    assert int((a == 127).sum()) > 5  # documents end with EOS (the last id by default)


def test_pack_tokens_rows_and_tail():
    rows = pack_tokens(torch.arange(23), 5)
    assert rows.shape == (4, 5)
    assert torch.equal(rows[1], torch.arange(5, 10))  # consecutive, unshifted
    with pytest.raises(ValueError, match="seq_len must be >= 2"):
        pack_tokens(torch.arange(10), 1)
    with pytest.raises(ValueError, match="fewer than one row"):
        pack_tokens(torch.arange(3), 5)


def test_step_batches_split_the_global_batch_over_dp():
    rows = pack_tokens(torch.arange(40 * 4), 4)  # 40 rows
    per_rank = [StepBatches(rows, 8, d, 4, seed=3) for d in range(4)]
    for step in (0, 1, 7):
        parts = [b.indices(step) for b in per_rank]
        assert all(len(p) == 2 for p in parts)
        assert torch.equal(torch.cat(parts), per_rank[0].global_indices(step))  # dp ranks in order = global batch
        batch = per_rank[1].batch(step)
        assert torch.equal(batch["labels"], batch["input_ids"])  # HF convention: the loss shifts
        assert torch.equal(batch["input_ids"], rows[parts[1]])
    # one epoch (5 steps of 8 rows) sees every row once; the next epoch reorders
    epoch = torch.cat([per_rank[0].global_indices(s) for s in range(5)])
    assert sorted(epoch.tolist()) == list(range(40))
    assert not torch.equal(per_rank[0].global_indices(0), per_rank[0].global_indices(5))
    # a resumed job gets the same batch for a step without replaying the earlier ones
    assert torch.equal(StepBatches(rows, 8, 2, 4, seed=3).batch(6)["input_ids"], per_rank[2].batch(6)["input_ids"])


def test_step_batches_errors():
    rows = pack_tokens(torch.arange(40), 4)
    with pytest.raises(ValueError, match="global batch 6 does not divide by the dp size 4"):
        StepBatches(rows, 6, 0, 4)
    with pytest.raises(ValueError, match="larger than the dataset"):
        StepBatches(rows, 16, 0, 4)


def test_dataset_path_is_lazy_and_optional(monkeypatch):
    monkeypatch.setitem(sys.modules, "datasets", None)  # as if not installed
    with pytest.raises(ImportError, match="pip install datasets"):
        dataset_token_stream("some/dataset", tokenizer=None)

    fake = types.ModuleType("datasets")
    fake.load_dataset = lambda name, config, split, streaming: iter([{"text": "ab"}, {"text": "cde"}, {"text": "f"}])
    monkeypatch.setitem(sys.modules, "datasets", fake)

    class Tokenizer:
        eos_token_id = 0

        def __call__(self, text, add_special_tokens):
            return {"input_ids": [ord(c) - 96 for c in text]}

    stream = dataset_token_stream("fake", Tokenizer(), max_tokens=100)
    assert stream.tolist() == [1, 2, 0, 3, 4, 5, 0, 6, 0]  # documents joined by EOS
    assert dataset_token_stream("fake", Tokenizer(), max_tokens=4).tolist() == [1, 2, 0, 3]
    with pytest.raises(KeyError, match="no field 'content'"):
        dataset_token_stream("fake", Tokenizer(), text_field="content")


# ---- context parallelism needs a model parallelized over the mesh's cp group ------------------
def test_context_parallel_needs_a_cp_model():
    from fxparallel.runtime import check_context_parallel

    mesh = types.SimpleNamespace(cp=2)
    with pytest.raises(ValueError, match=r"the mesh has CP_SIZE=2 but the model was parallelized for context-parallel "
                                         r"size 1"):
        check_context_parallel(object(), mesh)
    check_context_parallel(types.SimpleNamespace(cp_size=2), mesh)
    check_context_parallel(object(), types.SimpleNamespace(cp=1))


def test_mixed_precision_needs_a_graph_captured_in_bf16():
    from fxparallel.runtime import apply_data_parallel

    model = types.SimpleNamespace(dtype_=torch.float32)
    mesh = types.SimpleNamespace(cp=1)
    with pytest.raises(ValueError, match=r"parallelized with dtype=torch.float32: call fxparallel.parallelize\(\.\.\., "
                                         r"dtype=torch.bfloat16\)"):
        apply_data_parallel(model, mesh, mixed_precision="bf16")
    with pytest.raises(ValueError, match="data parallel mode must be one of"):
        apply_data_parallel(model, mesh, mode="ddp")


def test_train_3d_refuses_a_sequence_cp_cannot_split_before_starting(monkeypatch, capsys):
    from checks import load_example

    example = load_example("train_3d", "train_3d_cli")
    monkeypatch.setenv("CP_SIZE", "2")
    with pytest.raises(SystemExit) as exit_info:
        example.main(["--steps", "1", "--seq-len", "30"])
    assert exit_info.value.code == 2
    assert "--seq-len 30 must divide by 2 * CP_SIZE = 4" in capsys.readouterr().err
