"""Dropout in training: the masks do not depend on the layout.

One spawn of 4 gloo ranks runs every layout in turn under one seed: TP=1 (equal to transformers'
own training-mode forward on CPU, and in eval mode to its eval forward), then GPT-2 (embedding,
residual and attention dropout 0.1, sdpa) at TP=2, TP=4 and TP=2 x CP=2, and OPT (residual
dropout on [batch, seq, hidden] and [batch*seq, hidden]) with sequence parallelism at TP=2: loss
and every gradient equal the TP=1 run (1e-5, fp32). A Llama with attention_dropout 0.1
(grouped-query heads) is checked against transformers at TP=1. Masks per layout: tests/rules.
"""
from __future__ import annotations

import pytest
import torch

from distributed import run_ranks

TOL = 1e-5
SEED = 7
B, S = 2, 8  # S divides by 2 (SP at TP=2) and by 2 * cp (CP=2)
LAYERS = 1  # one decoder layer: every site appears, captures stay fast


def _grads(model) -> dict:
    return {n: p.grad.detach().clone() for n, p in model.named_parameters()}


def _step(model, ids, labels=None, **kwargs):
    """One training-mode forward and backward under SEED; (loss, grads)."""
    for p in model.parameters():
        p.grad = None
    model.train()
    torch.manual_seed(SEED)
    out = model(input_ids=ids, labels=ids if labels is None else labels, **kwargs)
    out.loss.backward()
    return out.loss.detach(), _grads(model)


def _grad_error(model, reference: dict, rank: int, tp: int) -> float:
    errors = [(p.grad - model.plan.param(n).shard_of(reference[n], rank, tp)).abs().max().item()
              for n, p in model.named_parameters()]
    assert len(errors) == len(reference), "every parameter compared"
    return max(errors)


def _against_transformers(model, path, ids) -> tuple:
    """TP=1: the same seed gives transformers' own training step; eval mode gives its eval forward."""
    from models import reference

    ref = reference(path)
    loss, grads = _step(model, ids)
    ref.train()
    torch.manual_seed(SEED)
    ref_loss = ref(input_ids=ids, labels=ids).loss
    ref_loss.backward()
    ref_grads = dict(ref.named_parameters())
    model.eval()
    ref.eval()
    out = model(input_ids=ids, labels=ids, gather_logits=True)
    ref_out = ref(input_ids=ids, labels=ids)
    errors = {"train_loss": (loss - ref_loss).abs().item(),
              "train_grad": max((g - ref_grads[n].grad).abs().max().item() for n, g in grads.items()),
              "eval_loss": (out.loss - ref_out.loss).abs().item(),
              "eval_logits": (out.logits - ref_out.logits).abs().max().item(),
              "train_minus_eval": (loss - out.loss).abs().item()}
    return (loss, grads), errors


def _sites(graph) -> int:
    return graph.code.count("logical_dropout(") + graph.code.count("attention_dropout(")


def _context_parallel(path, ids, tp_group, cp_group, tp_rank, cp_rank, reference) -> dict:
    """TP=2 x CP=2: each cp rank's loss over its chunks, weighted by its tokens, sums to the loss."""
    import torch.distributed as dist

    import fxparallel
    from fxparallel.runtime import split_for_context_parallel

    model = fxparallel.parallelize(path, tp_group, dtype=torch.float32, cp_group=cp_group)
    local = split_for_context_parallel({"input_ids": ids}, cp_rank, 2)
    for p in model.parameters():
        p.grad = None
    model.train()
    torch.manual_seed(SEED)
    loss = model(**local).loss
    share = (local["labels"] != -100).sum() / (ids[:, 1:].numel())
    (loss * share).backward()
    total = (loss * share).detach()
    dist.all_reduce(total, group=cp_group)
    for p in model.parameters():
        dist.all_reduce(p.grad, group=cp_group)
    return {"loss": (total - reference[0]).abs().item(), "grad": _grad_error(model, reference[1], tp_rank, 2)}


def _reference(path, group) -> tuple:
    """TP=1: ((loss, full gradients), errors against transformers)."""
    import fxparallel
    from checks import batch

    model = fxparallel.parallelize(path, group, dtype=torch.float32)
    ids = batch(model.config.vocab_size, b=B, s=S)
    reference, errors = _against_transformers(model, path, ids)
    if model.config.model_type == "gpt2":  # generation graphs run in eval semantics, whatever the mode
        model.train()
        trained = model(input_ids=ids, use_cache=True).logits
        model.eval()
        errors["cache_train_minus_eval"] = (trained - model(input_ids=ids, use_cache=True).logits).abs().max().item()
    return reference, errors


