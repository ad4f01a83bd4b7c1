"""Context parallelism on real gloo ranks: DPxTPxCP = 1x2x2, 2x1x2 (also under HSDP: FSDP over each cp pair,
replicated over dp) and 1x1x4 train a tiny Qwen3 like one process (losses, global grad norms, gradients and
parameters of every tensor, logits), checkpoints move between CP and non-CP layouts exactly, resuming gives the
same losses; plus the split helpers and the refusals.

One spawn of 4 ranks runs every layout in turn: 1x2x2 saves a checkpoint at SAVE_AT that 2x2x1 (no CP)
and 1x1x4 load; 2x2x1 saves one that 2x1x2 loads. Labels are partly masked (-100) so ranks count
different numbers of tokens.
"""
from __future__ import annotations

import types

import pytest
import torch
import torch.nn.functional as F

from checks import as_numpy, full_values, mask_some_labels, max_diff
from distributed import run_ranks

STEPS = 3
SAVE_AT = 2
# A small learning rate: AdamW moves an element with a ~0 gradient by up to lr per step on 1e-7 noise
# (lr 1e-3 gave 5.7e-5 parameter differences for the plain 2x2x1 layout with exact gradients).
LR, WD, MAX_NORM = 1e-4, 0.1, 0.8
GLOBAL_BATCH, SEQ = 4, 16  # SEQ divides by 2*cp for cp = 1, 2, 4
TOL = 1e-5
PARAM_TOL = 3e-5  # parameters after AdamW steps: Adam's normalization amplifies 1e-7 gradient noise
LAYOUTS = (  # (name, dp, tp, cp, save checkpoint as, load checkpoint from)
    ("1x2x2", 1, 2, 2, "cp", "cp"),
    ("2x2x1", 2, 2, 1, "plain", "cp"),
    ("2x1x2", 2, 1, 2, None, "plain"),
    ("2x1x2 hsdp", 2, 1, 2, None, "cp"),  # DP_SHARD_SIZE=1: FSDP over each cp pair, replicated over dp
    ("1x1x4", 1, 1, 4, None, "cp"),
)


# ---- shared pieces ------------------------------------------------------------------------
def _rows():
    from fxparallel.runtime import pack_tokens, synthetic_token_stream

    return pack_tokens(synthetic_token_stream(128, 24 * SEQ, seed=5, mean_doc_len=12), SEQ)


def _optimizer(params):
    return torch.optim.AdamW(params, lr=LR, weight_decay=WD)


# ---- inside ranks -------------------------------------------------------------------------
def _train(model, opt, data, mesh, start, stop):
    from fxparallel.runtime import train_step

    batches = (mask_some_labels(data.batch(s)) for s in range(start, stop))
    return [(m.loss, m.grad_norm) for m in (train_step(model, opt, b, mesh, max_norm=MAX_NORM) for b in batches)]


def _global_logits(model, mesh, ids):
    """Logits of the whole rows ``ids``: each cp rank computes its chunks, then they are put together.
    (With labels: the training graph serves, no new capture.)"""
    import torch.distributed as dist

    from fxparallel.runtime import split_for_context_parallel, unsplit_sequence

    if mesh.cp == 1:
        return model(input_ids=ids, labels=ids, gather_logits=True).logits.detach()
    local = split_for_context_parallel({"input_ids": ids}, mesh.cp_rank, mesh.cp)
    logits = model(**local, gather_logits=True).logits.detach().contiguous()
    parts = [torch.empty_like(logits) for _ in range(mesh.cp)]
    dist.all_gather(parts, logits, group=mesh.cp_mesh.get_group())
    return unsplit_sequence(parts)


