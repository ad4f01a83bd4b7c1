"""Bad input fails early with a message naming what is wrong and where."""
from __future__ import annotations

import pytest
import torch

import fxparallel
from fxparallel.errors import CacheNotCarried, CaptureError, FxParallelError, GroupError, ShardingError
from fxparallel.group import resolve_tp_group
from models import tiny_config


def test_more_ranks_than_kv_heads_and_not_a_multiple_is_planned_not_refused():
    # 12 heads over 6 ranks, 4 kv heads: no longer an error; the kv heads are replicated and each
    # rank takes 2 query heads (ranks 1 and 4 use two kv heads each); numbers: test_coverage.py
    # (which plan is cheapest here is the solver's business; both kinds are exact)
    config = tiny_config("llama", hidden_size=96, num_attention_heads=12, num_key_value_heads=4)
    plan, _ = fxparallel.plan_model(config, 6)
    assert [p.name for p in plan.params if len(p.shape) == 2 and p.placement.is_replicate] == []
    assert plan.uneven[32] == (6, 6, 6, 6, 6, 2)  # k/v rows (4 kv heads of 8) split by column (torch.chunk), never refused


def test_tp_size_larger_than_vocab():
    # a vocabulary tp does not divide splits unevenly (tests/test_uneven.py); fewer rows than ranks cannot
    with pytest.raises(ShardingError, match=r"tp size 4 is larger than vocab_size=3.*embed_tokens.weight \(dim 0\)"):
        fxparallel.plan_model(tiny_config("llama", vocab_size=3), 4)


def test_not_a_causal_lm():
    from transformers import ViTConfig

    with pytest.raises(FxParallelError, match=r"not a causal language model: model_type 'vit'"):
        fxparallel.plan_model(ViTConfig(hidden_size=64, num_attention_heads=4, intermediate_size=64), 2)


def test_a_text_config_auto_does_not_map_loads_through_the_class_that_saved_it(tmp_path):
    """Emu3ForCausalLM.save_pretrained writes its text config (model_type emu3_text_model), which
    transformers' AutoModelForCausalLM does not map: the class its ``architectures`` names takes it."""
    from transformers import Emu3ForCausalLM, Emu3TextConfig

    from fxparallel.load.source import resolve_source

    text = Emu3TextConfig(vocab_size=128, pad_token_id=0, bos_token_id=1, eos_token_id=2, hidden_size=64,
                          intermediate_size=128, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2)
    Emu3ForCausalLM(text).save_pretrained(str(tmp_path))
    assert resolve_source(str(tmp_path)).model_class is Emu3ForCausalLM
    config = resolve_source(str(tmp_path)).config
    config.architectures = ["Emu3ForConditionalGeneration"]  # not a causal LM class: still refused
    with pytest.raises(FxParallelError, match=r"not a causal language model: model_type 'emu3_text_model'"):
        fxparallel.plan_model(config, 2)


def test_graph_break_names_the_op_and_source_line(monkeypatch):
    from transformers.models.llama import modeling_llama

    original = modeling_llama.LlamaMLP.forward

    def data_dependent(self, x):
        if x.sum() > 0:  # a data-dependent branch: Dynamo cannot capture it whole
            return original(self, x)
        return original(self, -x)

    monkeypatch.setattr(modeling_llama.LlamaMLP, "forward", data_dependent)
    with pytest.raises(CaptureError, match=r"could not be captured as one graph.*test_errors\.py:\d+"):
        fxparallel.plan_model(tiny_config("llama"), 2)


def test_uninitialized_process_group():
    import torch.distributed as dist

    assert not dist.is_initialized()
    with pytest.raises(GroupError, match="torch.distributed is not initialized"):
        resolve_tp_group(object())
    with pytest.raises(GroupError, match="tp_group is None"):
        fxparallel.parallelize(tiny_config("llama"), None)


def test_op_without_rule_is_gathered_and_recorded(monkeypatch):
    """An op the planner has no rule for must never give wrong numbers: it runs on gathered inputs."""
    from transformers.models.llama import modeling_llama

    def flipped_mlp(self, x):
        h = self.act_fn(self.gate_proj(x)) * self.up_proj(x)
        h = torch.flip(h, dims=[-1])  # not elementwise: flipping a sharded dim would be wrong locally
        return self.down_proj(h)

    monkeypatch.setattr(modeling_llama.LlamaMLP, "forward", flipped_mlp)
    plan, graph = fxparallel.plan_model(tiny_config("llama"), 2)
    assert any("flip" in f and "gathered" in f for f in plan.fallbacks), plan.fallbacks
    assert "replicated by fallback" in str(plan)
    assert "collectives_all_gather(" in graph.code  # the gather the fallback needs