# (model, layout) each rank runs after the references; the two pairs run different ones at the same time
LAYOUTS = {0: (("gpt2", "tp2"), ("gpt2", "tp4"), ("gpt2", "cp")),
           2: (("opt", "sp2"), ("gpt2", "tp4"), ("gpt2", "cp"))}
OWNERS = {"gpt2": 0, "opt": 1, "llama": 2}  # the rank that computes each model's TP=1 reference


def _run(rank, world, paths):
    import torch.distributed as dist

    import fxparallel
    from checks import batch

    singles = [dist.new_group([r]) for r in range(world)]
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    cross = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    groups = {2: pairs[rank // 2], 4: dist.group.WORLD}
    references, results = {}, {}
    for name, owner in OWNERS.items():
        box = [_reference(paths[name], singles[rank]) if rank == owner else None]
        dist.broadcast_object_list(box, src=owner)
        references[name] = box[0][0]
        results[(name, "transformers")] = box[0][1]
    refused = None
    for name, layout in LAYOUTS[rank - rank % 2]:
        path, reference = paths[name], references[name]
        ids = batch(128, b=B, s=S)
        if layout == "cp":
            results[(name, layout)] = _context_parallel(path, ids, pairs[rank // 2], cross[rank % 2], rank % 2,
                                                        rank // 2, reference)
            continue
        tp = int(layout[2:])
        model = fxparallel.parallelize(path, groups[tp], dtype=torch.float32,
                                       sequence_parallel=layout.startswith("sp"))
        loss, _ = _step(model, ids)
        results[(name, layout)] = {"loss": (loss - reference[0]).abs().item(),
                                   "grad": _grad_error(model, reference[1], rank % tp, tp),
                                   "sites": _sites(model.graphs()[0])}
        if layout == "tp4":  # ranks seeded differently would draw different masks: refused on every rank
            torch.manual_seed(SEED + rank)
            try:
                model(input_ids=ids, labels=ids)
            except Exception as err:  # noqa: BLE001
                refused = f"{type(err).__name__}: {err}"
    return {"layouts": results, "seeds differ": refused}


@pytest.fixture(scope="module")
def paths(tmp_path_factory):
    from transformers import GPT2Config, OPTConfig

    from models import save_checkpoint, tiny_config

    root = tmp_path_factory.mktemp("dropout")
    gpt2 = GPT2Config(vocab_size=128, n_embd=64, n_layer=LAYERS, n_head=8, n_inner=128, n_positions=64)
    opt = OPTConfig(vocab_size=128, hidden_size=64, word_embed_proj_dim=64, num_attention_heads=8, ffn_dim=128,
                    num_hidden_layers=LAYERS, max_position_embeddings=64)
    assert (gpt2.embd_pdrop, gpt2.resid_pdrop, gpt2.attn_pdrop, opt.dropout) == (0.1, 0.1, 0.1, 0.1)
    llama = tiny_config("llama", attention_dropout=0.1, num_hidden_layers=LAYERS)  # 8 query heads, 4 kv heads
    return {name: save_checkpoint(config, str(root / name)) for name, config in
            (("gpt2", gpt2), ("opt", opt), ("llama", llama))}


@pytest.fixture(scope="module")
def world4(paths):
    return run_ranks(4, _run, paths, timeout=600)


@pytest.fixture(scope="module")
def layouts(world4):
    return [out["layouts"] for out in world4]


def test_tp1_is_transformers_in_train_and_eval(layouts):
    for (name, layout), r in layouts[0].items():
        if layout != "transformers":
            continue
        assert r["train_loss"] < TOL and r["train_grad"] < TOL, (name, r)
        assert r["eval_loss"] < TOL and r["eval_logits"] < TOL, (name, r)
        assert r["train_minus_eval"] > 1e-4, (name, r)  # dropout is active in train() only
    assert layouts[0][("gpt2", "transformers")]["cache_train_minus_eval"] == 0.0


def test_loss_and_gradients_do_not_depend_on_the_layout(layouts):
    seen = set()
    for results in layouts:
        for (name, layout), r in results.items():
            if layout != "transformers":
                seen.add((name, layout))
                assert r["loss"] < TOL and r["grad"] < TOL, (name, layout, r)
    assert seen == {case for cases in LAYOUTS.values() for case in cases}
    # every dropout site of GPT-2 is in the code: embedding, and per layer attention and 2 residual
    assert layouts[0][("gpt2", "tp4")]["sites"] == 1 + 3 * LAYERS


def test_ranks_seeded_differently_are_refused(world4):
    for r in world4:
        assert r["seeds differ"].startswith("InputError: dropout: the random generators of tp ranks [1, 2, 3]"), \
            r["seeds differ"]