def _refusals(model, mesh, path_sliding):
    """Errors a CP model gives on input it cannot run, and parallelize on a sliding-window model."""
    import fxparallel

    local = SEQ // mesh.cp
    ids = torch.zeros(2, local, dtype=torch.long)
    padded = torch.ones_like(ids)
    padded[0, 0] = 0 if mesh.cp_rank == 0 else 1  # padding in cp rank 0's chunks only: every cp rank refuses
    with torch.no_grad():  # a mask of all ones (a padding collator's) is dropped: attention as without one
        errors = {"unpadded": torch.equal(model(input_ids=ids, attention_mask=torch.ones_like(ids)).logits,
                                          model(input_ids=ids).logits)}
    calls = {
        "mask": lambda: model(input_ids=ids, attention_mask=padded),
        "odd": lambda: model(input_ids=torch.zeros(2, local - 1, dtype=torch.long)),
        "positions": lambda: model(input_ids=ids, position_ids=torch.arange(local).expand(2, local)),
        "logits_to_keep": lambda: model(input_ids=ids, logits_to_keep=1),
        "sliding": lambda: fxparallel.parallelize(path_sliding, mesh.tp_mesh, cp_group=mesh.cp_mesh),
    }
    for key, call in calls.items():
        try:
            call()
            errors[key] = None
        except Exception as err:  # noqa: BLE001
            errors[key] = f"{type(err).__name__}: {err}"
    return errors


def _layout_run(path, roots, name, dp, tp, cp, save_as, load_from, path_sliding):
    import fxparallel
    from fxparallel.runtime import StepBatches, apply_data_parallel, init_mesh, load_checkpoint, save_checkpoint

    mesh = init_mesh(tp=tp, dp=dp, cp=cp, dp_shard=1 if name.endswith("hsdp") else None)
    model = fxparallel.parallelize(path, mesh.tp_mesh, dtype=torch.float32, cp_group=mesh.cp_mesh)
    model = apply_data_parallel(model, mesh)
    opt = _optimizer(model.parameters())
    data = StepBatches(_rows(), GLOBAL_BATCH, mesh.dp_rank, mesh.dp)
    run = {"history": _train(model, opt, data, mesh, 0, SAVE_AT),
           "fsdp_mesh": tuple(next(p for p in model.parameters()).device_mesh.shape)}
    if save_as:
        run["saved_params"] = as_numpy(full_values(model, mesh))
        save_checkpoint(roots[save_as], model, opt, mesh, SAVE_AT)
    run["history"] += _train(model, opt, data, mesh, SAVE_AT, STEPS)
    # collectives: every rank
    grads, params = as_numpy(full_values(model, mesh, lambda p: p.grad)), as_numpy(full_values(model, mesh))
    logits = _global_logits(model, mesh, data.global_batch_at(STEPS)["input_ids"])
    meta = load_checkpoint(roots[load_from], model, opt, mesh)
    run["loaded"] = {"step": meta["step"], "layout": meta["layout"]}
    loaded = as_numpy(full_values(model, mesh))
    run["resumed"] = _train(model, opt, data, mesh, SAVE_AT, STEPS)
    if name == "1x1x4":  # last: a forward that raises leaves FSDP's unsharded parameters behind
        run["refusals"] = _refusals(model, mesh, path_sliding)
    if mesh.rank != 0:
        run.pop("saved_params", None)
    else:
        run.update(grads=grads, params=params, logits=logits.numpy(), loaded_params=loaded)
    return run


def _world4(rank, world, path, roots, path_sliding):
    results = {}
    for name, dp, tp, cp, save_as, load_from in LAYOUTS:
        try:
            results[name] = _layout_run(path, roots, name, dp, tp, cp, save_as, load_from, path_sliding)
        except Exception as err:
            raise RuntimeError(f"layout {name} failed") from err
    return results


# ---- the single-process reference ---------------------------------------------------------
def _reference(path):
    from checks import single_process_training

    return single_process_training(path, steps=STEPS, save_at=SAVE_AT, optimizer=_optimizer, rows=_rows(),
                                   global_batch=GLOBAL_BATCH, mask=mask_some_labels, max_norm=MAX_NORM)


@pytest.fixture(scope="module")
def paths(tmp_path_factory):
    from models import save_checkpoint, tiny_config

    root = tmp_path_factory.mktemp("context_parallel")
    # qwen3: GQA, q/k norms, head_dim != hidden / heads; tied embeddings (one parameter under two names)
    return {"model": save_checkpoint(tiny_config("qwen3", tie_word_embeddings=True), str(root / "qwen3-tied")),
            "sliding": save_checkpoint(tiny_config("mistral"), str(root / "mistral")),
            "roots": {"cp": str(root / "ckpt-cp"), "plain": str(root / "ckpt-plain")}}


