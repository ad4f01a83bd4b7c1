"""Architectures without a transformers tp plan, parallelized automatically: fused q/k/v (GPT-2's
Conv1D c_attn, Phi-3's qkv_proj and gate_up_proj, GPT-NeoX/Bloom/Falcon head-interleaved layouts),
row-layer biases, ALiBi, partial rotary, MoE. Loss, logits and every gradient vs one device (1e-5).

Every case runs in one spawned group of 4 ranks (``_every_case``): the TP=4 types and DeepSeek-V2's generate (its
latent KV cache) on all four, then the TP=2 and the data-dependent types on ranks 0-1; the tests assert its
results."""
from __future__ import annotations

import os
import sys

import pytest

from distributed import run_ranks

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))

# the ten types the coverage issue names, plus MoE Mixtral, OLMo-2 (q/k norm over all heads) and GPT-OSS
# (experts' gate and up interleaved: gate_up[..., ::2], gate_up[..., 1::2]) (fused Phi-3: at TP=4)
# and Mamba, split by channels: in_proj by column (its x and gate halves as segments, found through the
# transpose before the chunk), the depthwise conv and the scan (torch.vmap traced inline) per channel,
# x_proj and out_proj by row; Mamba-2 by heads: in_proj by column in five segments (z, and x, B, C found through
# the depthwise conv before their own split, dt), B and C by groups, the chunked scan's einsums per head
# the gated delta nets of Qwen3.5 (q, k, v in one projection, split past the convolution) and Qwen3-Next (q, k, v
# and z interleaved per key head, joined again before the convolution) by heads, the chunked rule per head
TP2 = ("gpt2", "opt", "bloom", "falcon", "gptj", "gpt_neo", "gpt_bigcode", "codegen", "mpt", "stablelm", "mixtral",
       "olmo2", "gpt_oss", "mamba", "mamba2", "bamba-one-group", "qwen3_5_text", "qwen3_next")
# at TP=4 also 3 kv heads over 4 ranks (transformers' tp plan crashes in view here): the kv heads are
# replicated; 6 query heads split 2/2/1/1, so rank 1 uses query heads 2 and 3, of kv heads 1 and 2
# and Falcon (x @ W.T) with an MLP width tp=4 does not divide (130: 33/33/33/31), its multi-query k and v whole
TP4 = ("phi3", "llama-kv3", "falcon-ffn130")  # OPT at TP=4: tests/test_sequence_parallel.py
CONFIGS = {"llama-kv3": ("llama", dict(hidden_size=48, num_attention_heads=6, num_key_value_heads=3, head_dim=8)),
           # Mamba-2 layers of one group (as released Bamba, Granite-4, Falcon-H1): B and C whole on every rank
           "bamba-one-group": ("bamba", dict(hidden_size=128, mamba_d_state=16, mamba_d_head=32)),
           "falcon-ffn130": ("falcon", dict(ffn_hidden_size=130))}


@pytest.fixture(scope="module")
def arch_checkpoints(tmp_path_factory):
    from models import save_checkpoint
    from tiny_configs import tiny_config

    root = tmp_path_factory.mktemp("archs")
    return {t: save_checkpoint(tiny_config(CONFIGS.get(t, (t,))[0], **CONFIGS.get(t, (t, {}))[1]), str(root / t))
            for t in sorted(set(TP2) | set(TP4))}


@pytest.fixture(scope="module")
def arch_checkpoints_extra(tmp_path_factory):
    from models import save_checkpoint
    from tiny_configs import tiny_config

    root = tmp_path_factory.mktemp("archs_extra")
    types = ("jetmoe", "cpmant", "recurrent_gemma", "xlm", "rwkv")
    # RecurrentGemma's recurrent block after its attention layer: what attention gives a padding token enters the
    # block's states (its generate, below)
    overrides = {"recurrent_gemma": dict(block_types=["attention", "recurrent"])}
    return {t: save_checkpoint(tiny_config(t, **overrides.get(t, {})), str(root / t)) for t in types}


@pytest.fixture(scope="module")
def latent_cache_checkpoint(tmp_path_factory):
    from models import save_checkpoint
    from tiny_configs import tiny_config

    return save_checkpoint(tiny_config("deepseek_v2"), str(tmp_path_factory.mktemp("latent_cache")))


