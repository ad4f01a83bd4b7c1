"""model.generate without a cache (generation/recompute.py): each step a forward over the sequence so far, as
transformers runs with ``use_cache=False`` and for a model with no cache at all. At TP=2 from a left-padded batch,
the greedy tokens equal single-device transformers' ``generate`` for GPT-1 (no cache in transformers either),
RWKV (its own recurrent state, and code that fixes the sequence length; compared with transformers' generate
without a cache: transformers' own one-token steps with RWKV's state differ from its forward over the sequence,
by 0.97 in the second token's logits of this tiny model) and Llama asked ``use_cache=False``, also parallelized
with ``sequence_parallel`` (odd lengths padded to a multiple of tp); a second prompt length adds no graph.
XLNet, whose generate feeds a permutation mask and an appended token, is refused by name, and so is CPM-Ant,
whose code fixes the sequence length (the sequence is then padded) but whose logits read later positions. (A cache
the graphs cannot carry, DeepSeek-V4's compressed attention, falls back alike: docs/coverage.md.)"""
from __future__ import annotations

import os
import sys

from checks import left_padded_prompts, raised
from distributed import run_ranks

NEW_TOKENS = 6


def _generate(rank, tp, paths):
    import torch
    import torch.distributed as dist

    import fxparallel
    from models import reference

    out = {}
    for name, path in paths.items():
        model = fxparallel.parallelize(path, dist.group.WORLD, dtype=torch.float32,
                                       sequence_parallel=name == "llama-sp")
        ids, mask = left_padded_prompts(seed=6)
        kwargs = dict(attention_mask=mask, max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0)
        asked = {"use_cache": False} if name.startswith("llama") else {}
        theirs = {"use_cache": False} if name.startswith("llama") or name == "rwkv" else {}
        if name in ("xlnet", "cpmant"):
            out[name] = raised(lambda: model.generate(input_ids=ids, **kwargs))
            continue
        ref = reference(path)
        before = len(model.graphs())
        got = model.generate(input_ids=ids, **kwargs, **asked, return_dict_in_generate=True)
        expected = ref.generate(input_ids=ids, **kwargs, **theirs)
        added = len(model.graphs()) - before
        # another prompt length (and so another max_length) in the same length bucket: no new graph
        longer = torch.randint(3, 200, (2, 9), generator=torch.Generator().manual_seed(7))
        again = model.generate(input_ids=longer, max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0, **asked)
        out[name] = {"tokens": torch.equal(got.sequences, expected),
                     "again": torch.equal(again, ref.generate(input_ids=longer, max_new_tokens=NEW_TOKENS,
                                                              do_sample=False, pad_token_id=0, **theirs)),
                     "graphs added": added, "graphs added again": len(model.graphs()) - before - added,
                     "cache graphs": sum(1 for g in model.graphs() if g.cache_length),
                     "cache returned": got.past_key_values is not None,
                     "refusal": model.cache_refusal}
    return out


def test_generate_recomputes_without_a_cache(tmp_path):
    from models import save_checkpoint

    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))
    from tiny_configs import tiny_config

    paths = {name: save_checkpoint(tiny_config(name), str(tmp_path / name))
             for name in ("openai-gpt", "rwkv", "llama", "xlnet", "cpmant")}
    paths["llama-sp"] = paths["llama"]  # parallelized with sequence_parallel: lengths padded to a multiple of tp
    for out in run_ranks(2, _generate, paths):
        for name in ("openai-gpt", "rwkv", "llama", "llama-sp"):
            row = out[name]
            assert row["tokens"] and row["again"], (name, row)
            assert row["cache graphs"] == 0 and not row["cache returned"], (name, row)
            # RWKV's loop fixes the sequence length: the prompt's graph (once, to check the padding), then the
            # padded length's for every step and prompt of its bucket; the others grow in one graph (with
            # sequence parallelism: padded, checked at the prompt's longest even prefix)
            assert row["graphs added"] <= (2 if name in ("rwkv", "llama-sp") else 1), (name, row)
            assert row["graphs added again"] == 0, (name, row)
        assert out["llama"]["refusal"] is None and out["llama-sp"]["refusal"] is None, out  # asked for none
        assert out["openai-gpt"]["refusal"].startswith(
            "OpenAIGPTLMHeadModel's forward takes no KV cache (no `cache` or `past_key_values` argument): use_cache "
            "is not supported for this model (generate recomputes"), out["openai-gpt"]
        assert "carries `state` instead" in out["rwkv"]["refusal"], out["rwkv"]
        assert out["xlnet"].startswith(
            "InputError: generate is not supported for this model (xlnet): its cache cannot be carried "
            "(XLNetLMHeadModel's forward takes no KV cache"), out["xlnet"]
        assert "without a cache its generate passes perm_mask, target_mapping and appends a token to the sequence" \
            in out["xlnet"], out["xlnet"]
        # CPM-Ant's loop fixes the sequence length too, but its attention is bidirectional: padding is refused
        assert out["cpmant"].startswith(
            "InputError: generate is not supported for this model (cpmant) without a cache: its code fixes the "
            "sequence length (a graph per token), and masked padding after the tokens moves the last token's logits "
            "by "), out["cpmant"]