@pytest.fixture(scope="module")
def reference(paths):
    return _reference(paths["model"])


@pytest.fixture(scope="module")
def world4(paths):
    return run_ranks(4, _world4, paths["model"], paths["roots"], paths["sliding"], timeout=600)


# ---- tests on 4 ranks ----------------------------------------------------------------------
def test_every_layout_trains_like_single_process(world4, reference):
    assert any(norm > MAX_NORM for _, norm in reference["history"])  # clipping was active
    for name, *_ in LAYOUTS:
        runs = [r[name] for r in world4]
        for r in runs:  # every rank reports the same global loss and norm
            assert r["history"] == runs[0]["history"], name
        for (loss, norm), (ref_loss, ref_norm) in zip(runs[0]["history"], reference["history"]):
            assert abs(loss - ref_loss) < TOL, (name, runs[0]["history"], reference["history"])
            assert abs(norm - ref_norm) < TOL, (name, norm, ref_norm)  # global grad norm before clipping
        assert max_diff(runs[0]["grads"], reference["grads"]) < TOL, name  # every parameter, last step
        assert max_diff(runs[0]["params"], reference["params"]) < PARAM_TOL, name
        assert (torch.as_tensor(runs[0]["logits"]) - reference["logits"]).abs().max().item() < TOL, name
    assert world4[0]["2x1x2 hsdp"]["fsdp_mesh"] == (2, 2) and world4[0]["2x1x2"]["fsdp_mesh"] == (4,)


def test_checkpoints_move_between_cp_and_plain_layouts(world4, reference):
    savers = {"cp": "1x2x2", "plain": "2x2x1"}
    for saver in savers.values():
        assert max_diff(world4[0][saver]["saved_params"], reference["saved_params"]) < PARAM_TOL, saver
    for name, _, _, _, _, load_from in LAYOUTS:
        first, saver = world4[0][name], savers[load_from]
        layout = {"dp": int(saver[0]), "tp": int(saver[2]), "cp": int(saver[4])}
        assert first["loaded"] == {"step": SAVE_AT, "layout": layout}, name
        # bit-exact, whatever the layouts: CP -> no CP (2x2x1), no CP -> CP (2x1x2), CP -> CP (1x1x4)
        assert max_diff(first["loaded_params"], world4[0][saver]["saved_params"]) == 0.0, (name, saver)


def test_resume_gives_the_same_losses(world4):
    uninterrupted = world4[0]["1x2x2"]["history"][SAVE_AT:]
    assert world4[0]["1x2x2"]["resumed"] == uninterrupted  # same layout: bit-identical
    for name, *_ in LAYOUTS:
        resumed = world4[0][name]["resumed"]
        assert len(resumed) == STEPS - SAVE_AT
        for (loss, norm), (ref_loss, ref_norm) in zip(resumed, uninterrupted):
            assert abs(loss - ref_loss) < TOL and abs(norm - ref_norm) < TOL, (name, resumed, uninterrupted)


def test_unsupported_input_is_refused_by_name(world4):
    for r in world4:
        errors = r["1x1x4"]["refusals"]
        assert errors["mask"].startswith("ContextParallelError: qwen3: attention_mask is not supported"), errors
        assert errors["unpadded"] is True, errors
        assert "its sequence length 3 is odd" in errors["odd"], errors
        assert "position_ids must be the global positions of this rank's chunks" in errors["positions"], errors
        assert "logits_to_keep is not supported under context parallelism (cp_group)" in errors["logits_to_keep"], errors
        assert errors["sliding"] == ("ContextParallelError: mistral: context parallelism supports plain causal "
                                     "attention only; this model has sliding-window attention "
                                     "(config.sliding_window=8)"), errors