def _every_case(rank, world, tp4_paths, tp2_paths, extra_paths, latent_cache_path):
    """The TP=4 types and DeepSeek-V2's generate on all four ranks; then, on ranks 0-1 (a group of their own), the
    TP=2 types and the data-dependent ones, while ranks 2-3 wait (two busy ranks at a time suit a two-core machine).
    Every rank waits for the others at the end (rank 0 hosts the store the agreement points use)."""
    import datetime

    import torch.distributed as dist

    pair = dist.new_group([0, 1])  # every rank creates every group
    done = dist.new_group(list(range(world)), timeout=datetime.timedelta(hours=1))
    out = {4: _check_all(dist.group.WORLD, 4, tp4_paths), "latent cache": _latent_cache(latent_cache_path)}
    if rank < 2:
        out[2] = _check_all(pair, 2, tp2_paths)
        out["data-dependent"] = _data_dependent(pair, 2, extra_paths)
    dist.barrier(group=done)
    return out


@pytest.fixture(scope="module")
def on_ranks(arch_checkpoints, arch_checkpoints_extra, latent_cache_checkpoint):
    """Per case (4, 2, "data-dependent", "latent cache"): the results of each of its ranks, in tp-rank order."""
    per_rank = run_ranks(4, _every_case, {t: arch_checkpoints[t] for t in TP4}, {t: arch_checkpoints[t] for t in TP2},
                         arch_checkpoints_extra, latent_cache_checkpoint, timeout=1800)
    return {case: [r[case] for r in per_rank if case in r] for case in (4, 2, "data-dependent", "latent cache")}


def _check_all(group, tp, paths):
    import warnings

    import torch

    warnings.filterwarnings("ignore")
    import fxparallel
    from checks import batch, compare
    from fxparallel.capture.spec import EXAMPLE_SEQ
    from models import reference

    results = {}
    for name, path in paths.items():
        model = fxparallel.parallelize(path, group, dtype=torch.float32)
        # Mamba's scan makes a graph per length: checked at the length parallelize captured its graph at (any
        # other length would capture a second graph just for this check)
        ids = batch(model.config.vocab_size, s=EXAMPLE_SEQ if name == "mamba" else 9)
        errors = compare(model, reference(path), model.tp_group.rank, tp, ids=ids, gather_logits=True)
        plan = model.plan
        results[name] = {k: errors[k] for k in ("loss", "logits", "grad")}
        results[name]["sharded_matrices"] = sum(1 for p in plan.params
                                                if len(p.shape) >= 2 and not p.placement.is_replicate)
        results[name]["replicated"] = [p.name for p in plan.params if len(p.shape) >= 2 and p.placement.is_replicate]
        results[name]["segmented"] = sorted({p.name.split(".")[-2] for p in plan.params if "[" in str(p.placement)})
        results[name]["fallbacks"] = list(plan.fallbacks)
        results[name]["splits"] = {p.name: (str(p.placement), p.split) for p in plan.params if p.split}
        results[name]["placements"] = {p.name: str(p.placement) for p in plan.params}
        results[name]["forward_all_reduces"] = sum(c.count for c in plan.collectives
                                                   if c.kind == "all_reduce" and c.direction == "forward")
        results[name]["layer_collectives"] = [(c.kind, c.direction, c.bytes_per_token) for c in plan.collectives
                                              if ".layers." in c.where or ".h." in c.where]
        results[name]["layer_forward_calls"] = sum(c.count for c in plan.collectives if c.direction == "forward"
                                                   and (".layers." in c.where or ".h." in c.where))
        results[name]["layer_gathers"] = [(c.where, c.bytes_per_token) for c in plan.collectives
                                          if c.kind == "all_gather" and ".layers." in c.where]
        results[name]["reduced_weights"] = [c.where for c in plan.collectives if c.bytes_per_call]
    return results


