"""model.generate on the parallel model: greedy tokens equal single-device transformers' (left
padding, eos, min_new_tokens), a bounded number of graphs, a KV cache of 1/TP per rank, 2L+1
all-reduces per decoded token and no logits gather, sampling identical on every rank, the cache
returned by forward(use_cache=True) accepted back, and clear errors for what is not supported."""
from __future__ import annotations

import os
import sys

from checks import left_padded_prompts, raised
from distributed import run_ranks


class _Collect:
    """A streamer that keeps what it is given (transformers' streamer interface)."""

    def __init__(self):
        self.chunks, self.ended = [], False

    def put(self, value):
        self.chunks.append(value.reshape(-1, 1) if value.dim() == 1 else value)

    def end(self):
        self.ended = True


def _llama(rank, tp, path):
    import torch
    import torch.distributed as dist

    import fxparallel
    from models import reference

    model = fxparallel.parallelize(path, dist.group.WORLD, dtype=torch.float32)
    ref = reference(path)
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(1, 128, (3, 7), generator=gen)
    mask = torch.ones_like(ids)
    mask[0, :3] = 0
    mask[2, :1] = 0
    ids = ids * mask  # left padding with id 0
    out = {}
    streamer = _Collect()
    tokens = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=12, do_sample=False, pad_token_id=0,
                            streamer=streamer if rank == 0 else None)
    expected = ref.generate(input_ids=ids, attention_mask=mask, max_new_tokens=12, do_sample=False, pad_token_id=0)
    out["greedy equal"] = torch.equal(tokens, expected)
    out["streamed equal"] = rank != 0 or (torch.equal(torch.cat(streamer.chunks, dim=1), tokens) and streamer.ended)
    out["graphs after one generate"] = len(model.graphs())
    # other prompt lengths and batch: no new capture; eos (several) and min_new_tokens as transformers
    eos = [int(expected[1, 9]), int(expected[0, 12])]
    kwargs = dict(max_new_tokens=10, min_new_tokens=3, eos_token_id=eos, pad_token_id=0, do_sample=False)
    tokens = model.generate(input_ids=ids[1:, 1:], attention_mask=mask[1:, 1:], **kwargs)
    out["eos equal"] = torch.equal(tokens, ref.generate(input_ids=ids[1:, 1:], attention_mask=mask[1:, 1:], **kwargs))
    # no pad token: rows that stopped get the EOS id, as in transformers (here row 0 stops after 4 tokens)
    plain = ref.generate(input_ids=ids[1:, 1:], attention_mask=mask[1:, 1:], max_new_tokens=10, do_sample=False,
                         pad_token_id=0)
    stop = dict(max_new_tokens=10, eos_token_id=int(plain[0, ids.shape[1] - 1 + 3]), do_sample=False)
    tokens = model.generate(input_ids=ids[1:, 1:], attention_mask=mask[1:, 1:], **stop)
    expected_eos = ref.generate(input_ids=ids[1:, 1:], attention_mask=mask[1:, 1:], **stop)
    out["eos without a pad token equal"] = (torch.equal(tokens, expected_eos), tokens.tolist(), stop["eos_token_id"])
    out["graphs after two"] = len(model.graphs())
    # run ahead (on a GPU: each decode step queued before the host reads whether the last one stopped every row),
    # forced on the CPU here: the same tokens (stopped by EOS; at max_length, streamed on rank 0 only), one step
    # more than the tokens when EOS stops every row (that step dropped), none at max_length
    import fxparallel.generation.loop as loop

    prompt = ids.shape[1] - 1  # both rows stop by EOS, after 4 and at most 6 tokens
    by_eos_kwargs = dict(input_ids=ids[1:, 1:], attention_mask=mask[1:, 1:], max_new_tokens=10, do_sample=False,
                         pad_token_id=0, eos_token_id=[int(plain[0, prompt + 3]), int(plain[1, prompt + 5])])
    expected_by_eos = ref.generate(**by_eos_kwargs)
    sampling = dict(input_ids=ids, attention_mask=mask, max_new_tokens=6, do_sample=True, top_k=20, temperature=0.7,
                    repetition_penalty=1.3, pad_token_id=0)
    torch.manual_seed(7)
    first = model.generate(**sampling)  # every row's third new token made its EOS: all stop within 3 steps
    sampling["eos_token_id"] = sorted({int(t) for t in first[:, ids.shape[1] + 2]})
    steps, real_step, sampled = [], loop._step, {}
    loop._step = lambda *a: steps.append(1) or real_step(*a)
    try:
        counts = []
        for devices in (("cuda",), ("cuda", "cpu")):
            loop.RUN_AHEAD_DEVICES, streamer, done = devices, _Collect(), len(steps)
            by_eos = model.generate(**by_eos_kwargs)
            to_max = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=12, do_sample=False,
                                    pad_token_id=0, streamer=streamer if rank == 0 else None)
            streamed = rank != 0 or torch.equal(torch.cat(streamer.chunks, dim=1), to_max)
            counts.append(len(steps) - done)
            out[f"run ahead {devices}"] = (torch.equal(by_eos, expected_by_eos), torch.equal(to_max, expected),
                                             streamed)
            # sampling with stateless processors (a repetition penalty, top-k, temperature), stopped by EOS: the
            # dropped step's draw comes from the call's own generator, so the tokens are those of the plain loop
            torch.manual_seed(7)
            before = len(steps)
            sampled[devices] = model.generate(**sampling), len(steps) - before
        # not ahead where a dropped step would show: the cache returned, or a processor of the caller's (its state
        # unknown: here it counts its calls, one per token)
        from transformers import LogitsProcessor, LogitsProcessorList

        class Counting(LogitsProcessor):
            calls = 0

            def __call__(self, input_ids, scores):
                Counting.calls += 1
                return scores

        before = len(steps)
        returned = model.generate(**by_eos_kwargs, return_dict_in_generate=True)
        counted = model.generate(**by_eos_kwargs, logits_processor=LogitsProcessorList([Counting()]))
        out["not ahead"] = (torch.equal(returned.sequences, expected_by_eos), torch.equal(counted, expected_by_eos),
                            len(steps) - before, Counting.calls, returned.past_key_values.get_seq_length())
    finally:
        loop._step, loop.RUN_AHEAD_DEVICES = real_step, ("cuda",)
    out["run ahead steps"] = counts, expected_by_eos.shape[1] - prompt, expected.shape[1] - ids.shape[1]
    (plain, plain_steps), (ahead, ahead_steps) = sampled[("cuda",)], sampled[("cuda", "cpu")]
    out["run ahead sampling"] = (torch.equal(plain, ahead), plain.shape[1] - ids.shape[1], plain_steps, ahead_steps)
    # the cache: 1/TP of the single-device cache; decode graph: 2L+1 all-reduces, no gather
    result = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=2, do_sample=False, pad_token_id=0,
                            return_dict_in_generate=True)
    cfg = model.config
    head_dim = cfg.hidden_size // cfg.num_attention_heads
    full = cfg.num_hidden_layers * 2 * ids.shape[0] * cfg.num_key_value_heads * result.past_key_values.length \
        * head_dim * 4
    out["cache share"] = (result.past_key_values.nbytes() - 8 * cfg.num_hidden_layers) / full
    out["eager keeps no cache"] = model._graph_set.kept_cache is None
    decode = next(g for g in model.graphs() if g.cache_length and "input_ids" in g.arguments
                  and g.guards.static_sizes.get(("input_ids", 1)) == 1)
    out["decode collectives"] = (decode.code.count("collectives_all_reduce("), decode.code.count("collectives_all_gather("))
    # without autograd recording, the collectives run without their autograd.Function (its dispatch only costs)
    from fxparallel.ops import collectives

    recorded, apply = [], collectives._AllReduce.apply
    collectives._AllReduce.apply = lambda *a: recorded.append(1) or apply(*a)
    try:
        again = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=3, do_sample=False, pad_token_id=0)
        in_generate = len(recorded)
        model(input_ids=ids, labels=ids).loss.backward()  # a training call still records them
    finally:
        collectives._AllReduce.apply = apply
    out["generate records no collective"] = (torch.equal(again, expected[:, :10]), in_generate, len(recorded) > 0)
    model.zero_grad(set_to_none=True)
    # sampling: the same tokens on every rank, without the caller seeding anything alike; top-k (with
    # temperature and top-p) from each rank's own top k, never the whole row of logits
    import fxparallel.generation.loop as loop

    def no_gather(*args):
        raise AssertionError("top-k sampling gathered the whole row of logits")

    torch.manual_seed(1000 + rank)
    gather, loop.full_scores = loop.full_scores, no_gather
    try:
        sampled = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=6, do_sample=True, top_k=20,
                                 top_p=0.9, temperature=0.7, pad_token_id=0)
    finally:
        loop.full_scores = gather
    out["sampled"] = sampled.tolist()
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    first = ref(input_ids=ids, attention_mask=mask, position_ids=positions).logits[:, -1]
    out["sampled in top k"] = all(int(sampled[r, 7]) in first[r].topk(20).indices.tolist() for r in range(3))
    # a hand-written loop with forward(use_cache=True): the cache comes back and is accepted again
    cache = model.new_cache(128)
    full_mask = torch.cat([mask, mask.new_ones(3, 128 - 7)], dim=1)
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    step = model(input_ids=ids, attention_mask=full_mask, position_ids=positions, past_key_values=cache,
                 logits_to_keep=1)  # generate's prefill graph: the last position's logits only
    out["prefill logits"] = tuple(step.logits.shape)
    loop = [step.logits[:, -1].argmax(-1)]
    for _ in range(3):
        positions = positions[:, -1:] + 1
        step = model(input_ids=loop[-1][:, None], attention_mask=full_mask, position_ids=positions,
                     past_key_values=step.past_key_values)
        loop.append(step.logits[:, -1].argmax(-1))
    out["manual loop equal"] = torch.equal(torch.stack(loop, 1), expected[:, 7:11])
    out["graphs at the end"] = len(model.graphs())
    # a cache length first used at batch 1 (graphs specialized to it), then at batch 3: the cache is
    # allocated for the batch at hand and new graphs are captured
    kwargs = dict(max_new_tokens=130, do_sample=False, pad_token_id=0)
    one = model.generate(input_ids=ids[2:, 1:], **kwargs)
    three = model.generate(input_ids=ids, attention_mask=mask, **kwargs)
    out["batch 1 then 3"] = (torch.equal(one, ref.generate(input_ids=ids[2:, 1:], **kwargs))
                             and torch.equal(three, ref.generate(input_ids=ids, attention_mask=mask, **kwargs)))
    out["num_parameters"] = (model.num_parameters() == ref.num_parameters(),
                             model.num_parameters(local=True) < model.num_parameters())
    # compile_config: the decode steps run compiled, compiled once (no recompile per token, nor for other
    # prompt lengths), the prefill eager; disable_compile wins; tokens as eager
    from transformers import CompileConfig

    compiled = []

    def backend(gm, example_inputs):  # counts compilations; runs the traced graph as is (exact numerics)
        compiled.append(gm)
        return gm.forward

    config = CompileConfig(backend=backend, fullgraph=True, dynamic=False, mode=None)
    kwargs = dict(max_new_tokens=12, do_sample=False, pad_token_id=0, compile_config=config)
    shorter = dict(input_ids=ids[:, 2:], attention_mask=mask[:, 2:], max_new_tokens=10, do_sample=False, pad_token_id=0)
    out["compiled equal"] = torch.equal(model.generate(input_ids=ids, attention_mask=mask, **kwargs), expected)
    pointers = [t.data_ptr() for t in model._graph_set.kept_cache[1].tensors.values()]
    out["compiled equal"] &= torch.equal(model.generate(**shorter, compile_config=config), ref.generate(**shorter))
    # the next compiled call of the same batch and cache length reuses the cache's tensors, emptied first
    out["compiled cache reused"] = [t.data_ptr() for t in model._graph_set.kept_cache[1].tensors.values()] == pointers
    out["compilations"] = len(compiled)  # (a new batch size would compile again: dynamic=False)
    model.generate(input_ids=ids, attention_mask=mask, disable_compile=True, **kwargs)
    out["compilations with disable_compile"] = len(compiled)
    # a compiled generate under inference mode, then outside it (the kept cache must not be an inference one)
    with torch.inference_mode():
        inside = model.generate(input_ids=ids, attention_mask=mask, **kwargs)
    out["compiled in and after inference mode"] = (torch.equal(inside, expected) and torch.equal(
        model.generate(input_ids=ids, attention_mask=mask, **kwargs), expected))
    # torch.compile of the whole module, called with a cache
    eager = model(input_ids=ids, use_cache=True).logits
    whole = torch.compile(model, backend=backend)(input_ids=ids, use_cache=True).logits
    out["torch.compile(model) with a cache"] = torch.equal(whole, eager)
    # logits_to_keep (transformers' argument) without a cache: the last k positions' logits, as the full call's
    kept = model(input_ids=ids, attention_mask=mask, logits_to_keep=2).logits
    full = ref(input_ids=ids, attention_mask=mask).logits[:, -2:]
    out["logits_to_keep"] = (tuple(kept.shape), (kept - full).abs().max().item())
    graphs = len(model.graphs())  # planned at the example shape: another length reuses it
    model(input_ids=ids[:, 1:], attention_mask=mask[:, 1:], logits_to_keep=2)
    out["logits_to_keep, another length"] = len(model.graphs()) - graphs
    out["logits_to_keep with labels"] = raised(lambda: model(input_ids=ids, labels=ids, logits_to_keep=1))
    out["logits_to_keep tensor"] = raised(lambda: model(input_ids=ids, logits_to_keep=torch.tensor([6])))
    every = model(input_ids=ids, attention_mask=mask).logits
    out["logits_to_keep None / False"] = [torch.equal(model(input_ids=ids, attention_mask=mask, logits_to_keep=v).logits,
                                                      every) for v in (None, False)]
    out["beam"] = raised(lambda: model.generate(input_ids=ids, num_beams=2, max_new_tokens=2))
    out["prompts differ"] = raised(lambda: model.generate(input_ids=ids + rank, max_new_tokens=2, pad_token_id=0))
    out["unknown argument"] = raised(lambda: model.generate(input_ids=ids, max_new_tokens=2, assistant_model=ref))
    return out


