"""Uneven splits: tp need not divide the heads, the MLP width or the vocabulary.

Heads split in whole kv groups (each kv head with its query heads, the first ranks taking one
more), the MLP by columns, the vocabulary and other embedding tables (learned positions) by rows,
in torch.chunk's sizes; every rank's local graph uses its own sizes. Loss, gathered logits and the gradient of every parameter equal the
single-device model (fp32, 1e-5).
"""
from __future__ import annotations

import pytest
import torch

from distributed import run_ranks
from fxparallel.errors import ShardingError
from fxparallel.plan.layout import ShardLayout
from fxparallel.plan.placement import shard_pieces
from fxparallel.plan.plan import ParamPlan, ShardingPlan
from models import tiny_config

TOL = 1e-5
# 9 query heads in 3 kv groups (head_dim 8), MLP width 100, vocabulary 1001: none divides by 2, two by 3
UNEVEN = dict(hidden_size=72, num_attention_heads=9, num_key_value_heads=3, intermediate_size=100, vocab_size=1001)
LAYERS = 2


def _config(family: str):
    if family == "llama":
        return tiny_config("llama", **UNEVEN)
    if family == "llama-mqa":  # one kv head, shared by both ranks (replicated); 3 query heads split 2/1
        return tiny_config("llama", hidden_size=48, num_attention_heads=3, num_key_value_heads=1,
                           intermediate_size=100, vocab_size=1001)
    if family == "qwen3-tied":  # q/k norms over head_dim, embedding tied to lm_head
        return tiny_config("qwen3", head_dim=8, tie_word_embeddings=True, **UNEVEN)
    if family == "phi3":  # fused qkv_proj and gate_up_proj: segmented and uneven
        from transformers import Phi3Config

        return Phi3Config(num_hidden_layers=LAYERS, max_position_embeddings=64, pad_token_id=0, eos_token_id=1,
                          bos_token_id=1, **UNEVEN)
    raise KeyError(family)


def per_token_all_reduces(plan: ShardingPlan, direction: str) -> int:
    """All-reduces of activations (per token), not the once-per-step reductions of parameter gradients."""
    return sum(c.count for c in plan.collectives if c.kind == "all_reduce" and c.direction == direction
               and not c.bytes_per_call)


# ---- the layout, the plan's record of it, and what stays impossible (no processes) ----------

def test_layout_splits_whole_kv_groups_columns_and_rows():
    two = ShardLayout.for_config(_config("llama"), 2)
    assert two.sizes(3) == (2, 1) and two.sizes(3 * 8) == (16, 8)  # kv heads, k/v rows
    assert two.sizes(9) == (6, 3) and two.sizes(9 * 8) == (48, 24)  # query heads stay with their kv head
    assert two.sizes(1001) == (501, 500) and two.sizes(100) == (50, 50)
    three = ShardLayout.for_config(_config("llama"), 3)
    assert three.sizes(100) == (34, 34, 32) and three.sizes(1001) == (334, 334, 333) and three.sizes(9) == (3, 3, 3)
    assert [three.start(100, r) for r in range(3)] == [0, 34, 68]
    # torch.chunk would leave ranks empty (9 rows at tp=8: 2/2/2/2/1/0/0/0): the first ranks one more
    assert ShardLayout.for_config(tiny_config("llama", intermediate_size=9, hidden_size=64), 8).sizes(9) == (2,) + (1,) * 7
    # kv heads replicated (tp a multiple of them): each kv head's query heads over its ranks
    mqa = ShardLayout.for_config(tiny_config("llama", hidden_size=144, num_attention_heads=9, num_key_value_heads=3), 6)
    assert mqa.sizes(9) == (2, 1, 2, 1, 2, 1) and mqa.sizes(3) is None
    # kv heads replicated, tp not a multiple of them: runs of whole query heads (one may span two kv heads)
    gqa = ShardLayout.for_config(tiny_config("llama", hidden_size=48, num_attention_heads=6, num_key_value_heads=3), 4)
    assert gqa.sizes(6) == (2, 2, 1, 1) and gqa.sizes(48) == (16, 16, 8, 8) and gqa.sizes(3) is None
    assert ShardLayout.from_dict(2, two.to_dict()) == two