@pytest.mark.timeout(1800)  # the first test to run sets the fixture up: every case's ranks
@pytest.mark.parametrize("tp, types", [(2, TP2), (4, TP4)])
def test_architectures_without_transformers_plan(on_ranks, tp, types):
    assert len(on_ranks[tp]) == tp
    for results in on_ranks[tp]:
        for name in types:
            r = results[name]
            for key in ("loss", "logits", "grad"):
                assert r[key] < 1e-5, (name, tp, key, r)
            assert r["sharded_matrices"] > 0, (name, "nothing was sharded")
            # nothing gathered for want of a rule (Bloom's custom autograd GeLU runs on shards)
            assert r["fallbacks"] == [], (name, r["fallbacks"])
        if tp == 2:
            # multi-query c_attn: q split by head, the single k and v head kept whole on every rank, so
            # attention needs no gather (2 all-reduces per layer forward, as for multi-head attention);
            # the whole rows' weight gradient (weight and bias) is summed once per step, not per token
            mqa = results["gpt_bigcode"]["layer_collectives"]
            assert not [c for c in mqa if c[0] == "all_gather"], mqa
            assert len([c for c in mqa if c[1] == "forward"]) == 2, mqa
            assert [c for c in mqa if c[2] == 0.0] == [("all_reduce", "backward", 0.0)] * 2, mqa
            # Falcon-7B's multi-query query_key_value (x @ W.T, viewed as [heads + 2, head_dim], k and v
            # picked by list index) likewise; attention and MLP run in parallel: one all-reduce per layer
            falcon = results["falcon"]["layer_collectives"]
            assert "query_key_value" in results["falcon"]["segmented"], results["falcon"]
            assert not [c for c in falcon if c[0] == "all_gather"], falcon
            assert [c for c in falcon if c[1] == "forward"] == [("all_reduce", "forward", 256.0)], falcon
            assert results["falcon"]["layer_forward_calls"] == 2, falcon  # 2 layers
            # learned positions: the vocab-parallel token and position embeddings are added as partial sums
            # and reduced once, Megatron's 2L+1 (was 2L+2: one all-reduce each)
            for name in ("gpt2", "gpt_neo", "gpt_bigcode"):
                assert results[name]["forward_all_reduces"] == 2 * 2 + 1, (name, results[name])
            # GPT-OSS: the interleaved gate_up splits by columns like any column layer (each rank's block holds
            # whole gate/up pairs, so the strided slices run on it as they are); Megatron's 2L+1 forward
            oss = results["gpt_oss"]
            assert {n.rsplit(".", 1)[-1]: v for n, v in oss["placements"].items() if ".layers.0.mlp.experts." in n} == \
                {"gate_up_proj": "S(2)", "down_proj": "S(1)", "gate_up_proj_bias": "R", "down_proj_bias": "R"}, oss
            assert oss["forward_all_reduces"] == 2 * 2 + 1 and not oss["layer_gathers"], oss
            # OLMo-2 normalises q and k over all heads: a partial sum of squares and a 4-byte all-reduce
            # per token, never a gather of the projection
            olmo = results["olmo2"]["layer_collectives"]
            assert not [c for c in olmo if c[0] == "all_gather"], olmo
            assert sorted(c for c in olmo if c[2] < 8) == [("all_reduce", "backward", 4.0)] * 2 + \
                [("all_reduce", "forward", 4.0)] * 2, olmo
            # Mamba: two all-reduces per layer forward (x_proj's dt/B/C, 80 floats, and out_proj's output), no
            # gather: in_proj, dt_proj, the conv and the scan run on this rank's channels
            mamba = results["mamba"]
            assert [c[:2] for c in mamba["layer_collectives"] if c[1] == "forward"] == [("all_reduce", "forward")] * 2
            assert mamba["layer_forward_calls"] == 2 * 2 and not mamba["layer_gathers"], mamba
            assert {n.split(".mixer.")[-1]: v for n, v in mamba["placements"].items()
                    if ".layers.0.mixer." in n and n.endswith("proj.weight")} == \
                {"in_proj.weight": "S(0)[128,128]", "x_proj.weight": "S(1)", "dt_proj.weight": "S(0)",
                 "out_proj.weight": "S(1)"}, mamba["placements"]
            # the depthwise convolutions' weights (squeezed before the conv) split as their channels are
            assert mamba["placements"]["backbone.layers.0.mixer.conv1d.weight"] == "S(0)", mamba["placements"]
            # Mamba-2 (8 heads, 8 groups): one all-reduce per layer forward (out_proj's), no gather; the gated
            # norm's groups lie within a rank's heads
            mamba2 = results["mamba2"]
            assert [c[:2] for c in mamba2["layer_collectives"] if c[1] == "forward"] == [("all_reduce", "forward")]
            assert mamba2["layer_forward_calls"] == 2 and not mamba2["layer_gathers"], mamba2
            assert {n.split(".mixer.")[-1]: v for n, v in mamba2["placements"].items()
                    if ".layers.0.mixer." in n and n.endswith("proj.weight")} == \
                {"in_proj.weight": "S(0)[128,128,1024,1024,8]", "out_proj.weight": "S(1)"}, mamba2["placements"]
            assert mamba2["placements"]["backbone.layers.0.mixer.conv1d.weight"] == "S(0)[128,1024,1024]"
            assert not [w for w in mamba2["reduced_weights"] if "conv1d" in w], mamba2["reduced_weights"]
            # dt_bias, cast before it is added to dt's shards (rules/weight_ahead.py): split by heads like dt
            assert mamba2["placements"]["backbone.layers.0.mixer.dt_bias"] == "S(0)"
            assert not [w for w in mamba2["reduced_weights"] if "dt_bias" in w], mamba2["reduced_weights"]
            # Mamba-2 of one group: B and C (16 floats each) whole on every rank, x, z and dt by heads; C B^T and the
            # scan's products of B and C per head keep partial gradients back to the whole rows, summed once per step
            # at in_proj's weight (and the conv's): no per-token reduction for them, the mixer's forward one all-reduce
            one = results["bamba-one-group"]
            assert {n.split(".mamba.")[-1]: v for n, v in one["placements"].items()
                    if ".layers.0.mamba." in n and n.endswith("proj.weight")} == \
                {"in_proj.weight": "S(0)[256,256,16R,16R,8]", "out_proj.weight": "S(1)"}, one["placements"]
            assert not one["layer_gathers"], one
            assert [c for c in one["layer_collectives"] if c[1] == "backward" and c[2] > 8] == \
                [("all_reduce", "backward", 512.0)] * 3, one["layer_collectives"]
            # gated delta nets by heads: the projections by column (Qwen3.5's q, k, v as three segments), the
            # convolution and the chunked rule (its triangular solve included) on this rank's heads, the gated norm
            # on its heads merged with the tokens, out_proj by row: no gather, one all-reduce per mixer forward
            for name, fused, split in (("qwen3_5_text", "in_proj_qkv", "S(0)[2048,2048,4096]"),
                                       ("qwen3_next", "in_proj_qkvz", "S(0)")):
                gdn = results[name]
                mixer = {n.split(".linear_attn.")[-1]: v for n, v in gdn["placements"].items()
                         if ".layers.0.linear_attn." in n}
                assert mixer[f"{fused}.weight"] == split and mixer["out_proj.weight"] == "S(1)", (name, mixer)
                # the convolution's weight (squeezed before the conv reads q, k, v) split as its channels are:
                # no per-step all-reduce of its gradient
                assert mixer["conv1d.weight"] == "S(0)[2048,2048,4096]", (name, mixer)
                assert not [w for w in gdn["reduced_weights"] if "conv1d" in w], (name, gdn["reduced_weights"])
                assert not [w for w, _ in gdn["layer_gathers"] if ".linear_attn" in w] and not gdn["fallbacks"], \
                    (name, gdn["layer_gathers"], gdn["fallbacks"])
            # Bloom flattens batch and heads into one dim for baddbmm/bmm: the heads stay sharded there
            # (a blocked shard), so attention needs no gather: 2 all-reduces per layer each way
            bloom = results["bloom"]["layer_collectives"]
            assert not [c for c in bloom if c[0] == "all_gather"], bloom
            assert len([c for c in bloom if c[1] == "forward"]) == 2, bloom
        if tp == 4:
            assert {"qkv_proj", "gate_up_proj"} <= set(results["phi3"]["segmented"])  # split per part at TP=4 too
            # attention runs on this rank's query heads: only the (small) k and v are gathered, never q
            # (3 kv heads of 8 floats: k and v are 24 floats = 96 bytes per token)
            kv = results["llama-kv3"]["layer_gathers"]
            assert sorted(w.rsplit(".", 1)[-1] for w, _ in kv) == ["k_proj", "v_proj"], kv
            assert all(b == 96 for _, b in kv), kv
            falcon = results["falcon-ffn130"]
            assert [c for c in falcon["layer_collectives"] if c[1] == "forward"] == [("all_reduce", "forward", 256.0)]
            assert falcon["layer_forward_calls"] == 2 and not falcon["layer_gathers"], falcon
            mlp = {n.split(".", 3)[-1]: v for n, v in falcon["splits"].items() if ".h.0.mlp" in n}
            assert mlp == {"mlp.dense_h_to_4h.weight": ("S(0)", ((33, 33, 33, 31),)),
                           "mlp.dense_4h_to_h.weight": ("S(1)", ((33, 33, 33, 31),))}, falcon["splits"]
        else:
            # fused projections are split per part, not gathered; every matrix of the ten is split
            assert "c_attn" in results["gpt2"]["segmented"]
            assert {n: results[n]["replicated"] for n in TP2[:10] if results[n]["replicated"]} == {}


