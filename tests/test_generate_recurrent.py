"""model.generate on models whose cache keeps recurrent states instead of (or beside) keys and values: pure
Mamba, a Mamba-2 hybrid (Bamba), a gated-delta-net hybrid (Qwen3.5), a lightning-attention hybrid whose cache
is a class of its own (MiniMax), a Mamba-attention MoE hybrid (Jamba), and xLSTM (mLSTM states only, in its own
cache class). Greedy tokens equal single-device transformers' from a left-padded batch; two graphs per cache length
(the prompt's, which starts the states, and one token's, which continues them), or where the model's code fixes the
prompt's length (Mamba, Jamba, xLSTM; MiniMax's as Jamba's) the prompt token by token through one-token graphs; another prompt
length adds no graph; a decode step communicates what a forward does (no
gather); each rank keeps the states of the channels / heads it computes (1/TP of transformers' states where the
forward splits the layer); output_scores and sampling as for attention models; a multi-token forward on a cache
already written, a prompt padded on the right and labels where the prompt goes token by token beside attention are
refused by name."""
from __future__ import annotations

import os
import sys

from checks import left_padded_prompts, raised
from distributed import run_ranks

NEW_TOKENS = 8
# generated again at two more prompt lengths: Mamba's and Jamba's prompts, whose graphs are guarded to the prompt's
# length, go token by token from the second (each token given its mask column, or beside attention the whole mask:
# the two ways xLSTM's and MiniMax's prompts take too, from the first and the second), and one whose prompt graph
# serves any length (docs/generation.md; which guards fix the length: tests/unit/test_graph_set.py)
MORE_LENGTHS = ("mamba", "qwen3_5_text", "jamba")


def _state_bytes(cache, model) -> int:
    """Bytes of transformers' cache's convolution and recurrent states (MiniMax's: its ``linear_cache``; xLSTM's:
    its ``rnn_state``; RecurrentGemma's: attributes of ``model``'s modules, tests/test_coverage.py)."""
    import torch

    states = [t for layer in getattr(cache, "layers", []) for field in ("conv_states", "recurrent_states")
              for t in (getattr(layer, field, None) or {}).values()] + list(getattr(cache, "linear_cache", []))
    states += [t for layer in getattr(cache, "rnn_state", {}).values() for t in layer]
    states += [getattr(m, name, None) for m in model.modules() for name in ("conv1d_state", "recurrent_states")]
    return sum(t.numel() * t.element_size() for t in states if isinstance(t, torch.Tensor))


