"""Two ways the pipeline avoids Dynamo captures, each against the capture it replaces.

capture/derive.py: the graph without labels cut from the training capture is the graph a capture
without labels gives (same outputs, guards and collectives once planned); the end-to-end tests
compare its logits with the single-device model (e.g. tests/test_numerics.py), and
tests/test_graph_cache.py counts the captures it saves.

capture/repeat_layers.py: a deep model captured with three layers and repeated gets the plan of the
whole capture (every placement, collective and reason), numbers equal to the single-device model on
ranks, and models whose layers differ are captured whole."""
from __future__ import annotations

import os
import sys

import pytest
import torch

from distributed import run_ranks

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))


def _planned(meta, arguments, captured=None, derived=None):
    from fxparallel.api import OneCapture, plan_graph
    from fxparallel.capture import GraphSpec
    from fxparallel.group import fake_group

    one = OneCapture(meta, GraphSpec(arguments), captured, derived)
    return plan_graph(meta, GraphSpec(arguments), fake_group(2), torch.device("cpu"),
                      captured=lambda: one(copy=False))


def _collectives(ctx) -> list:
    names = ("all_reduce", "all_gather", "reduce_scatter")
    return sorted(str(n.target) for n in ctx.graph.nodes if any(k in str(n.target) for k in names))


@pytest.mark.parametrize("model_type", ["llama", "gpt2"])
def test_graph_without_labels_is_the_captured_one(model_type):
    from transformers import GPT2Config

    from fxparallel.capture import GraphSpec, build_meta_model
    from models import tiny_config

    config = (GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=128, n_positions=64) if model_type == "gpt2"
              else tiny_config(model_type))
    meta = build_meta_model(config, dtype=torch.float32)
    derived = {}
    _planned(meta, ("input_ids", "labels"), derived=derived)
    assert list(derived) == [GraphSpec(("input_ids",))]
    cut = derived[GraphSpec(("input_ids",))]
    assert cut.outputs == ("logits",) and set(cut.inputs.values()) == {"input_ids"}
    assert not any(arg == "labels" for arg, _ in cut.symbol_sources.values())
    captured = _planned(meta, ("input_ids",))
    shapes = [{"input_ids": s} for s in [(2, 9), (3, 13), (1, 9), (2, 1), (4, 64)]]
    assert [cut.shape_guards().holds_for(s) for s in shapes] == \
        [captured.captured.shape_guards().holds_for(s) for s in shapes]
    planned = _planned(meta, ("input_ids",), captured=cut)
    assert planned.output_placements == captured.output_placements
    assert _collectives(planned) == _collectives(captured) and _collectives(planned)


def test_no_graph_is_derived_where_the_labels_are_read_beyond_the_loss():
    """A model whose logits depend on the labels (here: scaled by their mean) has no derived graph."""
    from transformers import LlamaForCausalLM

    from fxparallel.capture.derive import without_labels
    from fxparallel.capture import GraphSpec
    from fxparallel.capture.dynamo import capture
    from models import tiny_config

    class LabelsInLogits(LlamaForCausalLM):
        def forward(self, input_ids=None, labels=None, **kwargs):
            out = super().forward(input_ids=input_ids, labels=labels, **kwargs)
            out.logits = out.logits * labels.float().mean()
            return out

    with torch.device("meta"):
        meta = LabelsInLogits(tiny_config("llama"))
    assert without_labels(capture(meta, GraphSpec(("input_ids", "labels")))) is None


# ---- capture once for identical layers ----------------------------------------------------------
def _plans(config, **kwargs):
    """(plan with layers repeated, plan of the whole capture, whether the repeat was used)."""
    import fxparallel.api as api
    from fxparallel.capture.repeat_layers import capture_layers_once

    used = []

    def spy(*a, **k):
        out = capture_layers_once(*a, **k)
        used.append(out is not None)
        return out

    plans = []
    for shortcut in (spy, lambda *a, **k: None):
        api.capture_layers_once = shortcut
        try:
            plans.append(api.plan_model(config, 2, **kwargs)[0])
        finally:
            api.capture_layers_once = capture_layers_once
    return plans[0], plans[1], used


@pytest.mark.parametrize("model_type,kwargs", [("llama", {"sequence_parallel": True}), ("mixtral", {}),
                                               ("gpt2", {})])
def test_repeated_layers_plan_as_the_whole_capture(model_type, kwargs):
    """Every placement, reason and collective; Mixtral's experts compute a size once for all layers."""
    from tiny_configs import tiny_config

    config = tiny_config(model_type, **({"n_layer": 6} if model_type == "gpt2" else {"num_hidden_layers": 6}))
    repeated, whole, used = _plans(config, **kwargs)
    assert used == [True], used
    assert repeated == whole
    assert sum(c.count for c in whole.collectives) > 0


def test_layers_that_differ_are_captured_whole():
    """Sliding and full attention alternating (Gemma 2), and a layer type that changes after layer 3
    (Qwen2 with sliding windows from layer 4): no short capture is even tried."""
    from fxparallel.capture import GraphSpec, build_meta_model
    from fxparallel.capture.repeat_layers import capture_layers_once
    from tiny_configs import tiny_config

    gemma2 = tiny_config("gemma2", num_hidden_layers=6)
    qwen2 = tiny_config("qwen2", num_hidden_layers=6, use_sliding_window=True, sliding_window=16,
                        layer_types=["full_attention"] * 4 + ["sliding_attention"] * 2)
    for config in (gemma2, qwen2):
        tried = []
        meta = build_meta_model(config, dtype=torch.float32)
        assert capture_layers_once(meta, GraphSpec(("input_ids",)), lambda *a, **k: tried.append(a)) is None
        assert not tried, config.model_type


def _repeated_on_ranks(rank, tp, path):
    import torch.distributed as dist

    import fxparallel
    from checks import compare
    from fxparallel.capture import repeat_layers
    from models import reference

    shortened = []
    capture = repeat_layers.capture_layers_once

    def spy(*a, **k):
        out = capture(*a, **k)
        shortened.append(out is not None)
        return out

    fxparallel.api.capture_layers_once = spy
    model = fxparallel.parallelize(path, dist.group.WORLD, dtype=torch.float32)
    ref = reference(path)
    errors = compare(model, ref, rank, tp)
    ids = torch.randint(1, 128, (3, 7), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[0, :3] = 0  # left padding
    kwargs = dict(input_ids=ids * mask, attention_mask=mask, max_new_tokens=8, do_sample=False, pad_token_id=0)
    errors["tokens equal"] = torch.equal(model.generate(**kwargs), ref.generate(**kwargs))
    return errors, shortened


def test_repeated_layers_equal_single_device(tmp_path):
    """A 6-layer Llama captured with 3 layers at TP=2: loss, logits (the graph without labels is cut
    from the repeated one) and every parameter's gradient within 1e-5 of the single-device model; the
    prefill and decode graphs (their KV cache repeated per layer too) generate transformers' tokens."""
    from models import save_checkpoint, tiny_config

    path = save_checkpoint(tiny_config("llama", num_hidden_layers=6), str(tmp_path / "llama6"))
    first_plans = os.environ.get("FXPARALLEL_PLANNING") == "first"  # (conftest's): rank 0 captures for both
    for rank, (errors, shortened) in enumerate(run_ranks(2, _repeated_on_ranks, path)):
        # training, prefill, decode
        assert shortened == ([] if first_plans and rank else [True, True, True]), (rank, shortened)
        assert max(errors["loss"], errors["logits"], errors["grad"]) < 1e-5, errors
        assert errors["tokens equal"], errors