def test_uneven_shard_pieces_cover_every_row_once():
    # a fused q/k/v weight of 9 + 3 + 3 heads (head_dim 2) split 2/1 kv groups over 2 ranks
    split = ((12, 6), (4, 2), (4, 2))
    p = ParamPlan("qkv.weight", (30, 3), "S(0)[18,6,6]", "fused", (), split)
    full = torch.arange(90).view(30, 3)
    assert shard_pieces(30, 1, 2, (18, 6, 6), split) == [(12, 18), (22, 24), (28, 30)]
    assert [p.local_shape(2, r) for r in range(2)] == [(20, 3), (10, 3)]
    with pytest.raises(ValueError, match="split unevenly .*12/6\\|4/2\\|4/2.*depends on the rank"):
        p.local_shape(2)
    rows = torch.cat([p.shard_of(full, r, 2) for r in range(2)])
    assert sorted(rows[:, 0].tolist()) == full[:, 0].tolist()


def test_plan_records_uneven_splits_in_print_and_json():
    plan = ShardingPlan("llama", 2, params=[ParamPlan("q.weight", (72, 72), "S(0)", "column", (), ((48, 24),)),
                                            ParamPlan("n.weight", (72,), "R", "replicated")],
                        uneven={9: (6, 3), 72: (48, 24)})
    assert ShardingPlan.from_json(plan.to_json()) == plan
    text = str(plan)
    assert "S(0) 48/24" in text and "9: 6/3, 72: 48/24" in text
    assert "parameter memory per rank: 0.01, 0.01 MiB" in text
    assert plan.param_bytes_per_rank(4, 0) == (48 * 72 + 72) * 4 and plan.param_bytes_per_rank(4) == (48 * 72 + 72) * 4


@pytest.mark.parametrize("overrides, tp, message", [
    (dict(hidden_size=96, num_attention_heads=12, num_key_value_heads=4, intermediate_size=12), 16,
     r"tp size 16 is larger than num_attention_heads=12 \(attention heads\): a rank would hold none; the heads "
     r"split model\.layers\.\{0-1\}\.self_attn\.q_proj\.weight \(dim 0\), "
     r"model\.layers\.\{0-1\}\.self_attn\.o_proj\.weight \(dim 1\); tp size 16 is larger than intermediate_size=12"),
    (dict(num_attention_heads=2, num_key_value_heads=2, hidden_size=64), 4,
     r"tp size 4 is larger than num_attention_heads=2 \(attention heads\): a rank would hold none"),
])
def test_what_stays_impossible_is_refused_before_capture(overrides, tp, message):
    import fxparallel

    with pytest.raises(ShardingError, match=message):
        fxparallel.plan_model(tiny_config("llama", **overrides), tp)


def test_too_many_ranks_for_the_heads_lists_only_what_the_heads_split():
    """The refusal names the weights a head split cuts (q / k / v by their output, the output projection by
    its input), not every weight that happens to be heads x head_dim wide: the embedding width and k_proj's
    input are the hidden size (before: 'model.embed_tokens.weight (dim 1), ..., k_proj.weight (dim 1)')."""
    import fxparallel
    from transformers import GPT2Config, Phi3Config

    def refusal(config) -> str:
        with pytest.raises(ShardingError) as caught:
            fxparallel.plan_model(config, 8)
        return str(caught.value)

    heads = "tp size 8 is larger than num_attention_heads=4 (attention heads): a rank would hold none; the heads split "
    layers = "model.layers.{0-1}.self_attn."
    # as many kv heads as heads: q, k and v are split by heads
    text = refusal(tiny_config("llama", num_attention_heads=4, num_key_value_heads=4))
    assert heads + ", ".join(f"{layers}{p}_proj.weight (dim {d})" for p, d in (("q", 0), ("k", 0), ("v", 0), ("o", 1))
                             ) + ". Uneven splits" in text, text
    # GQA: k and v have 2 heads (kv heads can be replicated): only q and o
    text = refusal(tiny_config("llama", num_attention_heads=4, num_key_value_heads=2))
    assert heads + f"{layers}q_proj.weight (dim 0), {layers}o_proj.weight (dim 1). Uneven" in text, text
    assert "embed_tokens" not in text and "(dim 1), model.layers.{0-1}.self_attn.k_proj" not in text
    # GPT-2's Conv1D (weight [in, out]) and Phi-3, whose o_proj is registered before its fused qkv_proj
    text = refusal(GPT2Config(vocab_size=128, n_embd=64, n_layer=2, n_head=4))
    assert heads + "transformer.h.{0-1}.attn.c_attn.weight (dim 1), transformer.h.{0-1}.attn.c_proj.weight (dim 0)." \
        in text, text
    text = refusal(Phi3Config(vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                              num_key_value_heads=2, intermediate_size=128, pad_token_id=0))
    assert heads + f"{layers}o_proj.weight (dim 1), {layers}qkv_proj.weight (dim 0)." in text, text