def test_generate_llama(checkpoints):
    results = run_ranks(2, _llama, checkpoints["llama"])
    for out in results:
        assert out["greedy equal"] and out["streamed equal"] and out["eos equal"] and out["manual loop equal"]
        equal, tokens, eos = out["eos without a pad token equal"]
        assert equal and tokens[0][-3:] == [eos] * 3, (eos, tokens)  # row 0 stopped: padded with the EOS id
        assert out["sampled in top k"] and out["batch 1 then 3"]
        assert out["num_parameters"] == (True, True)
        assert out["run ahead ('cuda',)"] == out["run ahead ('cuda', 'cpu')"] == (True, True, True), out
        (plain, ahead), by_eos, to_max = out["run ahead steps"]
        assert by_eos < 10 and plain == by_eos + to_max and ahead == plain + 1, out["run ahead steps"]
        # the same tokens, stopped early, and the sampling call ran ahead by one dropped step too
        returned_equal, counted_equal, not_ahead_steps, calls, cached = out["not ahead"]
        assert returned_equal and counted_equal and not_ahead_steps == 2 * by_eos and calls == by_eos, out["not ahead"]
        assert cached == 6 + by_eos - 1, out["not ahead"]  # the prompt and every token but the last: none dropped
        equal, new, plain_steps, ahead_steps = out["run ahead sampling"]
        assert equal and new <= 3 and plain_steps == new and ahead_steps == new + 1, out["run ahead sampling"]
        assert out["graphs after one generate"] == 3  # training graph + prefill + decode
        assert out["graphs after two"] == 3, "other prompt lengths and batch sizes must reuse the graphs"
        assert out["graphs at the end"] == 3
        assert out["prefill logits"] == (3, 1, 128), out["prefill logits"]  # the full vocabulary, gathered
        assert out["logits_to_keep"][0] == (3, 2, 128) and out["logits_to_keep"][1] < 1e-5, out["logits_to_keep"]
        assert "logits_to_keep with labels: the loss needs the logits of every position" in \
            out["logits_to_keep with labels"]
        assert "logits_to_keep as a tensor of positions is not supported" in out["logits_to_keep tensor"]
        assert out["logits_to_keep None / False"] == [True, True]  # ask for nothing, as transformers' 0
        assert out["logits_to_keep, another length"] == 0
        assert abs(out["cache share"] - 0.5) < 1e-9, out["cache share"]
        assert out["eager keeps no cache"] and out["compiled cache reused"]
        assert out["decode collectives"] == (2 * 2 + 1, 0)
        assert out["generate records no collective"] == (True, 0, True), out["generate records no collective"]
        assert out["compiled equal"] and out["compilations"] == 1, out["compilations"]
        assert out["compilations with disable_compile"] == 1
        assert out["compiled in and after inference mode"] and out["torch.compile(model) with a cache"]
        assert "generate: beam_search is not supported on the parallel model (num_beams=2" in out["beam"]
        assert "generate: the tp ranks were given different prompts or generation arguments" in out["prompts differ"]
        assert "generate: unsupported arguments ['assistant_model']" in out["unknown argument"]
    assert results[0]["sampled"] == results[1]["sampled"], "sampling must draw the same tokens on every rank"


