"""Tiny random configs for every causal-LM type transformers registers (for coverage runs).

Each config keeps its architecture's structure but shrinks sizes so that a 2-layer
model builds in milliseconds: hidden 64, 8 heads (4 kv heads), MLP 128, vocab 256.
Sub-configs (text_config, attn_config, ...) are shrunk the same way.
"""
from __future__ import annotations

import copy

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
    "d_head": 8, "d_inner": 128, "attention_head_size": 8, "feed_forward_size": 128,  # XLNet, Reformer
    "encoder_hash_byte_group_vocab": 256, "backbone_hidden_size": 64,  # BLT's hash embeddings; assistants' target
    "adapter_in_dim": 64, "adapter_out_dim": 64, "adapter_input_size": 64,  # encoder adapters (hidden to hidden)
}

# defaults transformers ships that do not build a model at all, or that leave out a kind of layer
# (a dict for a sub-config sets attributes of that sub-config; "per_layer_config" maps a layer kind to the
# attributes its layers override, replacing the full-size model's overrides for that kind)
_DOTS3_TEXT = {  # the rotary part is a quarter of head_dim (rope_parameters), and SWA layers' head_dim is
    # qk_nope + qk_rope: both stay so at head_dim 16
    "head_dim": 16, "qk_rope_head_dim": 4, "qk_nope_head_dim": 8, "index_n_heads": 4, "index_head_dim": 16,
    "per_layer_config": {"sliding_attention": {"qk_nope_head_dim": 12}},
}
_QWEN4_EXP_TEXT = {  # indexed-attention layers always build the QSA indexer, which the defaults leave unset
    "indexer_n_heads": 4, "indexer_kv_heads": 1, "indexer_head_dim": 8, "indexer_budget": 8,
    "indexer_compress_ratio": 4, "hc_lowrank": 32,
}
_BLT_LOCAL = {"hidden_size": 32, "num_attention_heads": 4, "hidden_size_global": 64}  # x cross_attn_k 2 = global
TYPE_OVERRIDES = {
    "dots1": {"n_shared_experts": 1},
    "lfm2_moe": {"layer_types": ["conv", "full_attention"], "num_dense_layers": 1},
    "bamba": {"attn_layer_indices": [1]},  # the default has no attention layer (released models do)
    "granitemoehybrid": {"layer_types": ["linear_attention", "full_attention"]},  # the default: Mamba layers only
    "blt": {"encoder_config": _BLT_LOCAL, "decoder_config": _BLT_LOCAL},
    "cohere_compass_text": {  # the default has no rope_parameters for its layer types: RoPE on sliding layers,
        # none on full ones (as Cohere 2)
        "layer_types": ["sliding_attention", "full_attention"],
        "rope_parameters": {"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                            "full_attention": None},
    },
    # the model reads attn_config.rope_theta, and clamps q/k/v with clip_qkv unconditionally (released: 8)
    "dbrx": {"attn_config": {"kv_n_heads": 4, "rope_theta": 10000.0, "clip_qkv": 8.0}},
    "dots3_note": {"text_config": _DOTS3_TEXT},
    "dots3_note_text": _DOTS3_TEXT,
    "qwen4_exp": {"text_config": _QWEN4_EXP_TEXT},
    "qwen4_exp_text": _QWEN4_EXP_TEXT,
    # the LM head is causal. Axial position embeddings need prod(axial_pos_shape) == the sequence length when
    # training (9) but > every position when generating (15): learned absolute ones instead (chunk lengths
    # stay 64 > 15, so local and LSH layers attend in full, without random hashing)
    "reformer": {"is_decoder": True, "axial_pos_embds": False, "axial_pos_embds_dim": (32, 32)},
    # attention reads [hidden, embeddings] (2 x hidden); the shared transformer is tied over >= 2 hybrid layers
    "zamba": {"attention_hidden_size": 128, "mamba_dt_rank": 4, "num_hidden_layers": 3,
              "layers_block_type": ["linear_attention", "hybrid", "hybrid"]},
    # sizes __post_init__ derives from the full-size hidden size / heads / layer pattern: attention reads
    # [hidden, embeddings] (2 x hidden, head_dim 2 x hidden / heads), Mamba heads are expand x hidden / heads
    # wide; the shared block (with one MLP adapter per hybrid layer) is tied over >= 2 hybrid layers
    "zamba2": {"attention_hidden_size": 128, "head_dim": 16, "mamba_headdim": 16, "kv_channels": 8,
               "num_query_groups": 8, "adapter_rank": 16, "num_hidden_layers": 3,
               "layers_block_type": ["linear_attention", "hybrid", "hybrid"], "hybrid_layer_ids": [1, 2]},
    "zaya": {"num_experts_per_tok": 1},  # ZAYA supports top-1 routing only
    # the default puts attention every 8th layer from the 4th: 2 layers would be Mamba only
    "jamba": {"attn_layer_period": 2, "attn_layer_offset": 1, "expert_layer_period": 2, "expert_layer_offset": 1},
    "xmod": {"default_language": "en_XX"},  # the default has none, and forward requires one
    # its own names of hidden size and depth; the cache sizes q/k heads by qk_dim rounded up to a multiple of 64,
    # the layers by hidden x qk_dim_factor unrounded: the two agree at 64 x 1.0 (the default 0.5 gives 32 vs 64)
    "xlstm": {"embedding_dim": 64, "num_blocks": 2, "qk_dim_factor": 1.0},
    "rwkv": {"attention_hidden_size": 64},
    # HRM's cache counts layer calls, num_layers_per_stack x H_cycles x (L_cycles + 1) = 8 with one layer per
    # stack; __post_init__ derives it before the sizes shrink
    "hrm_text": {"num_layers_per_stack": 1, "num_hidden_layers": 8},
    # the default pattern (recurrent, recurrent, attention) has no attention layer in 2 (and the cache needs one);
    # lru_width and the last layers' init scale are derived from the full-size hidden size / depth
    "recurrent_gemma": {"block_types": ["recurrent", "attention"], "lru_width": 64,
                        "final_w_init_variance_scale": 1.0},
    # its sections must add up to the depth (n_recurrent_layers is derived in __post_init__): one layer each
    "dory": {"num_hidden_layers": 3, "n_input_layers": 1, "n_recurrent_layers": 1, "n_output_layers": 1},
    # the real vocabulary inside the padded one: not above it
    **{t: {"unpadded_vocab_size": 256} for t in ("inkling2_text", "inkling2_loop_text")},
    # block-sparse attention on short sequences switches to full attention inside forward (new modules)
    "big_bird": {"attention_type": "original_full"},
}
# constructor arguments, for types whose default config does not validate
TYPE_INIT = {
    # an assistant has no per-layer inputs (its validator requires 0)
    "gemma4_assistant": {"text_config": {"hidden_size_per_layer_input": 0, "vocab_size_per_layer_input": 0}},
}
# Mamba-2 mixers: (heads, head size, expand); heads x head size must equal expand x hidden (or mamba_d_ssm)
_MAMBA2 = (("mamba_n_heads", "mamba_d_head", "mamba_expand"), ("num_heads", "head_dim", "expand"))
_TOKEN_IDS = ("bos_token_id", "eos_token_id", "decoder_start_token_id")


def tiny_config(model_type: str, **overrides):
    """The default config of ``model_type`` with small sizes (only attributes it already has are set)."""
    from transformers import CONFIG_MAPPING

    init = copy.deepcopy(TYPE_INIT.get(model_type, {}))
    config = CONFIG_MAPPING[model_type](**copy.deepcopy(init))
    # (init's values win over SIZES too)
    _shrink(config, {**init, **copy.deepcopy(TYPE_OVERRIDES.get(model_type, {})), **overrides})
    if model_type == "gpt_neo":  # attention_layers is derived in __init__ from attention_types
        config.attention_types = [[["global", "local"], 1]]
        config.attention_layers = ["global", "local"]
    return config


def _shrink(config, overrides: dict) -> None:
    """SIZES and ``overrides`` on ``config`` and, recursively, on each of its sub-configs."""
    from transformers import PreTrainedConfig

    layers_before = getattr(config, "num_hidden_layers", None)
    names = set(vars(config)) | set(getattr(config, "attribute_map", {}))
    overrides = dict(overrides)
    kind_overrides = overrides.pop("per_layer_config", {})
    sub_overrides = {k: overrides.pop(k) for k, v in list(overrides.items())
                     if isinstance(v, dict) and isinstance(getattr(config, k, None), PreTrainedConfig)}
    for key, value in {**SIZES, **overrides}.items():
        if key in names or key in overrides:
            current = vars(config).get(key)
            if key not in overrides and isinstance(current, list) and current and isinstance(value, int) \
                    and all(isinstance(x, int) for x in current):  # one size per layer (Gemma 3n's MLPs)
                value = [value] * len(current)
            try:
                setattr(config, key, value)
            except (AttributeError, ValueError, TypeError):
                pass
    depth = vars(config).get("num_hidden_layers")
    for key, value in overrides.items():  # a layer-kind pattern repeats to the depth (e.g. coverage.py --layers 5)
        if isinstance(depth, int) and isinstance(value, list) and value and len(value) != depth \
                and all(isinstance(x, str) for x in value):
            setattr(config, key, [value[i % len(value)] for i in range(depth)])
    if "kv_lora_rank" in names and "num_key_value_heads" in names:  # latent attention: as many kv heads as heads
        config.num_key_value_heads = SIZES["num_attention_heads"]
    _fit_mamba2_heads(config)
    for key, sub in list(vars(config).items()):
        if isinstance(sub, PreTrainedConfig):
            _shrink(sub, sub_overrides.get(key, {}))
    _shrink_per_layer_lists(config, layers_before, kind_overrides)
    _clamp_token_ids(config)


def _fit_mamba2_heads(config) -> None:
    """Mamba-2 heads x head size must fill the (shrunk) mixer width: keep 8 heads of the right size."""
    for heads, head, expand in _MAMBA2:
        values = vars(config)  # (not getattr: Gemma 4 refuses to read per-layer attributes globally)
        if not all(isinstance(values.get(k), int) for k in (heads, head, expand, "hidden_size")):
            continue
        width = values.get("mamba_d_ssm") or values[expand] * values["hidden_size"]
        if values[heads] * values[head] != width:
            setattr(config, heads, SIZES["num_attention_heads"])
            setattr(config, head, width // SIZES["num_attention_heads"])


def _clamp_token_ids(config) -> None:
    """Padding / bos / eos ids inside the vocabulary (an embedding's padding_idx must be)."""
    vocab = getattr(config, "vocab_size", None) or SIZES["vocab_size"]
    if isinstance(getattr(config, "pad_token_id", None), int) and config.pad_token_id >= vocab:
        config.pad_token_id = 0
    for attr in _TOKEN_IDS:
        v = getattr(config, attr, None)
        if isinstance(v, int) and v >= vocab:
            setattr(config, attr, 1)


def _shrink_per_layer_lists(config, layers_before, kind_overrides=None) -> None:
    """Per-layer lists (layer_types, mlp_layer_types, ...) follow the new depth, keeping one layer of each kind."""
    layers_after = getattr(config, "num_hidden_layers", 2)
    per_layer = {key: value for key, value in vars(config).items()
                 if isinstance(value, (list, tuple)) and layers_before and len(value) == layers_before != layers_after}
    kinds = max((len(set(v)) for v in per_layer.values() if all(isinstance(x, str) for x in v)), default=0)
    shared = getattr(config, "num_kv_shared_layers", None)
    if isinstance(shared, int) and 0 < shared < layers_before and layers_before != layers_after:
        # KV sharing (Gemma 3n): the last layers reuse the cache of earlier layers of their kind: keep one
        # consumer of each kind the shared layers have, after producers of every kind (other per-layer
        # values: the full model's last layers' for the consumers)
        types = next((v for v in per_layer.values() if all(isinstance(x, str) for x in v)), ["layer"] * layers_before)
        consumers = len(dict.fromkeys(types[layers_before - shared:]))
        layers_after = config.num_hidden_layers = max(layers_after, max(kinds, 1) + consumers)
        config.num_kv_shared_layers = consumers
        producers = layers_after - consumers
        per_layer = {key: _shrink_per_layer(list(v[:layers_before - shared]), producers)
                     + list(dict.fromkeys(v[layers_before - shared:])) if all(isinstance(x, str) for x in v)
                     else list(v[:producers]) + list(v[layers_before - consumers:])
                     for key, v in per_layer.items()}
    elif isinstance(shared, int) and shared == layers_before != layers_after:  # every layer reuses (assistants)
        config.num_kv_shared_layers = layers_after
    if kinds > layers_after:
        layers_after = kinds
        config.num_hidden_layers = kinds
    old_types = list(getattr(config, "layer_types", None) or [])
    for key, value in per_layer.items():
        try:
            setattr(config, key, type(value)(_shrink_per_layer(list(value), layers_after)))
        except (AttributeError, ValueError, TypeError):
            pass
    _shrink_layer_overrides(config, old_types, kind_overrides or {})


def _shrink_layer_overrides(config, old_types: list, kind_overrides: dict) -> None:
    """Per-layer config overrides (Gemma 4's global layers) are keyed by layer index: give each new
    layer the overrides its kind had in the full-depth config (or those ``kind_overrides`` gives its kind)."""
    spec = getattr(config, "_heterogeneity_spec", None)
    new_types = list(getattr(config, "layer_types", None) or [])
    if spec is None or not old_types or not new_types:
        return
    by_kind = {}
    for index, overrides in spec.per_layer_overrides.items():
        if index < len(old_types):
            by_kind.setdefault(old_types[index], overrides)
    by_kind.update(kind_overrides)
    spec.per_layer_overrides.clear()
    spec.per_layer_overrides.update({i: by_kind[t] for i, t in enumerate(new_types) if t in by_kind})


def _shrink_per_layer(values: list, layers: int) -> list:
    """The first ``layers`` entries, but with every kind of layer kept (first of each kind, in order)."""
    if not all(isinstance(v, str) for v in values):
        return values[:layers]
    kinds = list(dict.fromkeys(values))
    return (kinds + values[len(kinds):])[:layers]


def causal_lm_types() -> list:
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)