def _latent_cache(path):
    """DeepSeek-V2 at TP=4 generates transformers' greedy tokens (a left-padded batch of 2): its cache holds the
    compressed latent (one "head" of kv_lora_rank), written whole by every layer and read by the row-parallel
    kv_b_proj. (It was planned split in layer 1 only, and the prompt's graph wrote a whole latent into a quarter.)"""
    import torch
    import torch.distributed as dist

    import fxparallel
    from checks import left_padded_prompts
    from models import reference

    model = fxparallel.parallelize(path, dist.group.WORLD, dtype=torch.float32)
    ids, mask = left_padded_prompts()
    kwargs = dict(attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=0,
                  return_dict_in_generate=True)
    got = model.generate(input_ids=ids, **kwargs)
    expected = reference(path).generate(input_ids=ids, **kwargs)
    return {"tokens": got.sequences.tolist(), "expected": expected.sequences.tolist(),
            "keys": {name: (full, local) for name, (full, local, _) in got.past_key_values.layout.items()
                     if name.endswith("_keys")}}


def test_latent_kv_cache_generates_at_tp4(on_ranks):
    assert len(on_ranks["latent cache"]) == 4
    for r in on_ranks["latent cache"]:
        assert r["tokens"] == r["expected"], r
        assert len(r["keys"]) == 2 and all(full == local for full, local in r["keys"].values()), r["keys"]