def _generate(rank, tp, paths):
    import torch
    import torch.distributed as dist

    import fxparallel
    from models import reference

    out = {}
    for name, path in paths.items():
        model = fxparallel.parallelize(path, dist.group.WORLD, dtype=torch.float32)
        ref = reference(path)
        ids, mask = left_padded_prompts()
        kwargs = dict(attention_mask=mask, max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0,
                      return_dict_in_generate=True)
        got, expected = model.generate(input_ids=ids, **kwargs), ref.generate(input_ids=ids, **kwargs)
        cache = got.past_key_values
        states = {k: v for k, v in cache.layout.items() if "_states_" in k}
        generation = [g for g in model.graphs() if g.cache_length]
        decode = next(g for g in generation if not g.spec.fresh_cache and not g.spec.token_mask)
        # a forward of many tokens, or where the model's code fixes their number, the prompt's token by token (after
        # the first, given its mask column or, beside attention, the decode step's graph)
        prompt = next((g for g in generation if g.spec.shape[1] > 1), None) or \
            next((g for g in generation if g.spec.token_mask), None) or \
            next(g for g in generation if g.spec.fresh_cache)
        ours = sum(t.numel() * t.element_size() for k, t in cache.tensors.items() if k in states)
        # two more prompt lengths: transformers' tokens, and no graph for the third (Mamba's prompt graph is guarded
        # to its length: the second one runs token by token, as every later one)
        lengths = []
        for length, seed in ((10, 6), (12, 8)) if name in MORE_LENGTHS else ():
            graphs = len(model.graphs())
            more, more_mask = left_padded_prompts(shape=(2, length), seed=seed)
            again = dict(kwargs, attention_mask=more_mask)
            lengths.append((torch.equal(model.generate(input_ids=more, **again).sequences,
                                        ref.generate(input_ids=more, **again).sequences), len(model.graphs()) - graphs))
        generation = [g for g in model.graphs() if g.cache_length]
        out[name] = {
            "tokens": torch.equal(got.sequences, expected.sequences),
            "more lengths": lengths,
            "graphs": sorted((g.spec.fresh_cache, g.spec.shape[1] == 1, g.spec.token_mask) for g in generation),
            "decode collectives": (decode.code.count("collectives_all_reduce("),
                                   decode.code.count("collectives_all_gather(")),
            "prompt collectives": (prompt.code.count("collectives_all_reduce("),
                                   prompt.code.count("collectives_all_gather(")),
            "token collectives": {  # a prompt's token's graphs (the first's on a fresh cache, the next ones')
                (g.code.count("collectives_all_reduce("), g.code.count("collectives_all_gather("))
                for g in generation if g.spec.shape[1] == 1 and g.spec.fresh_cache != g.spec.token_mask},
            "states": len(states),
            "state share": ours / _state_bytes(expected.past_key_values, ref),
            "split states": sum(1 for full, local, _ in states.values() if full != local),
        }
        if name == "xlstm":  # its states continue by the same code: a cache continued by a chunk of tokens
            from transformers.models.xlstm.modeling_xlstm import xLSTMCache

            fresh, theirs = model.new_cache(128), xLSTMCache(ref.config, 2, dtype=torch.float32)
            full_mask = torch.ones(2, 128, dtype=torch.long)
            out["xlstm chunks"] = max(
                (model(input_ids=chunk, attention_mask=full_mask, past_key_values=fresh, use_cache=True,
                       gather_logits=True).logits - ref(input_ids=chunk, cache=theirs, use_cache=True).logits)
                .abs().max().item() for chunk in (ids, ids.flip(1)))  # (the prompt's graph serves both)
        if name == "jamba":  # prompts token by token beside attention: padding on the left only, logits only
            full_mask = torch.cat([mask, mask.new_ones(2, 128 - 7)], dim=1)
            right = full_mask.clone()
            right[0, :7] = torch.tensor([1, 1, 1, 1, 1, 0, 0])
            out["jamba right padded"] = raised(
                lambda: model(input_ids=ids, attention_mask=right, past_key_values=model.new_cache(128)))
            out["jamba labels with a cache"] = raised(
                lambda: model(input_ids=ids, attention_mask=full_mask, labels=ids,
                              past_key_values=model.new_cache(128)))
            # the prompt's logits at its tokens (not its padding) and the next token's, on a cache
            fresh = model.new_cache(128)
            step = model(input_ids=ids, attention_mask=full_mask, past_key_values=fresh, gather_logits=True)
            theirs = ref(input_ids=ids, attention_mask=mask, use_cache=True)
            token = theirs.logits[:, -1].argmax(-1, keepdim=True)
            after = model(input_ids=token, attention_mask=full_mask, past_key_values=fresh, gather_logits=True)
            their_after = ref(input_ids=token, attention_mask=torch.cat([mask, mask.new_ones(2, 1)], 1),
                              past_key_values=theirs.past_key_values, use_cache=True)
            out["jamba prompt logits"] = max((step.logits - theirs.logits)[mask.bool()].abs().max().item(),
                                       (after.logits - their_after.logits).abs().max().item())
        if name == "mamba":  # a hand-written loop: the prompt in the cache's first forward, then one token a call
            fresh = model.new_cache(128)
            full_mask = torch.cat([mask, mask.new_ones(2, 128 - 7)], dim=1)
            step = model(input_ids=ids, attention_mask=full_mask, past_key_values=fresh, use_cache=True)
            token = step.logits[:, -1].argmax(-1, keepdim=True)
            step = model(input_ids=token, attention_mask=full_mask, past_key_values=fresh)
            out["hand-written loop"] = torch.equal(torch.cat([token, step.logits[:, -1].argmax(-1, keepdim=True)], 1),
                                                   expected.sequences[:, 7:9])
            out["chunked continuation"] = raised(lambda: model(input_ids=ids[:, :2], attention_mask=full_mask,
                                                               past_key_values=fresh))
            # output_scores (each step's scores, gathered over the vocabulary) and sampling, as for attention
            scored = dict(kwargs, max_new_tokens=3, output_scores=True)
            got, expected = model.generate(input_ids=ids, **scored), ref.generate(input_ids=ids, **scored)
            out["scores"] = max((a - b).abs().max().item() for a, b in zip(got.scores, expected.scores))
            torch.manual_seed(100 + rank)  # the ranks draw alike whatever their own seeds
            out["sampled"] = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=4, do_sample=True,
                                            top_k=5, pad_token_id=0).tolist()
    return out


