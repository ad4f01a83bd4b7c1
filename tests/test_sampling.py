"""Sampling on the parallel model against transformers' processed scores, not only rank agreement.

``do_sample=True, top_k=1`` draws exactly greedy's tokens. For sampling with temperature, top-k and top-p,
the parallel model's sequence is fed to transformers' single-device model (teacher forcing), and transformers'
own logits processors (``_get_logits_processor``, as its ``generate`` builds them) give the processed scores of
each step; the parallel model's processed scores must equal them: -inf at the same tokens, the same values at
the others. Both of generate's paths are checked: the default one, where each rank sends only its own top k
(the processors run on the tp x k candidates: recorded here by wrapping them), and ``output_scores=True``, where
the row is gathered and the scores are returned.
"""
from __future__ import annotations

import pytest

from distributed import run_ranks

NEW = 8
# the tiny model's logits are nearly flat: one setting where top-k cuts (5 tokens kept of 128), one where top-p
# cuts before top-k does (fewer than 20 kept); the temperature is applied in both
SAMPLING = {"top-k cuts": dict(do_sample=True, top_k=5, top_p=0.9, temperature=0.25),
            "top-p cuts": dict(do_sample=True, top_k=20, top_p=0.6, temperature=0.1)}


def _prompts():
    from checks import left_padded_prompts

    return left_padded_prompts((3, 7), high=128, seed=3, low=1)


