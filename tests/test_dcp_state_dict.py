"""torch.distributed.checkpoint fed `model.state_dict()`, as users write by habit: the shards are saved as
full-shape tensors (each rank its pieces, fused weights included) that load exactly into a model parallelized
at another tp size (uneven heads at TP=3) and into a transformers model on one process; under FSDP it is refused
naming runtime.save_checkpoint."""
from __future__ import annotations

import pytest

from distributed import run_ranks


def _ids():
    import torch

    return torch.randint(0, 128, (2, 9), generator=torch.Generator().manual_seed(3))


def _save(rank, world, path, out):
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    import fxparallel

    model = fxparallel.parallelize(path, dist.group.WORLD, dtype=torch.float32)
    dcp.save(model.state_dict(), checkpoint_id=out)
    return model(input_ids=_ids()).logits.detach().numpy()


def _load(rank, world, path, out):
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    import fxparallel

    model = fxparallel.parallelize(path, dist.group.WORLD, dtype=torch.float32)
    before = model(input_ids=_ids()).logits.detach().numpy()
    state = model.state_dict()
    dcp.load(state, checkpoint_id=out)
    model.load_state_dict(state)  # the habit's second line (DCP already loaded in place)
    return before, model(input_ids=_ids()).logits.detach().numpy()


def _one_process(original, out):
    import torch
    import torch.distributed.checkpoint as dcp

    from models import reference

    hf = reference(original)
    state = hf.state_dict()
    for value in state.values():
        value.zero_()
    dcp.load(state, checkpoint_id=out, no_dist=True)
    hf.load_state_dict(state)
    with torch.no_grad():
        return hf(input_ids=_ids()).logits


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_dcp_of_state_dict_reloads_at_any_layout(family, checkpoints, tmp_path):
    import torch
    from transformers import GPT2Config

    from models import reference, save_checkpoint, tiny_config

    if family == "gpt2":  # fused c_attn: each rank's q, k and v heads are three pieces of one weight
        config = GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=128, n_positions=64)
        original, other = (save_checkpoint(config, str(tmp_path / n), seed=s) for n, s in (("a", 0), ("b", 1)))
    else:
        original = checkpoints["llama"]
        other = save_checkpoint(tiny_config("llama"), str(tmp_path / "other"), seed=1)
    out = str(tmp_path / "dcp")
    with torch.no_grad():
        expected = reference(original)(input_ids=_ids()).logits
    saved = run_ranks(2, _save, original, out)
    assert abs(saved[0] - expected.numpy()).max() < 1e-5
    for tp in (1, 3) if family == "llama" else (1,):  # llama at TP=3: kv heads 2/1/1, query heads 4/2/2
        for before, after in run_ranks(tp, _load, other, out):
            assert abs(before - expected.numpy()).max() > 1e-2  # another model until loaded
            assert abs(after - expected.numpy()).max() < 1e-5, tp
    assert (_one_process(original, out) - expected).abs().max() < 1e-5


def _under_fsdp(rank, world, path, out):
    import torch
    import torch.distributed.checkpoint as dcp

    import fxparallel
    from fxparallel.errors import CheckpointError
    from fxparallel.runtime import apply_data_parallel, init_mesh

    mesh = init_mesh(tp=2, dp=1, cp=1)
    model = apply_data_parallel(fxparallel.parallelize(path, mesh.tp_mesh, dtype=torch.float32), mesh)
    try:
        dcp.save(model.state_dict(), checkpoint_id=out)
    except BaseException as err:  # noqa: BLE001 - DCP wraps what a rank raised in a BaseException
        return f"{type(err).__name__}: {err}"
    return "saved"


def test_dcp_of_state_dict_under_fsdp_is_refused(checkpoints, tmp_path):
    for message in run_ranks(2, _under_fsdp, checkpoints["llama"], str(tmp_path / "dcp")):
        assert "fxparallel.runtime.save_checkpoint" in message and "CheckpointError" in message, message