def _families(rank, tp, paths):
    import torch
    import torch.distributed as dist

    import fxparallel
    from models import reference

    out = {}
    for name, path in paths.items():
        model = fxparallel.parallelize(path, dist.group.WORLD, dtype=torch.float32)
        ref = reference(path)
        ids, mask = left_padded_prompts((2, 6), high=120, seed=1)
        tokens = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=8, do_sample=False, pad_token_id=0)
        out[name] = torch.equal(tokens, ref.generate(input_ids=ids, attention_mask=mask, max_new_tokens=8,
                                                     do_sample=False, pad_token_id=0))
        out[f"{name} cache"] = [g.cache_length for g in model.graphs() if g.cache_length]
        if name == "trocr":  # its decode step reads the cache's count on the host: compiled steps are refused
            from transformers import CompileConfig

            out["trocr compiled"] = raised(lambda: model.generate(
                input_ids=ids, attention_mask=mask, max_new_tokens=2, do_sample=False, pad_token_id=0,
                compile_config=CompileConfig(backend="eager", fullgraph=True, dynamic=False)))
        if name == "dory":  # its recurrent layer's loops past the first write copies of its cache layer
            cache = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=1, do_sample=False,
                                   pad_token_id=0, return_dict_in_generate=True).past_key_values
            out["dory layers"] = sorted({(int(k.split("_")[1]), full != local)
                                         for k, (full, local, _) in cache.layout.items() if k.endswith("_keys")})
        # a prompt that alone fills the positions or the window: no max_new_tokens can help (before: "lower
        # max_new_tokens to at most 0", or a negative number)
        long = torch.randint(3, 120, (2, 66), generator=torch.Generator().manual_seed(2))
        if name == "gpt2":  # 64 learned positions: refused before any step
            out["too long"] = raised(lambda: model.generate(input_ids=ids, max_new_tokens=60, pad_token_id=0))
            out["prompt fills the positions"] = raised(lambda: model.generate(input_ids=long[:, :64],
                                                                               max_new_tokens=2, pad_token_id=0))
        if name in WINDOWED:  # three windows past the window, from a prompt shorter and one longer than it
            graphs = len(model.graphs())
            for key, prompt, attention in (("past the window", ids, mask), ("prompt past the window", long[:, :12],
                                                                            torch.ones(2, 12, dtype=torch.long))):
                kwargs = dict(attention_mask=attention, max_new_tokens=3 * WINDOW + 2, do_sample=False,
                              pad_token_id=0)
                out[f"{name} {key}"] = torch.equal(model.generate(input_ids=prompt, **kwargs),
                                                   ref.generate(input_ids=prompt, **kwargs))
            out[f"{name} graphs added"] = len(model.graphs()) - graphs
    return out


