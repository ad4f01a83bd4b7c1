"""Training and distributed checkpoints of shards that are not plain even splits: fused projections
(segmented shards: Phi-3's ``qkv_proj`` and ``gate_up_proj``, split on dim 0, where FSDP's chunk of the
TP shard straddles q/k/v; GPT-2's Conv1D ``c_attn``, split on dim 1, across FSDP's chunks of dim 0;
GPT-BigCode's multi-query ``c_attn``, whose single k and v head every rank keeps whole), and OPT's tied
vocabulary and learned position table and MLP width (``ffn_dim``) of odd sizes, split in torch.chunk's
uneven sizes (positions 33/32 at tp=2, 17/17/17/14 at tp=4; the vocabulary, tied to lm_head, 128/127 and
64/64/64/63; the MLP 64/63 and 32/32/32/31). Two clipped AdamW steps at dp=2 x tp=2 match one process
(loss and global grad norm); saved with AdamW state (exp_avg, exp_avg_sq), loaded bit-exactly into tp=4
and (Phi-3, GPT-2: docs/reference.md's claim) into dp=4 x tp=1; resuming in the saving layout repeats the
uninterrupted step; the consolidated export loads in transformers with the same logits. The checkpoint's views of
fused weights are views of FSDP's chunk (no copy), whether split on dim 1 (GPT-2's) or on dim 0 like FSDP.

Time: capture is most of this test (4 ranks on the CPUs a machine has). The dp replicas of a tp rank plan
the same graph, so the first replica plans it and the others read it from the session's graph cache, as a
relaunch would (``_setup``): one capture per tp rank instead of one per rank."""
from __future__ import annotations

import os
import sys

import torch

from checks import full_values, max_diff
from distributed import run_ranks

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))

TYPES = ("phi3", "gpt2", "gpt_bigcode", "opt")
# positions + 2 (OPT's offset): 65 rows; both tables and the MLP width (``ffn_dim``) uneven at tp=2 and tp=4
CONFIGS = {"opt": dict(max_position_embeddings=63, vocab_size=255, word_embed_proj_dim=64, ffn_dim=127)}


def _opt_splits(vocab: tuple, positions: tuple, mlp: tuple, layers: int = 2) -> dict:
    mlp_params = [f"model.decoder.layers.{i}.{p}" for i in range(layers) for p in ("fc1.weight", "fc1.bias", "fc2.weight")]
    return {"model.decoder.embed_tokens.weight": (vocab,), "model.decoder.embed_positions.weight": (positions,),
            **{name: (mlp,) for name in mlp_params}}


OPT_SPLITS = {2: _opt_splits((128, 127), (33, 32), (64, 63)),
              4: _opt_splits((64, 64, 64, 63), (17, 17, 17, 14), (32, 32, 32, 31))}
# layouts the dp=2 x tp=2 checkpoint is loaded into: tp=4 (GPT-BigCode's k/v rows whole again), and
# dp=4 x tp=1 for Phi-3 (FSDP's chunks straddle q/k/v differently) and GPT-2 (q/k/v on dim 1, FSDP on dim 0)
LAYOUTS = {"phi3": ((4, 1), (1, 4)), "gpt2": ((4, 1), (1, 4)), "gpt_bigcode": ((4, 1),), "opt": ((4, 1),)}
# the segmented shards (GPT-2's c_attn: the bias, the weight)
PLANS = {"gpt2": ["S(0)[64,64,64]", "S(1)[64,64,64]"], "gpt_bigcode": ["S(0)[64,8R,8R]"]}
# 2 rows per rank at dp=4: a local batch of 1 would fall outside the training graph's shape guards (a size-1
# dimension is specialized), and every rank would capture a second graph
SEQ, BATCH = 8, 8


def _batch(vocab: int, step: int) -> dict:
    g = torch.Generator().manual_seed(100 + step)
    ids = torch.randint(0, vocab, (BATCH, SEQ), generator=g)
    return {"input_ids": ids, "labels": ids}


STATE_KEYS = ("exp_avg", "exp_avg_sq")


def _setup(path, tp, dp):
    import torch.distributed as dist

    import fxparallel
    from fxparallel.runtime import apply_data_parallel, init_mesh

    mesh = init_mesh(tp=tp, dp=dp, cp=1)
    if mesh.dp_rank:  # the first replica plans (into the graph cache); the others read its graphs
        dist.barrier()
    model = fxparallel.parallelize(path, mesh.tp_mesh, dtype=torch.float32)
    if not mesh.dp_rank:
        dist.barrier()
    model = apply_data_parallel(model, mesh)
    return mesh, model, torch.optim.AdamW(model.parameters(), lr=1e-3)


def _step(model, opt, mesh, step):
    from fxparallel.runtime import train_step

    batch = _batch(model.config.vocab_size, step)
    rows = batch["input_ids"].shape[0] // mesh.dp
    local = {k: v[mesh.dp_rank * rows:(mesh.dp_rank + 1) * rows] for k, v in batch.items()}
    metrics = train_step(model, opt, local, mesh, max_norm=1.0)
    return metrics.loss, metrics.grad_norm