def test_a_model_that_copies_its_cache_layers_as_it_runs_gets_them_before_or_is_refused_a_cache():
    """Dory's recurrent loops append deep copies of their cache layers on the first call (given the cache
    by its 5.24 keyword, ``cache``: under the old one it built a cache of its own and decoded without the
    prompt's keys, silently): a graph captured once cannot follow that, so the copies are made before the cache is
    filled (its one recurrent layer's, for the second loop: four layers for three decoder layers, each filled);
    in ``"last_loop"`` mode, whose earlier loops read the written part of the last loop's cache, use_cache is
    refused by name."""
    from fxparallel.capture.static_cache import meta_cache

    cache = meta_cache(_sweep_meta_model("dory"), 1, 8)
    assert [tuple(layer.keys.shape) for layer in cache.layers] == [(1, 4, 8, 8)] * 4
    with pytest.raises(CacheNotCarried, match=r"DoryForCausalLM with recurrent_kv_cache_mode='last_loop': its "
                                              r"earlier loops read the keys and values the last loop wrote so far"):
        meta_cache(_sweep_meta_model("dory", recurrent_kv_cache_mode="last_loop"), 1, 8)


def test_a_model_whose_layer_types_have_no_static_cache_is_refused_a_cache():
    """DeepSeek-V4's compressed-attention layers have no static cache layer in transformers (its generate
    uses a dynamic cache): refused by name before any capture, not a KeyError inside transformers."""
    from fxparallel.capture.static_cache import meta_cache

    with pytest.raises(CacheNotCarried, match=r"DeepseekV4ForCausalLM has layers of type "
                                              r"\['compressed_sparse_attention', 'heavily_compressed_attention'\], "
                                              r"for which transformers has no static"):
        meta_cache(_sweep_meta_model("deepseek_v4"), 1, 8)


@pytest.mark.parametrize("model_type, message", [
    ("openai-gpt", r"OpenAIGPTLMHeadModel's forward takes no KV cache \(no `cache` or `past_key_values` argument\)"),
    ("rwkv", r"RwkvForCausalLM's forward takes no KV cache \(.*; it carries `state` instead\): use_cache is not "
             r"supported for this model"),
])
def test_a_model_whose_forward_takes_no_kv_cache_is_refused_a_cache(model_type, message):
    """GPT-1 recomputes the whole prefix per token in transformers; RWKV carries a recurrent state of its own:
    neither has a KV cache for the generation graphs to shard, so use_cache is refused by name (generate
    recomputes: tests/test_generate_without_cache.py)."""
    from fxparallel.capture.static_cache import meta_cache

    with pytest.raises(CacheNotCarried, match=message):
        meta_cache(_sweep_meta_model(model_type), 1, 8)


def _sweep_meta_model(model_type: str, **overrides):
    """The coverage sweep's tiny ``model_type`` model (its config with ``overrides``), on the meta device."""
    import os
    import sys

    from fxparallel.capture import build_meta_model

    sys.path.insert(0, os.path.join(os.path.dirname(__file__), os.pardir, os.pardir, "benchmarks"))
    from tiny_configs import tiny_config as sweep_config

    return build_meta_model(sweep_config(model_type, **overrides), dtype=torch.float32)


def test_a_model_that_adds_cache_layers_as_it_runs_is_refused_a_cache():
    """The same for any model whose forward adds layers to the cache it is given (the captured graphs hold
    the layers they saw)."""
    from fxparallel.capture.static_cache import meta_cache

    class Appends(torch.nn.Module):
        config = tiny_config("llama", num_hidden_layers=2)

        def forward(self, input_ids, use_cache=True, cache=None):
            cache.layers.append(cache.layers[0])

    with pytest.raises(CacheNotCarried, match=r"Appends adds layers to its cache as it runs \(2 -> 3"):
        meta_cache(Appends(), 1, 8)


@pytest.mark.parametrize("model_type, extra", [
    ("llama", None), ("openai-gpt", None), ("rwkv", None),
    ("xlnet", "its generate passes perm_mask, target_mapping and appends a token to the sequence"),
    ("xlm", "its generate passes langs and appends a token to the sequence"),
])
def test_what_generate_feeds_beyond_tokens_is_read_from_the_model(model_type, extra):
    """Generation without a cache runs the model's forward on tokens, mask and positions: exact where
    transformers' ``prepare_inputs_for_generation`` feeds just those, named where it feeds more."""
    from fxparallel.capture.generation_inputs import inputs_beyond_tokens

    assert inputs_beyond_tokens(_sweep_meta_model(model_type)) == extra


def test_a_cache_refusal_keeps_its_reason_when_sent_between_processes():
    """A rank's refusal travels to the caller pickled: the reason and the message arrive as raised."""
    import pickle

    err = CacheNotCarried("RwkvForCausalLM: its cache keeps a state")
    back = pickle.loads(pickle.dumps(err))
    assert type(back) is CacheNotCarried and back.why == err.why and str(back) == str(err)
    assert str(err).startswith("RwkvForCausalLM: its cache keeps a state: use_cache is not supported")