WINDOW = 8
WINDOWED = ("mistral", "gemma2", "gpt_oss")


def test_generate_learned_positions_and_sliding_window(tmp_path):
    """GPT-2 (learned positions, fused qkv), TrOCR (learned positions from the cache's count), Dory (a layer run in
    loops, each with a cache layer of its own: capture/own_caches.py), Mistral (every layer
    a sliding window), Gemma 2 and GPT-OSS (sliding and full layers alternating; GPT-OSS's attention sinks and
    experts) at TP=2. Past the window transformers' cache rolls (or drops the oldest tokens); the parallel model's
    keeps them all and attends the window through the mask: the same tokens, three windows past it, from a prompt
    shorter than the window (left-padded) and one longer, with no graph per step."""
    from transformers import GPT2Config

    from models import save_checkpoint, tiny_config

    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))
    from tiny_configs import tiny_config as any_config

    paths = {
        "gpt2": save_checkpoint(GPT2Config(vocab_size=128, n_embd=64, n_layer=2, n_head=4, n_positions=64),
                                str(tmp_path / "gpt2")),
        "mistral": save_checkpoint(tiny_config("mistral", sliding_window=WINDOW), str(tmp_path / "mistral")),
        "gemma2": save_checkpoint(any_config("gemma2", sliding_window=WINDOW, vocab_size=128),
                                  str(tmp_path / "gemma2")),
        "gpt_oss": save_checkpoint(any_config("gpt_oss", sliding_window=WINDOW, vocab_size=128),
                                   str(tmp_path / "gpt_oss")),
        # learned positions that start at the cache's count (test_positions_from_the_cache_count_...)
        "trocr": save_checkpoint(any_config("trocr", vocab_size=128), str(tmp_path / "trocr")),
        # an input layer, a recurrent layer run in two loops, an output layer
        "dory": save_checkpoint(any_config("dory", vocab_size=128), str(tmp_path / "dory")),
    }
    for out in run_ranks(2, _families, paths):
        assert all(out[name] for name in ("gpt2", "trocr", "dory") + WINDOWED), out
        assert out["trocr cache"] == [128, 128] and out["dory cache"] == [128, 128], out  # with the sharded cache
        # Dory's three layers and the second loop's copy of its recurrent layer's, each split by heads
        assert out["dory layers"] == [(0, True), (1, True), (2, True), (3, True)], out["dory layers"]
        assert out["trocr compiled"].startswith(
            "InputError: generate: compile_config is not supported for this model: its decode step reads the "
            "cache's count of tokens on the host"), out["trocr compiled"]
        assert "beyond the model's 64 learned positions" in out["too long"], out["too long"]
        for name in WINDOWED:
            assert out[f"{name} past the window"] and out[f"{name} prompt past the window"], out
            assert out[f"{name} graphs added"] <= 2, out  # the longer prompt's prefill and decode, at most
        assert out["prompt fills the positions"] == (
            "InputError: generate: the prompt alone fills the model's learned positions: 64 tokens, 64 positions "
            "(max_position_embeddings), so not one token can be generated; shorten the prompt to at most 63 tokens "
            "(the model has no position for more, on one device either)"), out["prompt fills the positions"]