def _paths(tmp_path, **configs) -> dict:
    from models import save_checkpoint

    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))
    from tiny_configs import tiny_config

    return {name: save_checkpoint(tiny_config(name, **overrides), str(tmp_path / name))
            for name, overrides in configs.items()}


def test_generate_state_space_and_linear_attention_models(tmp_path):
    """Mamba (every layer a selective scan), Bamba (Mamba-2 layers and attention), Qwen3.5 (gated delta nets
    and attention, as in Qwen3-Next), MiniMax (lightning attention and attention, its cache a class of its own) and
    xLSTM (mLSTM blocks, their states in a cache of its own) at TP=2."""
    # Bamba of one group (B and C whole on every rank), at a width where the solver splits its mixer by heads
    # MiniMax's first layer linear (its cache's length then read past it), the prompt's scan in blocks of 3 tokens
    paths = _paths(tmp_path, mamba={}, bamba=dict(hidden_size=128, mamba_d_state=16, mamba_d_head=32), qwen3_5_text={},
                   minimax=dict(block_size=3, layer_types=["linear_attention", "full_attention"]),
                   xlstm=dict(num_blocks=1, num_hidden_layers=1), jamba={})
    results = run_ranks(2, _generate, paths)
    assert results[0]["sampled"] == results[1]["sampled"]
    by_token = {"mamba": [(True, False, False), (True, True, False), (False, True, True)],
                "xlstm": [(False, True, True)],
                "jamba": [(True, False, False), (True, True, False)]}
    # the graphs the second prompt length adds: Mamba's, its prompt's first token's and the next ones'; Jamba's, the
    # first token's (the next ones' run the decode step's graph: their attention needs the whole mask)
    added = {"mamba": 2, "jamba": 1}
    for out in results:
        assert out["scores"] < 1e-4, out["scores"]
        for name in paths:
            row = out[name]
            assert row["tokens"], (name, row)
            if name in MORE_LENGTHS:
                assert row["more lengths"] == [(True, added.get(name, 0)), (True, 0)], (name, row)
            # the prompt's, then one token's; where the model's code fixes the prompt's length (Mamba's scan guarded to
            # its length, xLSTM's chunks: no graph for any other), prompts run one token at a time, each given its own
            # mask column, the first on a fresh cache (Mamba's: xLSTM runs the same code whether its states start or
            # continue)
            expected = sorted([(False, True, False)] + by_token.get(name, [(True, False, False)]))
            assert row["graphs"] == expected, (name, row)
            # a token communicates what the prompt's forward does
            assert row["decode collectives"] == row["prompt collectives"], (name, row)
            # and so does a prompt's token, where prompts go token by token
            assert row["token collectives"] <= {row["decode collectives"]}, (name, row)
            assert bool(row["token collectives"]) == (name in by_token), (name, row)
            assert row["states"] >= (1 if name == "minimax" else 2), (name, row)
            assert row["decode collectives"][1] == 0, (name, row)
        # MiniMax's lightning-attention state (K^T V per head) by heads: half of it on each rank
        assert out["minimax"]["state share"] == 0.5 and out["minimax"]["split states"] == 1, out["minimax"]
        # xLSTM's mLSTM by heads: half the heads' matrix memory, normalizer and stabilizer (one block: a second
        # adds half a minute to the suite, its forward's plan alone taking 7 s to find)
        assert out["xlstm"]["state share"] == 0.5 and out["xlstm"]["split states"] == 3, out["xlstm"]
        assert out["xlstm chunks"] < 1e-5, out["xlstm chunks"]  # 7 tokens, then 7 more on the written cache
        # Qwen3.5's gated delta net by heads: half of its convolution's channels (of q, k and v each) and half
        # the heads' recurrent states
        assert out["qwen3_5_text"]["state share"] == 0.5 and out["qwen3_5_text"]["split states"] == 2, \
            out["qwen3_5_text"]
        # Mamba's mixers are split by channels: each rank keeps half of every state
        assert out["mamba"]["state share"] == 0.5 and out["mamba"]["split states"] == 4, out["mamba"]
        # Bamba's by heads: half the heads' recurrent states and of x's conv channels, B's and C's (16 each) whole
        conv, recurrent = 2 * (256 + 32) * 4, 2 * 8 * 32 * 16  # transformers' elements: batch x channels x kernel, ...
        assert out["bamba"]["split states"] == 2, out["bamba"]
        assert abs(out["bamba"]["state share"] - (2 * (128 + 32) * 4 + recurrent / 2) / (conv + recurrent)) < 1e-9, \
            out["bamba"]
        assert out["hand-written loop"], out
        assert out["jamba prompt logits"] < 1e-5, out
        assert out["jamba right padded"].startswith(
            "ArgumentError: attention_mask: row(s) [0] of the prompt have padding after a token"), out
        assert out["jamba labels with a cache"].startswith(
            "ArgumentError: labels on a forward of 7 tokens with a cache"), out["jamba labels with a cache"]
        assert out["chunked continuation"].startswith(
            "ShardingError: a forward of 2 tokens on a cache already written, whose linear-attention / state-space "
            "layers keep recurrent states (mamba)"), out["chunked continuation"]