def _single_process(path, steps: int = 2) -> list:
    """(loss, grad norm) of the same clipped AdamW steps in transformers' model in one process."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    history = []
    for step in range(steps):
        opt.zero_grad()
        loss = model(**_batch(model.config.vocab_size, step)).loss
        loss.backward()
        history.append((loss.item(), torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0).item()))
        opt.step()
    return history


def _states(model, opt, mesh) -> dict:
    return {(key, name): value for key in STATE_KEYS
            for name, value in full_values(model, mesh, lambda p: opt.state[p][key]).items()}


def _run(rank, world, paths, root):
    from fxparallel.runtime import export_pretrained, load_checkpoint, save_checkpoint

    results = {}
    for name, path in paths.items():
        ckpt = os.path.join(root, name, "ckpt")
        r = {}
        mesh, model, opt = _setup(path, tp=2, dp=2)
        r["plan"] = sorted({str(p.placement) for p in model.plan.params if "[" in str(p.placement)})
        r["split"] = {p.name: p.split for p in model.plan.params if p.split}
        r["history"] = [_step(model, opt, mesh, step) for step in range(2)]
        r["saved"] = full_values(model, mesh)
        r["saved_state"] = _states(model, opt, mesh)
        r["copied views"] = _copied_segment_views(model, opt, mesh)
        save_checkpoint(ckpt, model, opt, mesh, 2)
        r["next_loss"] = _step(model, opt, mesh, 2)
        export_pretrained(model, mesh, os.path.join(root, name, "export"))
        ids = _batch(model.config.vocab_size, 9)["input_ids"]
        with torch.no_grad():  # the training graph's logits (gathered): no second graph without labels
            r["logits"] = model(input_ids=ids, labels=ids, gather_logits=True).logits.clone()
        load_checkpoint(ckpt, model, opt, mesh)
        r["reloaded"] = full_values(model, mesh)
        r["resumed_loss"] = _step(model, opt, mesh, 2)
        for tp, dp in LAYOUTS[name]:
            mesh, model, opt = _setup(path, tp=tp, dp=dp)
            _step(model, opt, mesh, 0)  # creates optimizer state, then overwritten by the load
            load_checkpoint(ckpt, model, opt, mesh)
            r[f"loaded_{dp}x{tp}"] = full_values(model, mesh)
            r[f"split_{dp}x{tp}"] = {p.name: p.split for p in model.plan.params if p.split}
            r[f"loaded_state_{dp}x{tp}"] = _states(model, opt, mesh)
        if rank == 0:  # as numpy: tensors would travel through shared memory that dies with the rank
            results[name] = {k: _numpy(v) for k, v in r.items()}
        else:
            results[name] = {k: r[k] for k in ("next_loss", "resumed_loss")}
    return results


def _copied_segment_views(model, opt, mesh) -> list:
    """The fused weights' checkpoint views (parameters and AdamW states) that are copies rather than views of
    this rank's FSDP chunk."""
    from fxparallel.runtime.checkpoint import state_dict_views
    from fxparallel.runtime.dtensor import local_part

    own = {local_part(t).untyped_storage().data_ptr() for p in model.parameters()
           for t in [p, *(v for v in opt.state[p].values() if v.dim())]}
    return sorted(key.rsplit(".segment", 1)[0] for key, view in
                  state_dict_views(model, opt, mesh, with_optimizer=True).items()
                  if ".segment" in key and local_part(view).untyped_storage().data_ptr() not in own)


def _numpy(value):
    if isinstance(value, dict):
        return {k: _numpy(v) for k, v in value.items()}
    return value.numpy() if isinstance(value, torch.Tensor) else value


def test_fused_weights_checkpoint_across_layouts(tmp_path):
    from transformers import AutoModelForCausalLM

    from models import save_checkpoint
    from tiny_configs import tiny_config

    paths = {t: save_checkpoint(tiny_config(t, **CONFIGS.get(t, {})), str(tmp_path / t)) for t in TYPES}
    results = run_ranks(4, _run, paths, str(tmp_path / "runs"), timeout=900)
    for name in TYPES:
        r = results[0][name]
        if name == "opt":
            assert r["split"] == OPT_SPLITS[2] and r["split_1x4"] == OPT_SPLITS[4], (r["split"], r["split_1x4"])
        else:
            assert r["plan"], (name, "expected segmented (fused) shards")
        if name in PLANS:
            assert r["plan"] == PLANS[name], (name, r["plan"])
        # under FSDP (dim 0 split) the fused weights' views, along dim 1 (GPT-2's Conv1D c_attn) or dim 0 (Phi-3's
        # qkv_proj and gate_up_proj, GPT-BigCode's c_attn, the fused biases), are views of the rank's own chunk
        assert r["copied views"] == [], (name, r["copied views"])
        for (loss, norm), (ref_loss, ref_norm) in zip(r["history"], _single_process(paths[name])):
            assert abs(loss - ref_loss) < 1e-5 and abs(norm - ref_norm) < 1e-5, (name, r["history"])
        assert max_diff(r["reloaded"], r["saved"]) == 0.0, name
        for layout in (f"{dp}x{tp}" for tp, dp in LAYOUTS[name]):
            assert max_diff(r[f"loaded_{layout}"], r["saved"]) == 0.0, (name, layout)
            assert max_diff(r[f"loaded_state_{layout}"], r["saved_state"]) == 0.0, (name, layout)
        for rank in results:
            assert rank[name]["resumed_loss"] == rank[name]["next_loss"], name
        exported = AutoModelForCausalLM.from_pretrained(str(tmp_path / "runs" / name / "export"),
                                                        dtype=torch.float32).eval()
        ids = _batch(exported.config.vocab_size, 9)["input_ids"]
        with torch.no_grad():
            assert (exported(input_ids=ids).logits - torch.from_numpy(r["logits"])).abs().max().item() < 1e-5, name