def _past_the_window(rank, tp, path):
    import torch
    import torch.distributed as dist

    import fxparallel
    from models import reference

    model = fxparallel.parallelize(path, dist.group.WORLD, dtype=torch.float32)
    ref = reference(path)
    ids = torch.randint(3, 120, (2, 12), generator=torch.Generator().manual_seed(3))
    kwargs = dict(max_new_tokens=3 * WINDOW + 2, do_sample=False, pad_token_id=0)
    return {"kv heads per rank": [p.split for p in model.plan.params if p.name.endswith("layers.0.self_attn.k_proj.weight")],
            "tokens": torch.equal(model.generate(input_ids=ids, **kwargs), ref.generate(input_ids=ids, **kwargs))}


def test_generate_past_a_sliding_window_with_heads_split_unevenly(tmp_path):
    """Mistral at TP=3, its kv heads split unevenly (k_proj rows 16 / 8 / 8): transformers' tokens three windows
    past the window, from a prompt longer than it."""
    from models import save_checkpoint, tiny_config

    path = save_checkpoint(tiny_config("mistral", sliding_window=WINDOW), str(tmp_path / "mistral"))
    for out in run_ranks(3, _past_the_window, path):
        assert out["tokens"] and out["kv heads per rank"] == [((16, 8, 8),)], out  # k_proj rows: whole heads, uneven