# ---- without processes ----------------------------------------------------------------------
@pytest.mark.parametrize("cp", [1, 2, 3, 4])
def test_split_and_unsplit_round_trip(cp):
    from fxparallel.runtime import split_sequence, unsplit_sequence

    x = torch.arange(2 * 24).view(2, 24) * 10
    parts = [split_sequence(x, rank, cp) for rank in range(cp)]
    assert torch.equal(unsplit_sequence(parts), x)
    c = 24 // (2 * cp)
    # rank i holds chunk i then chunk 2cp-1-i: every rank's tokens attend to the same amount of keys
    assert parts[0][0, :c].tolist() == x[0, :c].tolist() and parts[0][0, c:].tolist() == x[0, -c:].tolist()
    assert len({sum(range(j * c, (j + 1) * c)) + sum(range((2 * cp - 1 - j) * c, (2 * cp - j) * c))
                for j in range(cp)}) == 1


def test_batch_for_a_cp_rank_has_shifted_labels_and_global_positions():
    from fxparallel.runtime import label_tokens, split_for_context_parallel

    ids = torch.arange(8).view(1, 8) + 100
    labels = ids.clone()
    labels[0, 3] = -100
    parts = [split_for_context_parallel({"input_ids": ids, "labels": labels}, r, 2) for r in range(2)]
    assert parts[0]["input_ids"].tolist() == [[100, 101, 106, 107]]
    assert parts[0]["position_ids"].tolist() == [[0, 1, 6, 7]]
    assert parts[0]["labels"].tolist() == [[101, 102, 107, -100]]  # label t = token t+1; the last one none
    assert parts[1]["labels"].tolist() == [[-100, 104, 105, 106]]
    # shifted labels: every position counts; the cp ranks together count what the model's shift counts
    assert sum(int(label_tokens(p["labels"], shifted=True)) for p in parts) == int(label_tokens(labels)) == 6


def test_sequence_not_divisible_by_two_cp_is_refused():
    from fxparallel.errors import ContextParallelError
    from fxparallel.runtime import split_for_context_parallel

    ids = torch.zeros(2, 12, dtype=torch.long)
    with pytest.raises(ContextParallelError, match=r"sequence length 12 does not divide into 2\*cp = 8 equal chunks"):
        split_for_context_parallel({"input_ids": ids}, 0, 4)


def test_model_without_cp_on_a_cp_mesh_is_refused():
    from fxparallel.runtime import check_context_parallel

    with pytest.raises(ValueError, match=r"the mesh has CP_SIZE=2 but the model was parallelized for "
                                         r"context-parallel size 1: call fxparallel.parallelize\(\.\.\., "
                                         r"cp_group=mesh.cp_mesh\)"):
        check_context_parallel(object(), types.SimpleNamespace(cp=2))
    check_context_parallel(types.SimpleNamespace(cp_size=2), types.SimpleNamespace(cp=2))


def _captured(config, labels_shifted=True):
    from fxparallel.capture import GraphSpec, build_meta_model, capture

    meta = build_meta_model(config, dtype=torch.float32)
    return capture(meta, GraphSpec(("input_ids", "position_ids", "labels"), labels_shifted=labels_shifted))


def test_graphs_context_parallelism_would_get_wrong_are_refused():
    from models import tiny_config

    from fxparallel.errors import ContextParallelError
    from fxparallel.rewrite.context_parallel_checks import check_graph

    config = tiny_config("llama", num_hidden_layers=1)
    check_graph(_captured(config), "llama")  # the supported case passes
    with pytest.raises(ContextParallelError, match=r"llama: the loss transforms the labels \(getitem at "):
        check_graph(_captured(config, labels_shifted=False), "llama")  # the loss would shift inside a chunk
    config._attn_implementation = "eager"
    with pytest.raises(ContextParallelError, match="this model's graph has none \\(eager attention\\?\\)"):
        check_graph(_captured(config), "llama")


def test_attention_gathers_kv_heads_not_their_repeats():
    """GQA (8 query heads, 4 kv heads): the gather takes k and v before repeat_kv, half the bytes."""
    from models import tiny_config

    from fxparallel.group import fake_group
    from fxparallel.ops.context_parallel_attention import context_parallel_attention
    from fxparallel.rewrite.context_parallel import apply_context_parallel
    from fxparallel.rewrite.fx_nodes import SDPA

    graph = _captured(tiny_config("llama", num_hidden_layers=1)).gm.graph
    assert apply_context_parallel(graph, fake_group(2)) == 1
    assert not [n for n in graph.nodes if n.target in SDPA]
    (node,) = [n for n in graph.nodes if n.target is context_parallel_attention]
    q, k, v, _, scale, gqa = node.args
    heads = [t.meta["example_value"].shape[1] for t in (q, k, v)]
    assert heads == [8, 4, 4] and gqa is True and scale == pytest.approx(8 ** -0.5)
    assert not [n for n in graph.nodes if n.target == "expand" and len(n.args) == 6]  # repeat_kv is gone


