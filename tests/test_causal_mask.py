"""A forward without ``attention_mask``, or with one that holds no padding, runs sdpa's own causal attention
(``is_causal=True``), as transformers' eager forward does, instead of a seq x seq mask that every layer keeps
for the backward pass (``capture/causal_mask.py``); masks that say more (sliding windows, packed sequences,
padding) are kept."""
from __future__ import annotations

import torch

from distributed import run_ranks

SEQ = 12  # longer than the Mistral checkpoint's sliding window (8)


def _attention(model) -> dict:
    """Per graph (by its arguments, and "unpadded" for the graph of masks without padding): how many sdpa calls
    are causal without a mask, how many take the model's mask."""
    found = {}
    for g in model.graphs():
        code = g.code  # the root code and every layer piece
        key = tuple(sorted(g.arguments)) + (("unpadded",) if g.spec.unpadded else ())
        found[key] = (code.count("is_causal = True"), code.count("attn_mask = attention_mask"))
    return found


def _square_saved(model, **inputs) -> list:
    """Shapes of the tensors autograd saves that end in seq x seq (a mask or attention weights)."""
    shapes = []

    def pack(t):
        shapes.append(tuple(t.shape))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model(**inputs).loss
    loss.backward()
    return [s for s in shapes if len(s) >= 2 and s[-2:] == (SEQ, SEQ)]


def _run(rank, tp, paths):
    import torch.distributed as dist

    import fxparallel
    from checks import batch, compare
    from models import reference

    ids = batch(128, b=2, s=SEQ)
    results = {}
    llama = fxparallel.parallelize(paths["llama"], dist.group.WORLD)
    results["llama_square_saved"] = _square_saved(llama, input_ids=ids, labels=ids)
    results["llama"] = compare(llama, reference(paths["llama"]), rank, tp, ids=ids)
    # two sequences packed in the first row: transformers finds them in position_ids and masks across them
    # (without a cache only: with one, as use_cache=True makes, it reads the row as one sequence)
    packed = torch.cat([torch.arange(5), torch.arange(SEQ - 5)])
    positions = torch.stack([packed, torch.arange(SEQ)])
    results["packed"] = compare(llama, reference(paths["llama"]), rank, tp, ids=ids, position_ids=positions,
                                use_cache=False)
    # an attention mask: without padding it is read (as transformers reads it) and attention skips it;
    # with padding (a left-padded row) it is applied; with the checks off it is not read, so always applied
    ones = torch.ones_like(ids)
    padded = ones.clone()
    padded[0, :3] = 0
    results["ones_square_saved"] = _square_saved(llama, input_ids=ids, labels=ids, attention_mask=ones)
    results["padded_square_saved"] = _square_saved(llama, input_ids=ids, labels=ids, attention_mask=padded)
    results["all_ones"] = compare(llama, reference(paths["llama"]), rank, tp, ids=ids, attention_mask=ones)
    results["padded"] = compare(llama, reference(paths["llama"]), rank, tp, ids=ids, attention_mask=padded)
    with torch.no_grad():
        read = llama(input_ids=ids, attention_mask=ones).logits
        unread = llama(input_ids=ids, attention_mask=ones, check_inputs=False).logits
    results["unread"] = (read - unread).abs().max().item()
    results["llama_graphs"] = _attention(llama)
    mistral = fxparallel.parallelize(paths["mistral"], dist.group.WORLD)
    results["mistral"] = compare(mistral, reference(paths["mistral"]), rank, tp, ids=ids)
    results["mistral_graphs"] = _attention(mistral)
    return results


def test_plain_causal_attention_has_no_mask_and_others_keep_theirs(checkpoints):
    per_rank = run_ranks(2, _run, {k: checkpoints[k] for k in ("llama", "mistral")})
    for r in per_rank:
        for case in ("llama", "packed", "all_ones", "padded", "mistral"):
            assert max(r[case]["loss"], r[case]["logits"], r[case]["grad"]) < 1e-5, (case, r[case])
        assert r["llama_square_saved"] == r["ones_square_saved"] == [], r
        assert r["padded_square_saved"], "a padding mask is kept for the backward pass (what the two above lack)"
        assert r["unread"] < 1e-5
        # two layers: causal without a mask, unless position_ids are given (they may pack sequences) or the mask
        # holds padding (or was not read)
        assert r["llama_graphs"] == {("input_ids", "labels"): (2, 0), ("input_ids",): (2, 0),
                                     ("input_ids", "labels", "position_ids"): (0, 2),
                                     ("input_ids", "position_ids"): (0, 2),
                                     ("attention_mask", "input_ids", "labels", "unpadded"): (2, 0),
                                     ("attention_mask", "input_ids", "unpadded"): (2, 0),
                                     ("attention_mask", "input_ids", "labels"): (0, 2),
                                     ("attention_mask", "input_ids"): (0, 2)}, r["llama_graphs"]
        # sliding window (8 < 12): every layer keeps the model's mask
        assert r["mistral_graphs"] == {("input_ids", "labels"): (0, 2), ("input_ids",): (0, 2)}, r["mistral_graphs"]


def test_models_run_eagerly_during_a_capture_keep_transformers_masks(checkpoints):
    """The patch answers only inside Dynamo's trace: a model run eagerly meanwhile (another thread) keeps its
    padding and packed-sequence masks."""
    from checks import batch
    from fxparallel.capture.causal_mask import causal_without_mask
    from models import reference

    model = reference(checkpoints["llama"])
    ids = batch(128, b=2, s=SEQ)
    padded = torch.ones_like(ids)
    padded[0, :3] = 0
    packed = torch.stack([torch.cat([torch.arange(5), torch.arange(SEQ - 5)]), torch.arange(SEQ)])
    calls = (dict(input_ids=ids, attention_mask=padded), dict(input_ids=ids, position_ids=packed, use_cache=False))
    with torch.no_grad():
        outside = [model(**kwargs).logits for kwargs in calls]
        with causal_without_mask(positions_given=False, unpadded=True):
            during = [model(**kwargs).logits for kwargs in calls]
    for a, b in zip(outside, during):
        assert torch.equal(a, b)


def test_only_the_plain_case_is_answered_from_sizes():
    from fxparallel.capture.causal_mask import _plain_causal

    assert _plain_causal(None, 12, 12, 0, 0, None)
    assert not _plain_causal(torch.ones(2, 12, dtype=torch.bool), 12, 12, 0, 0, None)  # padding: values needed
    assert _plain_causal(torch.ones(2, 12, dtype=torch.bool), 12, 12, 0, 0, None, unpadded=True)  # read per call
    assert not _plain_causal(None, 12, 12, 0, 0, 8)  # a sliding window
    assert not _plain_causal(None, 12, 20, 0, 8, None)  # a cache before the queries
    assert not _plain_causal(None, 12, 12, torch.tensor(0), 0, None)  # an offset only known as a tensor
