"""Communication counted from the rewritten graph: the Megatron minimum for a Llama decoder."""
from __future__ import annotations

import pytest

import fxparallel
from fxparallel.ops import collectives
from fxparallel.ops.vocab_parallel import vocab_parallel_cross_entropy
from models import tiny_config


def _graph_calls(local_graph_code: str, name: str) -> int:
    return local_graph_code.count(f"collectives_{name}(")


@pytest.mark.parametrize("layers", [2, 3])
@pytest.mark.parametrize("tied", [False, True])
def test_llama_forward_and_backward_all_reduces_are_2L_plus_1(layers, tied):
    config = tiny_config("llama", num_hidden_layers=layers, tie_word_embeddings=tied)
    plan, graph = fxparallel.plan_model(config, 2)
    L = layers
    assert plan.count("all_reduce", "forward") == 2 * L + 1
    assert plan.count("all_reduce", "backward") == 2 * L + 1
    # the only all-gather is the loss statistics (2 floats per token per rank), never the logits
    gathers = [c for c in plan.collectives if c.kind == "all_gather"]
    assert len(gathers) == 1 and gathers[0].bytes_per_token == 8.0 * 2
    # the same counts straight from the generated code
    assert _graph_calls(graph.code, "all_reduce") == 2 * L + 1
    assert _graph_calls(graph.code, "copy_to_tp") == 2 * L + 1
    assert _graph_calls(graph.code, "all_gather") == 0
    assert "vocab_parallel_cross_entropy" in graph.code and "vocab_parallel_embedding" in graph.code
    assert not plan.fallbacks
    # q, k and v share one backward all-reduce of their common input
    qkv = [c for c in plan.collectives if c.direction == "backward" and "q_proj" in c.where]
    assert len(qkv) == 1 and all(p in qkv[0].where for p in ("k_proj", "v_proj")) and qkv[0].count == L


def test_plan_places_megatron_pairs_and_is_layer_symmetric():
    plan, _ = fxparallel.plan_model(tiny_config("llama", num_hidden_layers=3), 4)
    expect = {"q_proj": "S(0)", "k_proj": "S(0)", "v_proj": "S(0)", "o_proj": "S(1)", "gate_proj": "S(0)",
              "up_proj": "S(0)", "down_proj": "S(1)", "input_layernorm": "R", "post_attention_layernorm": "R", "embed_tokens": "S(0)",
              "lm_head": "S(0)", "model.norm": "R"}
    for p in plan.params:
        key = next(k for k in expect if k in p.name)
        assert str(p.placement) == expect[key], (p.name, p.placement)
    text = str(plan)
    assert "model.layers.*.self_attn.q_proj.weight" in text and "x3" in text
    assert "vocab-parallel embedding" in text
    # a plan is data: JSON round trip and equality
    again = fxparallel.ShardingPlan.from_json(plan.to_json())
    assert again == plan


def test_collective_ops_declare_their_passes():
    assert (collectives.all_reduce.FORWARD, collectives.all_reduce.BACKWARD) == ("all_reduce", None)
    assert (collectives.copy_to_tp.FORWARD, collectives.copy_to_tp.BACKWARD) == (None, "all_reduce")
    assert vocab_parallel_cross_entropy.FORWARD == "all_gather"


def test_collectives_outside_autograd_are_fresh_views_and_forward_ad_is_refused():
    """Where autograd records nothing the ops skip their autograd.Function, but still return a new view (an
    in-place shape change of the output must not reach the input); forward-mode AD still goes through the
    Functions, which refuse it, rather than silently dropping or mis-summing tangents."""
    import torch
    import torch.autograd.forward_ad as fwAD

    from fxparallel.group import _register

    handle = _register(None, 0, 1).handle  # a one-rank group: every op is the identity
    x = torch.randn(2, 3)
    with torch.no_grad():
        for op in (lambda t: collectives.all_reduce(t, handle), lambda t: collectives.copy_to_tp(t, handle),
                   lambda t: collectives.partial_grad(t, handle), lambda t: collectives.all_gather(t, 1, handle)):
            out = op(x)
            out.unsqueeze_(0)
            assert x.shape == (2, 3) and torch.equal(out[0], x)
    with fwAD.dual_level():
        dual = fwAD.make_dual(x, torch.ones_like(x))
        with pytest.raises(NotImplementedError, match="forward mode AD"):
            collectives.all_reduce(dual, handle)