def test_positions_from_the_cache_count_are_captured_with_the_count_as_an_int():
    """RoFormer builds its positions as ``arange(count, count + tokens)`` from the cache's count, a tensor in
    transformers' static cache: Dynamo cannot know that range's length, so the cache graph is captured again with
    the count read as an int (one ``item`` in the graph). MPT (asked to use its cache) slices its ALiBi bias by
    ``max(0, 1 - (tokens + count))``, a branch on the tensor's value even as it fills the cache: filled and captured
    with the int, known not to be negative. Llama's decode graph, which needs no such read, keeps the tensor (no
    ``item``). (Their tokens at TP=2: TrOCR in test_generate_learned_positions_and_sliding_window.)"""
    import os
    import sys

    import torch

    from fxparallel.api import _for_device
    from fxparallel.capture import GraphSpec, build_meta_model, capture

    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))
    from tiny_configs import tiny_config

    reads = {}
    for name, overrides in (("roformer", {}), ("mpt", dict(use_cache=True)), ("llama", {})):
        config = _for_device(tiny_config(name, **overrides), torch.device("cpu"))
        captured = capture(build_meta_model(config, dtype=torch.float32),
                           GraphSpec(("input_ids", "attention_mask"), (2, 1), cache_length=32))
        reads[name] = sum(node.target == "item" for node in captured.gm.graph.nodes)
    assert reads == {"roformer": 1, "mpt": 2, "llama": 0}, reads  # (MPT: each of its 2 layers reads the count)
