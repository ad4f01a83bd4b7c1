"""Selective activation checkpointing keeps the tensor-parallel all-reduces' outputs (with sequence
parallelism: its all-gathers and reduce-scatters): its recomputation runs no collective.

Two gloo ranks, tp=2, a tiny Llama (3 layers), one training step (SGD with lr 0) per mode: no
checkpointing, full, selective. A ``TorchDispatchMode`` around the step counts the all-reduces that
reach the dispatcher (the in-place ``c10d.allreduce_`` of ``dist.all_reduce`` and the functional
``_c10d_functional.all_reduce`` used inside a selective region; a recomputation served from the
selective cache dispatches nothing below it). Selective issues exactly the all-reduces of the step
without checkpointing, full issues a layer's forward all-reduces again, and the loss and every
gradient equal the step without checkpointing bit for bit. The same with sequence parallelism, counting
its gathers and reduce-scatters too.
"""
from __future__ import annotations

import pytest
import torch

from checks import as_numpy, full_values
from distributed import run_ranks
from models import save_checkpoint, tiny_config

LAYERS, GLOBAL_BATCH, SEQ = 3, 2, 16
MODES = (None, "full", "selective")


def _counting_mode(group_name: str):
    """Records the all-reduces over the group ``group_name`` (not the step's label count over dp x cp)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from torch.distributed import ProcessGroup

    where = {"c10d.allreduce_.default": lambda args: ProcessGroup.unbox(args[1]).group_name,  # (tensors, group, ...)
             "_c10d_functional.all_reduce.default": lambda args: args[2],  # (tensor, op, group name)
             # sequence parallelism's: (output, input, group, ...) in place; (input, [op,] size, group name)
             "c10d._allgather_base_.default": lambda args: ProcessGroup.unbox(args[2]).group_name,
             "c10d._reduce_scatter_base_.default": lambda args: ProcessGroup.unbox(args[2]).group_name,
             "_c10d_functional.all_gather_into_tensor.default": lambda args: args[2],
             "_c10d_functional.reduce_scatter_tensor.default": lambda args: args[3]}

    class CountAllReduces(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if str(func) in where and where[str(func)](args) == group_name:
                self.ops.append(str(func))
            return func(*args, **(kwargs or {}))

    return CountAllReduces()


def _steps(rank, world, path):
    import fxparallel
    from fxparallel.runtime import StepBatches, init_mesh, pack_tokens, synthetic_token_stream, train_step

    mesh = init_mesh(dp=1, tp=2, cp=1)
    rows = pack_tokens(synthetic_token_stream(128, 4 * SEQ, seed=3, mean_doc_len=10), SEQ)
    batch = StepBatches(rows, GLOBAL_BATCH, mesh.dp_rank, mesh.dp).batch(0)
    out = {}
    for sequence_parallel in (False, True):
        model = fxparallel.parallelize(path, mesh.tp_mesh, dtype=torch.float32,
                                       sequence_parallel=sequence_parallel).train()
        if not sequence_parallel:
            out["planned"] = model.plan.count("all_reduce", "forward") + model.plan.count("all_reduce", "backward")
        for mode in MODES:
            if mode is None:
                model.gradient_checkpointing_disable()
            else:
                model.gradient_checkpointing_enable({"use_reentrant": False}, mode=mode)
            optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
            with _counting_mode(mesh.tp_mesh.get_group().group_name) as counted:
                loss = train_step(model, optimizer, batch, mesh).loss
            key = ("sp", mode) if sequence_parallel else mode
            out[key] = (loss, counted.ops, as_numpy(full_values(model, mesh, lambda p: p.grad)))
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    path = save_checkpoint(tiny_config("llama", num_hidden_layers=LAYERS),
                           str(tmp_path_factory.mktemp("sac") / "llama"))
    return run_ranks(2, _steps, path, timeout=600)


def test_selective_runs_the_all_reduces_of_a_step_without_checkpointing(results):
    for out in results:
        plain, full, selective = (len(out[mode][1]) for mode in MODES)
        # the plan's (2L+1 forward, 2L+1 backward) and train_step's gradient norm (over the world: tp here)
        assert plain == out["planned"] + 1 == 2 * (2 * LAYERS + 1) + 1, (plain, out["planned"])
        assert selective == plain, (plain, selective)
        # full runs forward all-reduces of the layers again (3 here: checkpoint's early stop spares those whose
        # output only the residual add that ends a layer reads, and the last one falls outside the last layer)
        assert plain < full <= plain + 2 * LAYERS, (plain, full)


def test_selective_all_reduces_are_the_functional_op_only_inside_the_layers(results):
    plain_ops, selective_ops = results[0][None][1], results[0]["selective"][1]
    assert set(plain_ops) == {"c10d.allreduce_.default"}
    functional = selective_ops.count("_c10d_functional.all_reduce.default")
    assert 0 < functional <= 2 * LAYERS, selective_ops  # the layers' forward ones; the rest stay in place


def test_selective_with_sequence_parallelism_runs_the_collectives_of_a_step_without_checkpointing(results):
    for out in results:
        plain, full, selective = (out[("sp", mode)][1] for mode in MODES)
        sequence = [op for op in plain if "gather" in op or "reduce_scatter" in op]
        assert len(sequence) >= 4 * LAYERS, plain  # two gathers and two reduce-scatters per layer, at least
        assert len(selective) == len(plain) and len(full) > len(plain), (plain, selective, full)
        kept = [op for op in selective if op.startswith("_c10d_functional.") and "all_reduce" not in op]
        assert kept, selective  # the layers' gathers and reduce-scatters ran as the functional ops the policy keeps


@pytest.mark.parametrize("mode", ["full", "selective", ("sp", "full"), ("sp", "selective")])
def test_gradients_are_bit_identical(results, mode):
    for out in results:
        loss, _, grads = out[("sp", None) if isinstance(mode, tuple) else None]
        other_loss, _, other = out[mode]
        assert other_loss == loss, (mode, other_loss, loss)
        assert set(other) == set(grads)
        for name, g in grads.items():
            assert (other[name] == g).all(), f"{mode}: gradient of {name} differs by {abs(other[name] - g).max()}"