def test_mlp_widths_under_every_config_name_split_unevenly():
    """The MLP width is ``intermediate_size`` in most configs, but OPT's ``ffn_dim``, GPT-2 / GPT-BigCode's
    ``n_inner``, Falcon's ``ffn_hidden_size`` and MoE expert widths name it too; left out, tp that does not
    divide them could only replicate the MLP or shard the residual stream around it."""
    from transformers import FalconConfig, GPTBigCodeConfig, OPTConfig, Qwen2MoeConfig

    from fxparallel.plan.layout import mlp_widths

    configs = [OPTConfig(ffn_dim=130), GPTBigCodeConfig(n_inner=130), FalconConfig(ffn_hidden_size=130),
               Qwen2MoeConfig(intermediate_size=256, moe_intermediate_size=130, shared_expert_intermediate_size=70)]
    for config in configs:
        assert 130 in mlp_widths(config).values(), type(config).__name__
        assert ShardLayout.for_config(config, 4).sizes(130) == (33, 33, 33, 31), type(config).__name__
    assert ShardLayout.for_config(configs[-1], 4).sizes(70) == (18, 18, 18, 16)
    assert "n_inner" not in mlp_widths(GPTBigCodeConfig())  # None: 4 x hidden, set by the model


def test_an_uneven_mlp_width_named_n_inner_keeps_megatrons_plan():
    """GPT-BigCode with n_inner=130 at tp=4: c_fc / c_proj split 33/33/33/31 by columns / rows, the same
    plan as an even width; the forward has no gather besides the cross-entropy statistics (before, it
    sharded the hidden dim: 4 gathers and 13 backward all-reduces)."""
    import fxparallel
    from transformers import GPTBigCodeConfig

    config = GPTBigCodeConfig(n_embd=64, n_head=4, n_inner=130, n_layer=LAYERS, vocab_size=256, n_positions=64)
    plan, _ = fxparallel.plan_model(config, 4)
    for i in range(LAYERS):
        assert plan.param(f"transformer.h.{i}.mlp.c_fc.weight").split == ((33, 33, 33, 31),)
        assert str(plan.param(f"transformer.h.{i}.mlp.c_proj.weight").placement) == "S(1)"
    assert plan.count("all_gather", "forward") == 1 and not plan.fallbacks
    # per token: Megatron's 2L+1 (the whole k/v rows' weight gradient is summed once per step besides)
    assert per_token_all_reduces(plan, "backward") == 2 * LAYERS + 1


def test_dtensor_checkpoints_refuse_uneven_shards_not_in_chunk_sizes():
    from torch.distributed.tensor import Shard

    from fxparallel.runtime.dtensor import tp_placement

    with pytest.raises(NotImplementedError, match="uneven shard.*48/24.*torch.chunk"):
        tp_placement(ParamPlan("q.weight", (72, 72), "S(0)", "column", (), ((48, 24),)))
    with pytest.raises(NotImplementedError, match="uneven shard.*33/33/32/32"):  # the first ranks one row more
        tp_placement(ParamPlan("pos.weight", (130, 64), "S(0)", "vocab", (), ((33, 33, 32, 32),)))
    # torch.chunk's sizes are what DTensor's Shard means (the checkpoint round trip: test_fused_checkpoint.py)
    assert tp_placement(ParamPlan("pos.weight", (130, 64), "S(0)", "vocab", (), ((33, 33, 33, 31),))) == Shard(0)


def test_learned_position_table_tp_does_not_divide_is_vocab_parallel():
    """OPT's 2048 + 2 positions at tp=4: split by rows in torch.chunk's sizes. Split on the hidden
    dim instead (the only even split), it sharded the residual stream: 3 all-gathers per layer."""
    import fxparallel
    from transformers import OPTConfig

    config = OPTConfig(hidden_size=64, num_attention_heads=4, ffn_dim=128, num_hidden_layers=LAYERS,
                       vocab_size=256, word_embed_proj_dim=64, max_position_embeddings=2048)
    plan, _ = fxparallel.plan_model(config, 4)
    positions = plan.param("model.decoder.embed_positions.weight")
    assert (str(positions.placement), positions.split) == ("S(0)", ((513, 513, 513, 511),))
    assert plan.uneven == {2050: (513, 513, 513, 511)}
    assert plan.count("all_gather", "forward") == 1  # only the vocab-parallel cross-entropy's statistics
    assert plan.count("all_reduce", "forward") == plan.count("all_reduce", "backward") == 2 * LAYERS + 1
    assert not plan.fallbacks


