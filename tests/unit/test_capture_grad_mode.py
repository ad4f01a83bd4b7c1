"""capture/dynamo.py captures with gradients on, whatever the caller's mode: under ``torch.no_grad()`` or
``torch.inference_mode()`` the fake values would not require grad, the solver would plan no gradient
reduction, and the graph (cached by a key that does not hold the mode) would later serve calls that train,
with wrong gradients and no error. A plan made inside either mode equals the plan made outside, backward
all-reduces included (TP=2 planned without processes, the graph cache off)."""
import pytest
import torch


@pytest.mark.parametrize("mode", [torch.no_grad, torch.inference_mode])
def test_a_plan_made_without_gradients_keeps_the_gradient_reductions(tmp_path, monkeypatch, mode):
    import fxparallel
    from models import save_checkpoint, tiny_config

    monkeypatch.setenv("FXPARALLEL_GRAPH_CACHE", "0")
    path = save_checkpoint(tiny_config("llama", num_hidden_layers=1), str(tmp_path / "llama"))
    plain, _ = fxparallel.plan_model(path, 2, dtype=torch.float32)
    with mode():
        inside, _ = fxparallel.plan_model(path, 2, dtype=torch.float32)
    backward = [c for c in plain.collectives if c.direction == "backward"]
    assert backward and inside.collectives == plain.collectives, (inside.collectives, plain.collectives)