def _data_dependent(group, tp, paths):
    import warnings

    import torch

    warnings.filterwarnings("ignore")
    import fxparallel
    from checks import batch, compare
    from models import reference

    results = {}
    for name, path in paths.items():
        # float64: CPM-Ant's fp32 rounding reaches 1e-4 (its logits are large); a wrong plan's error would not
        model = fxparallel.parallelize(path, group, dtype=torch.float64)
        ids = batch(model.config.vocab_size, b=2, s=9)
        single = reference(path).to(torch.float64)
        # (use_cache=False: RWKV's own training step with its cached state modifies a tensor saved for backward)
        errors = compare(model, single, model.tp_group.rank, tp, ids=ids, gather_logits=True, use_cache=False)
        shorter = batch(model.config.vocab_size, b=2, s=7, seed=3)
        with torch.no_grad():
            errors["other length"] = (model(input_ids=shorter).logits
                                      - single(input_ids=shorter).logits).abs().max().item()
        results[name] = {k: errors[k] for k in ("loss", "logits", "grad", "other length")}
        results[name]["graphs"] = len(model.graphs())
        results[name]["fallbacks"] = model.plan.to_dict()["fallbacks"]
        if name == "recurrent_gemma":
            results[name]["generate"] = _generate_with_module_states(model, single)
    return results