def _uneven(rank, tp, path):
    import torch
    import torch.distributed as dist

    import fxparallel
    from models import reference

    model = fxparallel.parallelize(path, dist.group.WORLD, dtype=torch.float32)
    ref = reference(path)
    ids = torch.randint(3, 200, (2, 5), generator=torch.Generator().manual_seed(5))
    kwargs = dict(max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0, return_dict_in_generate=True)
    got = model.generate(input_ids=ids, **kwargs)
    layout = got.past_key_values.layout
    return {"tokens": torch.equal(got.sequences, ref.generate(input_ids=ids, **kwargs).sequences),
            "channels": [layout[f"past_0_{field}_0"][1][1] for field in ("conv_states", "recurrent_states")],
            "full": [layout[f"past_0_{field}_0"][0][1] for field in ("conv_states", "recurrent_states")]}


def test_generate_mamba_with_channels_split_unevenly(tmp_path):
    """Mamba at TP=3: its 128 channels split unevenly (each rank's states hold its own channels only), the tokens
    transformers' on one device."""
    paths = _paths(tmp_path, mamba={"num_hidden_layers": 1})
    results = run_ranks(3, _uneven, paths["mamba"])
    assert all(r["tokens"] for r in results), results
    assert all(r["full"] == [128, 128] for r in results), results
    assert sorted(r["channels"][0] for r in results) == sorted(r["channels"][1] for r in results), results
    assert sum(r["channels"][0] for r in results) == 128 and len({r["channels"][0] for r in results}) == 2, results
