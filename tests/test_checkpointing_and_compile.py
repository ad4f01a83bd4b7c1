"""Activation checkpointing (``model.gradient_checkpointing_enable``) and ``torch.compile`` (whole model, and
per decoder layer with ``runtime.compile_layers``) on real gloo ranks, composed with per-layer FSDP units,
sequence parallelism and context parallelism.

One spawn of 4 ranks, two layouts of a tiny Qwen3 (3 layers), each one model trained one step at a time
(SGD with lr 0, so every step starts from the same parameters): dp=2 x tp=2 with sequence parallelism,
and tp=2 x cp=2. Steps, in order: no checkpointing, full, selective (the same loss and bit-identical
gradients of every parameter; the recomputation checked by counting matrix-product FLOPs: full adds the
layers' forward products, selective, which keeps them, adds none); ``torch.compile(model)``; then the
layers compiled with checkpointing on (loss and gradients within 1e-5 of the eager step). The compile
backend is ``aot_eager``: Dynamo and AOTAutograd are where composition can break (checkpointing regions,
collectives inside autograd functions, FSDP hooks), while inductor's code generation would add minutes of
C++ compilation per rank; ``benchmarks/compile.py`` runs inductor.
"""
from __future__ import annotations

import pytest
import torch

from checks import as_numpy, full_values
from distributed import run_ranks
from models import save_checkpoint, tiny_config

GLOBAL_BATCH, SEQ = 4, 16
TOL = 1e-5
MODES = (None, "full", "selective")
# name, mesh sizes, sequence parallel, checkpointing mode of the compiled layers
LAYOUTS = (("dp2 x tp2 + SP", dict(dp=2, tp=2, cp=1), True, "full"),
           ("tp2 x cp2", dict(dp=1, tp=2, cp=2), False, "selective"))


def _step(run, model, mesh, batch):
    """One step of the runtime (lr 0: parameters stay as they are); (loss, matmul FLOPs, gradients)."""
    from torch.utils.flop_counter import FlopCounterMode

    from fxparallel.runtime import train_step

    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    with FlopCounterMode(display=False) as flops:
        loss = train_step(run, optimizer, batch, mesh).loss
    return loss, flops.get_total_flops(), as_numpy(full_values(model, mesh, lambda p: p.grad))


def _layouts(rank, world, path):
    import fxparallel
    from fxparallel.runtime import (StepBatches, apply_data_parallel, compile_layers, init_mesh, pack_tokens,
                                    synthetic_token_stream)

    rows = pack_tokens(synthetic_token_stream(128, 8 * SEQ, seed=3, mean_doc_len=10), SEQ)
    out = {}
    for name, sizes, sp, compiled_mode in LAYOUTS:
        mesh = init_mesh(**sizes)
        model = fxparallel.parallelize(path, mesh.tp_mesh, dtype=torch.float32, cp_group=mesh.cp_mesh,
                                       sequence_parallel=sp).train()
        model = apply_data_parallel(model, mesh)
        batch = StepBatches(rows, GLOBAL_BATCH, mesh.dp_rank, mesh.dp).batch(0)
        runs = {}
        for mode in MODES:
            if mode is None:
                model.gradient_checkpointing_disable()
            else:
                model.gradient_checkpointing_enable({"use_reentrant": False}, mode=mode)
            assert model.is_gradient_checkpointing == (mode is not None)
            runs[mode] = _step(model, model, mesh, batch)
        model.gradient_checkpointing_disable()
        runs["compiled model"] = _step(torch.compile(model, backend="aot_eager"), model, mesh, batch)
        model.gradient_checkpointing_enable(mode=compiled_mode)
        compile_layers(model, backend="aot_eager")
        runs["compiled layers"] = _step(model, model, mesh, batch)
        if name == LAYOUTS[0][0]:
            out["errors"] = _errors(model)
        out[name] = runs if rank == 0 else None
    return out


def _errors(model) -> dict:
    errors = {}
    for key, kwargs in {"reentrant": ({"use_reentrant": True},), "unknown": ({"checkpoint_impl": 1},),
                        "mode": (None, "sometimes")}.items():
        try:
            model.gradient_checkpointing_enable(*kwargs[:1], **({"mode": kwargs[1]} if len(kwargs) > 1 else {}))
            errors[key] = None
        except ValueError as err:
            errors[key] = str(err)
    return errors


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    path = save_checkpoint(tiny_config("qwen3", num_hidden_layers=3), str(tmp_path_factory.mktemp("ac") / "qwen3"))
    return run_ranks(4, _layouts, path, timeout=900)[0]


@pytest.mark.parametrize("layout", [layout[0] for layout in LAYOUTS])
def test_checkpointing_gives_bit_identical_gradients(results, layout):
    runs = results[layout]
    loss, _, grads = runs[None]
    for mode in ("full", "selective"):
        other_loss, _, other = runs[mode]
        assert other_loss == loss, (mode, other_loss, loss)
        assert set(other) == set(grads)
        for name, g in grads.items():
            assert (other[name] == g).all(), f"{mode}: gradient of {name} differs by {abs(other[name] - g).max()}"


@pytest.mark.parametrize("layout", [layout[0] for layout in LAYOUTS])
def test_full_recomputes_the_layers_and_selective_keeps_the_products(results, layout):
    runs = results[layout]
    plain, full, selective = (runs[m][1] for m in MODES)
    assert full > plain * 1.2, (plain, full)  # each layer's forward products run again in the backward pass
    assert selective == plain, (plain, selective)


@pytest.mark.parametrize("layout", [layout[0] for layout in LAYOUTS])
@pytest.mark.parametrize("how", ["compiled model", "compiled layers"])
def test_compiled_step_matches_eager(results, layout, how):
    loss, _, grads = results[layout][None]
    other_loss, _, other = results[layout][how]
    assert abs(other_loss - loss) <= TOL, (other_loss, loss)
    assert set(other) == set(grads)
    worst = max(float(abs(other[k] - grads[k]).max()) for k in grads)
    assert worst <= TOL, worst


def test_unsupported_checkpointing_options_are_named(results):
    errors = results["errors"]
    assert "use_reentrant=True is not supported" in errors["reentrant"]
    assert "unsupported ['checkpoint_impl']" in errors["unknown"]
    assert "mode must be one of ('full', 'selective'), got 'sometimes'" in errors["mode"]