def _generate_with_module_states(model, single):
    """RecurrentGemma's generate from a left-padded batch: tokens and scores against transformers', its graphs
    (the prompt token by token: its code fixes a prompt's length), the collectives of a step, and the share of
    transformers' states (attributes of its modules) this rank keeps in the cache."""
    import torch
    from transformers import CompileConfig

    from checks import left_padded_prompts, raised
    from test_generate_recurrent import _state_bytes

    ids, mask = left_padded_prompts()
    kwargs = dict(input_ids=ids, attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=0,
                  return_dict_in_generate=True, output_scores=True)
    for module in single.modules():  # transformers' states as loaded (the forwards above left theirs set)
        if hasattr(module, "conv1d_state"):
            module.conv1d_state = module.rg_lru.recurrent_states = None
    got, expected = model.generate(**kwargs), single.generate(**kwargs)
    layout = got.past_key_values.layout
    states = {k: v for k, v in layout.items() if "_states_" in k}
    ours = sum(t.numel() * t.element_size() for k, t in got.past_key_values.tensors.items() if k in states)
    generation = [g for g in model.graphs() if g.cache_length]
    # its scan's custom autograd function (SqrtBoundDerivative): a generation graph runs its forward body in its
    # place (capture/custom_forwards.py), so torch.compile traces the steps (compile_config)
    compiled = model.generate(**kwargs, compile_config=CompileConfig(backend="eager", fullgraph=True))
    # eager attention gives a padding token's query an average over every key of the prompt's forward: refused
    model.config._attn_implementation = "eager"
    eager = raised(lambda: model.generate(**kwargs))
    model.config._attn_implementation = "sdpa"
    return {"eager": eager, "tokens": torch.equal(got.sequences, expected.sequences),
            "compiled tokens": torch.equal(compiled.sequences, expected.sequences),
            "compiled scores": max((a - b).abs().max().item() for a, b in zip(compiled.scores, expected.scores)),
            "custom functions": sum(g.code.count("autograd_function_apply") for g in generation),
            "scores": max((a - b).abs().max().item() for a, b in zip(got.scores, expected.scores)),
            "graphs": sorted((g.spec.fresh_cache, g.spec.shape[1], g.spec.token_mask) for g in generation),
            "collectives": {(g.code.count("collectives_all_reduce("), g.code.count("collectives_all_gather("))
                            for g in generation},
            "state share": ours / _state_bytes(expected.past_key_values, single),
            "split states": sum(1 for full, local, _ in states.values() if full != local)}


@pytest.mark.timeout(1800)  # (when run alone, it sets the fixture up)
def test_data_dependent_and_length_fixed_graphs(on_ranks):
    """JetMoE sizes its experts with ``.tolist()`` (unbacked sizes in the graph, which cannot run on meta:
    captured all the same); CPM-Ant builds its position buckets from ``range(seq_len)`` (Dynamo cannot keep
    the length symbolic: a graph per length); RecurrentGemma's scan writes ``states[:, t]`` token by token
    (each write keeps the shard: rules/indexing.py); XLM checks ``lengths.max().item()`` and scales its
    replicated hidden states in place where a copy_to_tp stands (the write gets a copy); RWKV loops over the
    tokens with its recurrent state (a graph per length), its feed-forward sharded through ``torch.relu``.
    All match one device. RecurrentGemma also generates transformers' tokens, its states in the sharded cache."""
    assert len(on_ranks["data-dependent"]) == 2
    for results in on_ranks["data-dependent"]:
        for name, r in results.items():
            for key in ("loss", "logits", "grad", "other length"):
                # (transformers' loss casts the logits to float32: the gradients keep float32 rounding)
                assert r[key] < 1e-5, (name, key, r)
        assert results["cpmant"]["graphs"] == 3, results["cpmant"]  # length 9 with labels, 9 and 7 without
        assert results["rwkv"]["fallbacks"] == [], results["rwkv"]["fallbacks"]  # (torch.relu: elementwise)
        # RecurrentGemma generates with the sharded cache: its recurrent block's states (attributes of its modules in
        # transformers, the cache's here: capture/own_caches.py) split by channels, half on each rank; the prompt
        # token by token through two one-token graphs (a fresh cache's, the next ones'), its padding run through
        # the attention layer and the states as transformers' prompt forward runs it (SDPA; eager refused); a step
        # communicates what the forward does
        rg = results["recurrent_gemma"]["generate"]
        assert rg["tokens"] and rg["scores"] < 1e-9, rg
        assert rg["graphs"] == [(False, 1, False), (True, 1, False)], rg
        assert rg["collectives"] == {(2 * 2 + 1, 0)}, rg  # per layer the block's and the MLP's; the embedding's
        assert rg["state share"] == 0.5 and rg["split states"] == 2, rg
        # compiled steps too: the generation graphs hold the custom function's forward body, not the function
        assert rg["compiled tokens"] and rg["compiled scores"] < 1e-9 and rg["custom functions"] == 0, rg
        assert rg["eager"].startswith("ArgumentError: attention_mask: the prompt has padding, and recurrent_gemma runs "
                                      "padding through its recurrent states with attn_implementation='eager'"), rg