# ---- numerics on real gloo ranks ------------------------------------------------------------

@pytest.fixture(scope="module")
def uneven_checkpoints(tmp_path_factory):
    from models import save_checkpoint

    root = tmp_path_factory.mktemp("uneven")
    return {f: save_checkpoint(_config(f), str(root / f)) for f in ("llama", "llama-mqa", "qwen3-tied", "phi3")}


def _compare(rank, tp, paths):
    import torch.distributed as dist

    import fxparallel
    from checks import batch, compare
    from models import reference

    results = {}
    for family, path in paths.items():
        model, ref = fxparallel.parallelize(path, dist.group.WORLD, dtype=torch.float32), reference(path)
        r = compare(model, ref, rank, tp, gather_logits=True)
        # a loss on the gathered logits: the uneven all-gather's backward hands each rank its rows
        ids = batch(1001, seed=2)
        for m in (model, ref):
            m.zero_grad()
        out = model(input_ids=ids, labels=ids, gather_logits=True)
        out.logits.pow(2).mean().backward()
        ref(input_ids=ids).logits.pow(2).mean().backward()
        ref_params = dict(ref.named_parameters())
        r["gathered_grad"] = max((p.grad - model.plan.param(n).shard_of(ref_params[n].grad, rank, tp)).abs().max().item()
                                 for n, p in model.named_parameters())
        r["vocab_range"], r["local_vocab"] = out.vocab_range, out.local_logits.shape[-1]
        r["shapes"] = {n: tuple(p.shape) for n, p in model.named_parameters()}
        r["plan"] = model.plan.to_dict()
        results[family] = r
    return results


@pytest.mark.parametrize("tp, families", [(2, ("qwen3-tied", "phi3", "llama-mqa")), (3, ("llama",))])
def test_uneven_models_match_single_device(uneven_checkpoints, tp, families):
    per_rank = run_ranks(tp, _compare, {f: uneven_checkpoints[f] for f in families})
    for family in families:
        for rank, results in enumerate(per_rank):
            r = results[family]
            assert max(r["loss"], r["logits"], r["grad"], r["gathered_grad"]) < TOL, (family, rank, r)
        ranges = [results[family]["vocab_range"] for results in per_rank]
        assert ranges == {2: [(0, 501), (501, 1001)], 3: [(0, 334), (334, 668), (668, 1001)]}[tp]
        assert [results[family]["local_vocab"] for results in per_rank] == [b - a for a, b in ranges]
        plan = ShardingPlan.from_dict(per_rank[0][family]["plan"])
        assert all(results[family]["plan"] == per_rank[0][family]["plan"] for results in per_rank)
        assert plan.fallbacks == [], plan.fallbacks
        if family != "llama-mqa":  # Megatron's 2L+1 all-reduces of activations each way, uneven or not
            for direction in ("forward", "backward"):
                assert per_token_all_reduces(plan, direction) == 2 * LAYERS + 1, (family, direction)
        # every rank's parameters have that rank's sizes
        for rank, results in enumerate(per_rank):
            for p in plan.params:
                assert results[family]["shapes"][p.name] == p.local_shape(tp, rank), (family, p.name, rank)
    shapes = [results[families[0]]["shapes"] for results in per_rank]
    if tp == 2:  # qwen3: 6 + 3 query heads and 2 + 1 kv heads of head_dim 8
        assert [s["model.layers.0.self_attn.q_proj.weight"] for s in shapes] == [(48, 72), (24, 72)]
        assert [s["model.layers.0.self_attn.k_proj.weight"] for s in shapes] == [(16, 72), (8, 72)]
        phi3 = ShardingPlan.from_dict(per_rank[0]["phi3"]["plan"]).param("model.layers.0.self_attn.qkv_proj.weight")
        assert (str(phi3.placement), phi3.split) == ("S(0)[72,24,24]", ((48, 24), (16, 8), (16, 8)))
    else:  # llama: MLP 34/34/32 (torch.chunk sizes)
        assert [s["model.layers.0.mlp.down_proj.weight"] for s in shapes] == [(72, 34), (72, 34), (72, 32)]