class _Toy(torch.nn.Module):
    """A one-layer causal LM in miniature, with one variant a chunk could not compute."""

    def __init__(self, variant):
        super().__init__()
        self.variant = variant
        self.embed, self.positions = torch.nn.Embedding(16, 8), torch.nn.Embedding(16, 8)
        self.head = torch.nn.Linear(8, 16)
        self.router, self.experts = torch.nn.Linear(8, 4), torch.nn.Parameter(torch.randn(4, 8, 8))

    def forward(self, input_ids, position_ids, labels):
        h = self.embed(input_ids)
        q = h if self.variant == "unpositioned queries" else h + self.positions(position_ids)
        q, k = q.unsqueeze(1), h.unsqueeze(1)
        h = F.scaled_dot_product_attention(q, k, k, is_causal=self.variant != "bidirectional").squeeze(1)
        if self.variant == "cumsum":
            h = h.cumsum(1)
        if self.variant == "eager scores":
            h = torch.matmul(h, h.transpose(1, 2)).softmax(-1) @ h
        if self.variant == "batched scores":
            h = torch.bmm(h, h.transpose(1, 2)).softmax(-1) @ h
        if self.variant == "routed experts":  # transformers' batched_mm experts: a matrix per row, by routed ids
            rows, ids = h.reshape(-1, 8), self.router(h).argmax(-1).reshape(-1)
            h = torch.bmm(self.experts[ids].float(), rows.unsqueeze(-1)).squeeze(-1).reshape(h.shape)
        if self.variant == "grouped experts":  # grouped_mm's: rows sorted by expert, offsets from the counts
            rows, ids = h.reshape(-1, 8), self.router(h).argmax(-1).reshape(-1)
            ids, order = torch.sort(ids)
            offsets = torch.cumsum(torch.histc(ids.float(), bins=4, min=0, max=3), dim=0)
            h = (rows[order] * offsets[ids].unsqueeze(-1)).reshape(h.shape)
        return F.cross_entropy(self.head(h).view(-1, 16), labels.view(-1))


@pytest.mark.parametrize("variant, message", [
    ("plain", None),
    ("unpositioned queries", "the queries of scaled_dot_product_attention do not depend on position_ids"),
    ("bidirectional", "attention scaled_dot_product_attention is not causal"),
    ("cumsum", r"cumsum \(cumsum\) may mix tokens along the sequence"),
    ("eager scores", r"matmul \(matmul\) multiplies two activations"),
    ("batched scores", r"bmm \(bmm\) multiplies two activations"),
    ("routed experts", None),  # each row by its own expert's matrix: token by token
    ("grouped experts", None),  # a cumulative sum over the experts' counts, not the sequence
])
def test_sequence_mixing_outside_causal_sdpa_is_refused(variant, message):
    from fxparallel.errors import ContextParallelError
    from fxparallel.rewrite.context_parallel_checks import check_graph

    gm = torch.fx.symbolic_trace(_Toy(variant))
    ids = torch.randint(0, 16, (2, 6))
    torch.fx.passes.shape_prop.ShapeProp(gm).propagate(ids, torch.arange(6).expand(2, 6), ids)
    for node in gm.graph.nodes:  # the shapes Dynamo's capture records
        if hasattr(node.meta.get("tensor_meta"), "shape"):
            node.meta["example_value"] = torch.empty(node.meta["tensor_meta"].shape, device="meta")
    captured = types.SimpleNamespace(gm=gm, inputs={n: n for n in ("input_ids", "position_ids", "labels")})
    if message is None:
        check_graph(captured, "toy")
        return
    with pytest.raises(ContextParallelError, match=f"toy: {message}"):
        check_graph(captured, "toy")
