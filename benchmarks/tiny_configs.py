"""Tiny random configs for every causal-LM type transformers registers (for coverage runs).

Each config keeps its architecture's structure but shrinks sizes so that a 2-layer
model builds in milliseconds: hidden 64, 8 heads (4 kv heads), MLP 128, vocab 256.
"""
from __future__ import annotations

SIZES = {
    "hidden_size": 64, "n_embd": 64, "d_model": 64, "embed_dim": 64, "dim": 64, "model_dim": 64, "n_embed": 64,
    "num_hidden_layers": 2, "n_layer": 2, "num_layers": 2, "n_layers": 2, "decoder_layers": 2,
    "num_attention_heads": 8, "n_head": 8, "num_heads": 8, "n_heads": 8, "decoder_attention_heads": 8,
    "num_key_value_heads": 4, "n_kv_heads": 4, "num_kv_heads": 4, "multi_query_group_num": 4,
    "intermediate_size": 128, "n_inner": 128, "ffn_dim": 128, "decoder_ffn_dim": 128, "ffn_hidden_size": 128,
    "moe_intermediate_size": 32, "shared_expert_intermediate_size": 64, "expert_ffn_dim": 32,
    "vocab_size": 256, "max_position_embeddings": 128, "n_positions": 128, "n_ctx": 128, "max_seq_len": 128,
    "num_local_experts": 4, "num_experts": 4, "n_routed_experts": 4, "num_experts_per_tok": 2, "top_k": 2,
    "head_dim": 8, "kv_channels": 8, "rotary_dim": 4, "rotary_emb_base": 10000,
    # multi-head latent attention (DeepSeek-V2/V3 family): the rope part is head_dim wide
    "q_lora_rank": 32, "kv_lora_rank": 16, "qk_rope_head_dim": 8, "qk_nope_head_dim": 8, "qk_head_dim": 16,
    "v_head_dim": 8, "first_k_dense_replace": 1, "n_group": 2, "topk_group": 1, "decoder_vocab_size": 256, "vocab_size_per_layer_input": 256,
}

# defaults transformers ships that do not build a model at all
TYPE_OVERRIDES = {
    "dots1": {"n_shared_experts": 1},
    "lfm2_moe": {"layer_types": ["conv", "full_attention"], "num_dense_layers": 1},
}


def tiny_config(model_type: str, **overrides):
    """The default config of ``model_type`` with small sizes (only attributes it already has are set)."""
    from transformers import CONFIG_MAPPING

    config = CONFIG_MAPPING[model_type]()
    layers_before = getattr(config, "num_hidden_layers", None)
    names = set(vars(config)) | set(getattr(config, "attribute_map", {}))
    overrides = {**TYPE_OVERRIDES.get(model_type, {}), **overrides}
    for key, value in {**SIZES, **overrides}.items():
        if key in names or key in overrides:
            try:
                setattr(config, key, value)
            except (AttributeError, ValueError, TypeError):
                pass
    if "kv_lora_rank" in names and "num_key_value_heads" in names:  # latent attention: as many kv heads as heads
        config.num_key_value_heads = SIZES["num_attention_heads"]
    for sub in ("text_config", "vision_config", "audio_config"):
        if getattr(config, sub, None) is not None:
            setattr(config, sub, tiny_config_obj(getattr(config, sub)))
    _shrink_per_layer_lists(config, layers_before)
    if model_type == "gpt_neo":  # attention_layers is derived in __init__ from attention_types
        config.attention_types = [[["global", "local"], 1]]
        config.attention_layers = ["global", "local"]
    if hasattr(config, "pad_token_id") and isinstance(config.pad_token_id, int) and config.pad_token_id >= 256:
        config.pad_token_id = 0
    for attr in ("bos_token_id", "eos_token_id", "decoder_start_token_id"):
        v = getattr(config, attr, None)
        if isinstance(v, int) and v >= 256:
            setattr(config, attr, 1)
    return config


def _shrink_per_layer_lists(config, layers_before) -> None:
    """Per-layer lists (layer_types, mlp_layer_types, ...) follow the new depth, keeping one layer of each kind."""
    layers_after = getattr(config, "num_hidden_layers", 2)
    per_layer = {key: value for key, value in vars(config).items()
                 if isinstance(value, list) and layers_before and len(value) == layers_before != layers_after}
    kinds = max((len(set(v)) for v in per_layer.values() if all(isinstance(x, str) for x in v)), default=0)
    if kinds > layers_after:
        layers_after = kinds
        config.num_hidden_layers = kinds
    old_types = list(getattr(config, "layer_types", None) or [])
    for key, value in per_layer.items():
        try:
            setattr(config, key, _shrink_per_layer(value, layers_after))
        except (AttributeError, ValueError, TypeError):
            pass
    _shrink_layer_overrides(config, old_types)


def _shrink_layer_overrides(config, old_types: list) -> None:
    """Per-layer config overrides (Gemma 4's global layers) are keyed by layer index: give each new
    layer the overrides its kind had in the full-depth config."""
    spec = getattr(config, "_heterogeneity_spec", None)
    new_types = list(getattr(config, "layer_types", None) or [])
    if spec is None or not old_types or not new_types:
        return
    by_kind = {}
    for index, overrides in spec.per_layer_overrides.items():
        if index < len(old_types):
            by_kind.setdefault(old_types[index], overrides)
    spec.per_layer_overrides.clear()
    spec.per_layer_overrides.update({i: by_kind[t] for i, t in enumerate(new_types) if t in by_kind})


def _shrink_per_layer(values: list, layers: int) -> list:
    """The first ``layers`` entries, but with every kind of layer kept (first of each kind, in order)."""
    if not all(isinstance(v, str) for v in values):
        return values[:layers]
    kinds = list(dict.fromkeys(values))
    return (kinds + values[len(kinds):])[:layers]


def tiny_config_obj(config):
    layers_before = getattr(config, "num_hidden_layers", None)
    for key, value in SIZES.items():
        if key in vars(config):
            setattr(config, key, value)
    _shrink_per_layer_lists(config, layers_before)
    return config


def causal_lm_types() -> list:
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)