def _reference_scores(ref, sequences, mask, prompt: int, kwargs: dict) -> list:
    """transformers' processed scores ([batch, vocab], float32) of each generated step, teacher-forced on
    ``sequences``: its processors applied to the logits of the position before each new token."""
    import torch
    from transformers.generation.logits_process import LogitsProcessorList

    full_mask = torch.cat([mask, mask.new_ones(mask.shape[0], sequences.shape[1] - prompt)], dim=1)
    positions = (full_mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        logits = ref(input_ids=sequences, attention_mask=full_mask, position_ids=positions).logits.float()
    config, _ = ref._prepare_generation_config(None, **kwargs)
    processors = ref._get_logits_processor(config, input_ids_seq_length=prompt, device="cpu",
                                           logits_processor=LogitsProcessorList(), model_kwargs={})
    assert len(processors) == 3, processors  # temperature, top-k, top-p
    return [processors(sequences[:, :prompt + t], logits[:, prompt + t - 1].clone()) for t in range(NEW)]


def _difference(ours, theirs) -> tuple:
    """(same -inf tokens, max difference of the finite scores, tokens kept per row at the least / most)."""
    import torch

    kept = torch.isfinite(theirs)
    same = torch.equal(torch.isfinite(ours), kept)
    diff = (ours[kept] - theirs[kept]).abs().max().item() if same else float("inf")
    counts = kept.sum(-1)
    return same, diff, int(counts.min()), int(counts.max())


def _candidate_steps(seen: dict, ref, sampled, mask, sampling: dict, eos) -> list:
    """Per step: ``_difference`` of the processed candidates (scattered into a row of -inf) from transformers'
    processed scores, and whether every drawn token is one transformers keeps. A string where the processors
    did not run on candidates at each step."""
    import torch

    if not len(seen["ids"]) == len(seen["processed"]) == NEW:
        return f"{len(seen['ids'])} candidate sets, {len(seen['processed'])} processed"
    prompt = mask.shape[1]
    theirs = _reference_scores(ref, sampled, mask, prompt, sampling)
    steps = []
    for t in range(NEW):
        dense = torch.full_like(theirs[t], float("-inf")).scatter(1, seen["ids"][t], seen["processed"][t])
        # every candidate is a distinct token (no padding of a small shard, whose -inf would be scattered too)
        assert all(len(set(row.tolist())) == row.numel() for row in seen["ids"][t])
        # each drawn token is one transformers' processors keep (rows that drew eos before are padded)
        running = ~torch.isin(sampled[:, prompt:prompt + t], eos).any(-1)
        drawn = torch.isfinite(theirs[t].gather(1, sampled[:, prompt + t, None])).squeeze(1)
        steps.append(_difference(dense, theirs[t]) + (bool(drawn[running].all()),))
    return steps


def _sampling(rank, tp, path):
    import torch
    import torch.distributed as dist
    from transformers.generation.logits_process import LogitsProcessorList

    import fxparallel
    import fxparallel.generation.loop as loop
    from models import reference

    torch.manual_seed(0)
    model = fxparallel.parallelize(path, dist.group.WORLD, dtype=torch.float32)
    ref = reference(path)
    ids, mask = _prompts()
    prompt = ids.shape[1]
    common = dict(input_ids=ids, attention_mask=mask, max_new_tokens=NEW, pad_token_id=0)
    out = {}
    greedy = model.generate(**common, do_sample=False)
    out["greedy is transformers'"] = torch.equal(greedy, ref.generate(**common, do_sample=False))
    out["top_k=1 is greedy"] = torch.equal(model.generate(**common, do_sample=True, top_k=1, temperature=0.7), greedy)

    # the default path: each rank's top k, the processors on the candidates (recorded with their ids)
    seen = {"ids": [], "processed": []}

    class Recording(LogitsProcessorList):
        def __call__(self, input_ids, scores, **kwargs):
            processed = super().__call__(input_ids, scores, **kwargs)
            seen["processed"].append(processed.clone())
            return processed

    def candidates(*args):
        scores, token_ids = top_k_candidates(*args)
        seen["ids"].append(token_ids.clone())
        return scores, token_ids

    eos = model.generation_config.eos_token_id
    eos = torch.tensor(eos if isinstance(eos, list) else [] if eos is None else [eos])
    out["candidates"], out["output_scores"], out["sampled"] = {}, {}, {}
    for name, sampling in SAMPLING.items():
        seen["ids"].clear()
        seen["processed"].clear()
        build = model._get_logits_processor
        top_k_candidates, loop.top_k_candidates = loop.top_k_candidates, candidates
        model._get_logits_processor = lambda *args, **kwargs: Recording(build(*args, **kwargs))
        try:
            sampled = model.generate(**common, **sampling)
        finally:
            loop.top_k_candidates = top_k_candidates
            del model._get_logits_processor
        out["sampled"][name] = sampled.tolist()
        out["candidates"][name] = _candidate_steps(seen, ref, sampled, mask, sampling, eos)

        # output_scores: the row gathered, the processed scores returned
        result = model.generate(**common, **sampling, output_scores=True, return_dict_in_generate=True)
        assert len(result.scores) == NEW, len(result.scores)
        theirs = _reference_scores(ref, result.sequences, mask, prompt, sampling)
        out["output_scores"][name] = [_difference(result.scores[t], theirs[t]) for t in range(NEW)]
    return out


@pytest.fixture(scope="module")
def sampling(checkpoints):
    return run_ranks(2, _sampling, checkpoints["llama"])


def test_top_k_1_sampling_is_greedy(sampling):
    for out in sampling:
        assert out["greedy is transformers'"] and out["top_k=1 is greedy"]


@pytest.mark.parametrize("path", ["candidates", "output_scores"])
@pytest.mark.parametrize("setting", sorted(SAMPLING))
def test_processed_scores_are_transformers(sampling, path, setting):
    top_k, temperature = SAMPLING[setting]["top_k"], SAMPLING[setting]["temperature"]
    for out in sampling:
        steps = out[path][setting]
        assert isinstance(steps, list) and len(steps) == NEW, steps  # the processors ran on candidates each step
        for t, (same, diff, fewest, most, *in_support) in enumerate(steps):
            assert same, f"step {t}: -inf at other tokens than transformers' processors"
            # 1e-5 on the scale of the logits (the processed scores are the logits / temperature)
            assert diff < 1e-5 / temperature, f"step {t}: processed scores differ by {diff}"
            assert in_support in ([], [True]), f"step {t}: a token transformers gives probability 0 was drawn"
        kept = sorted({n for s in steps for n in s[2:4]})
        if setting == "top-k cuts":
            assert kept[-1] == top_k, kept  # top-k kept its k tokens (top-p would have kept more)
        else:
            assert any(1 < n < top_k for n in kept) and kept[-1] < top_k, kept
    assert sampling[0]["sampled"] == sampling[1]["sampled"], "sampling must draw the same tokens on every rank"
