"""capture/derive.py: the graph without labels cut from the training capture is the graph a capture
without labels gives (same outputs, guards and collectives once planned), in one process on meta; the
end-to-end tests compare its logits with the single-device model (e.g. tests/test_numerics.py), and
tests/test_graph_cache.py counts the captures it saves."""
from __future__ import annotations

import pytest
import torch


def _planned(meta, arguments, captured=None, derived=None):
    from fxparallel.api import plan_graph
    from fxparallel.group import fake_group

    return plan_graph(meta, arguments, fake_group(2), torch.device("cpu"), captured=captured, derived=derived)


def _collectives(ctx) -> list:
    names = ("all_reduce", "all_gather", "reduce_scatter")
    return sorted(str(n.target) for n in ctx.graph.nodes if any(k in str(n.target) for k in names))


@pytest.mark.parametrize("model_type", ["llama", "gpt2"])
def test_graph_without_labels_is_the_captured_one(model_type):
    from transformers import GPT2Config

    from fxparallel.capture import build_meta_model
    from models import tiny_config

    config = (GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=128, n_positions=64) if model_type == "gpt2"
              else tiny_config(model_type))
    meta = build_meta_model(config, dtype=torch.float32)
    derived = {}
    _planned(meta, ("input_ids", "labels"), derived=derived)
    assert list(derived) == [("input_ids",)]
    cut = derived[("input_ids",)]
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
    from fxparallel.capture.dynamo import capture
    from models import tiny_config

    class LabelsInLogits(LlamaForCausalLM):
        def forward(self, input_ids=None, labels=None, **kwargs):
            out = super().forward(input_ids=input_ids, labels=labels, **kwargs)
            out.logits = out.logits * labels.float().mean()
            return out

    with torch.device("meta"):
        meta = LabelsInLogits(tiny_config("llama"))
    assert without_labels(capture(meta, ("input_ids", "labels"))) is None
