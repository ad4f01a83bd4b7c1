"""The parallel model behaves like the Hugging Face model it replaces (fxparallel/hf_methods.py):
save_pretrained writes a checkpoint transformers loads with the original's logits (plain TP and
under FSDP), the embedding views compute what transformers' modules compute, print(model) shows
every placement, to(dtype) equals parallelizing in that dtype, return_dict=False and the
checkpoint's generation_config work, and everything else is a clear error naming what to do.
One spawn of 2 gloo ranks runs every case."""
from __future__ import annotations

import os
import re

from checks import raised
from distributed import run_ranks


def _max_diff(a, b) -> float:
    return (a.detach().double() - b.detach().double()).abs().max().item()


def _saved_logits_error(directory, ref, ids) -> float:
    """Logits of transformers' model loaded from ``directory`` against the original's."""
    import torch
    from transformers import AutoModelForCausalLM

    with torch.no_grad():
        loaded = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
        return _max_diff(loaded(input_ids=ids).logits, ref(input_ids=ids).logits)


def _hf_methods(rank, world, path, root):
    import torch
    import torch.distributed as dist

    import fxparallel
    from fxparallel.runtime import apply_data_parallel, init_mesh
    from models import reference

    out = {}
    model = fxparallel.parallelize(path, dist.group.WORLD, dtype=torch.float32)
    ref = reference(path)
    ids = torch.randint(0, 128, (2, 9), generator=torch.Generator().manual_seed(0))

    # ---- print(model): placements, shapes and this rank's range -------------------------------------
    out["repr"] = repr(model)

    # ---- embeddings: views over this rank's shard that compute what transformers' modules compute ----
    emb, head = model.get_input_embeddings(), model.get_output_embeddings()
    hidden = torch.randn(2, 9, 64, generator=torch.Generator().manual_seed(1))
    out["embedding"] = (emb.vocab_range, emb.num_embeddings, emb.embedding_dim, tuple(emb.weight.shape),
                        emb.weight is model.get_parameter("model.embed_tokens.weight"),
                        _max_diff(emb(ids), ref.get_input_embeddings()(ids)))
    out["head"] = (head.vocab_range, head.out_features, head.in_features,
                   _max_diff(head(hidden), ref.get_output_embeddings()(hidden)))

    # ---- forward as transformers: return_dict=False, harmless flags; the checkpoint's generation config
    labelled = model(input_ids=ids, labels=ids, gather_logits=True, output_attentions=False,
                     output_hidden_states=None)
    expected = ref(input_ids=ids, labels=ids)
    as_tuple = model(input_ids=ids, labels=ids, gather_logits=True, return_dict=False)
    out["forward"] = (abs(labelled.loss.item() - expected.loss.item()), _max_diff(labelled.logits, expected.logits),
                      isinstance(as_tuple, tuple), as_tuple[0].item() == labelled.loss.item(),
                      _max_diff(as_tuple[1], labelled.logits))
    gc = model.generation_config
    out["generation_config"] = (gc.max_length, gc.eos_token_id, gc.temperature, gc.do_sample)

    # ---- other transformers methods ------------------------------------------------------------------
    local_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    model.requires_grad_(False)
    frozen = model(input_ids=ids, labels=ids).loss.requires_grad
    model.requires_grad_(True)
    state = model.state_dict()
    out["misc"] = {
        "tie_weights": model.tie_weights(), "enable_input_require_grads": model.enable_input_require_grads(),
        "name_or_path": model.name_or_path == path, "main_input_name": model.main_input_name,
        "can_generate": model.can_generate(), "footprint": model.get_memory_footprint(return_buffers=False)
        == local_bytes, "state_dict q_proj": tuple(state["model.layers.0.self_attn.q_proj.weight"].shape),
        "hasattr hf_quantizer": hasattr(model, "hf_quantizer"), "requires_grad_(False)": frozen,
        "train/eval": (model.train().training, model.eval().training),
    }

    # ---- save_pretrained: transformers loads it with the original's logits ----------------------------
    saved = os.path.join(root, "saved")
    model.save_pretrained(saved, max_shard_size="100KB")
    if rank == 0:
        from transformers import GenerationConfig

        out["saved files"] = sorted(os.listdir(saved))
        out["saved logits"] = _saved_logits_error(saved, ref, ids)
        out["saved generation_config"] = GenerationConfig.from_pretrained(saved).max_length
    model.save_pretrained(os.path.join(root, "nobody"), is_main_process=False)  # gathers, writes nothing
    out["is_main_process=False wrote"] = os.path.exists(os.path.join(root, "nobody"))

    # ---- clear errors --------------------------------------------------------------------------------
    blocker = os.path.join(root, "a_file")
    if rank == 0:
        open(blocker, "w").close()
    dist.barrier()
    out["errors"] = {
        "save into a file": raised(lambda: model.save_pretrained(blocker)),  # rank 0 fails: every rank raises
        "push_to_hub": raised(lambda: model.save_pretrained(saved, push_to_hub=True)),
        "state_dict": raised(lambda: model.save_pretrained(saved, state_dict={})),
        "safe_serialization": raised(lambda: model.save_pretrained(saved, safe_serialization=False)),
        "unknown save argument": raised(lambda: model.save_pretrained(saved, save_function=print)),
        "inputs_embeds": raised(lambda: model(input_ids=ids, inputs_embeds=torch.zeros(2, 9, 64))),
        "output_hidden_states": raised(lambda: model(input_ids=ids, labels=ids, output_hidden_states=True)),
        "device": raised(lambda: model.to("meta")),
        "prepare_inputs_for_generation": raised(lambda: model.prepare_inputs_for_generation(ids)),
        "get_decoder": raised(lambda: model.get_decoder()),
        "set_input_embeddings": raised(lambda: model.set_input_embeddings(None)),
        "resize_token_embeddings": raised(lambda: model.resize_token_embeddings(256)),
    }

    # ---- to(dtype): equal to parallelizing in that dtype -------------------------------------------
    from transformers import CompileConfig

    # a compiled generate keeps its cache (generation/loop.py); the cast drops it with the graphs
    config = CompileConfig(backend=lambda gm, example_inputs: gm.forward, fullgraph=True, dynamic=False, mode=None)
    generating = dict(input_ids=ids, max_new_tokens=3, do_sample=False, pad_token_id=0)
    model.generate(**generating, compile_config=config)
    kept = model._graph_set.kept_cache is not None
    model.bfloat16()
    direct = fxparallel.parallelize(path, dist.group.WORLD, dtype=torch.bfloat16)
    cast_out = model(input_ids=ids, labels=ids, gather_logits=True)
    direct_out = direct(input_ids=ids, labels=ids, gather_logits=True)
    out["cast"] = (model.dtype, {p.dtype for p in model.parameters()}, model.plan.dtype, cast_out.logits.dtype,
                   _max_diff(cast_out.logits, direct_out.logits), _max_diff(cast_out.loss, direct_out.loss),
                   "bfloat16 on cpu" in repr(model))
    out["cast drops the kept cache"] = (kept, model._graph_set.kept_cache is None, torch.equal(
        model.generate(**generating, compile_config=config), direct.generate(**generating)))
    del direct

    # ---- under FSDP (tp=1 x dp=2: each parameter split over the dp ranks) ----------------------------
    mesh = init_mesh(tp=1, dp=2)
    fsdp = apply_data_parallel(fxparallel.parallelize(path, mesh.tp_mesh, dtype=torch.float32), mesh)
    fsdp_dir = os.path.join(root, "fsdp")
    fsdp.save_pretrained(fsdp_dir)
    if rank == 0:
        out["fsdp saved logits"] = _saved_logits_error(fsdp_dir, ref, ids)
    out["fsdp cast"] = raised(lambda: fsdp.half())
    out["fsdp repr"] = repr(fsdp).splitlines()[0]
    return out


def test_hugging_face_methods(tmp_path):
    from transformers import GenerationConfig

    from models import save_checkpoint, tiny_config

    path = save_checkpoint(tiny_config("llama"), str(tmp_path / "llama"))
    GenerationConfig(max_length=33, eos_token_id=[2, 5], do_sample=True, temperature=0.7).save_pretrained(path)
    results = run_ranks(2, _hf_methods, path, str(tmp_path), timeout=600)
    for rank, out in enumerate(results):
        text = out["repr"]
        assert text.startswith(f"ParallelCausalLM(llama, tp=2, rank={rank}, float32 on cpu: 90,432 parameters"), text
        half = "0:32" if rank == 0 else "32:64"
        # one row per layer group: placement, kind of split, full shape, this rank's shape and range
        assert re.search(r"model\.layers\.\{0-1\}\.self_attn\.q_proj\.weight +x2 +S\(0\) +column-parallel linear +"
                         rf"64x64 +32x64 \(rows {half}\)", text), text
        assert re.search(rf"model\.layers\.\{{0-1\}}\.mlp\.down_proj\.weight +x2 +S\(1\) +row-parallel linear +"
                         rf"64x128 +64x64 \(cols {'0:64' if rank == 0 else '64:128'}\)", text), text
        assert re.search(r"model\.layers\.\{0-1\}\.input_layernorm\.weight +x2 +R +replicated +64 +64\n", text), text
        assert re.search(rf"lm_head\.weight +S\(0\) .* 128x64 +64x64 \(rows {'0:64' if rank == 0 else '64:128'}\)",
                         text), text
        vocab = (0, 64) if rank == 0 else (64, 128)
        assert out["embedding"][:5] == (vocab, 128, 64, (64, 64), True) and out["embedding"][5] < 1e-6, out["embedding"]
        assert out["head"][:3] == (vocab, 128, 64) and out["head"][3] < 1e-5, out["head"]
        loss_err, logits_err, is_tuple, loss_first, tuple_logits_err = out["forward"]
        assert loss_err < 1e-5 and logits_err < 1e-5 and is_tuple and loss_first and tuple_logits_err == 0
        assert out["generation_config"] == (33, [2, 5], 0.7, True)
        assert out["misc"] == {"tie_weights": None, "enable_input_require_grads": None, "name_or_path": True,
                               "main_input_name": "input_ids", "can_generate": True, "footprint": True,
                               "state_dict q_proj": (32, 64), "hasattr hf_quantizer": False,
                               "train/eval": (True, False), "requires_grad_(False)": False}, out["misc"]
        assert not out["is_main_process=False wrote"]
        errors = out["errors"]
        if rank == 0:
            assert errors["save into a file"].startswith(("FileExistsError", "NotADirectoryError")), errors
        else:
            assert errors["save into a file"].startswith("CheckpointError: rank 0 failed to write"), errors
        assert "save_pretrained(push_to_hub=...) is not supported" in errors["push_to_hub"]
        assert "huggingface_hub.upload_folder" in errors["push_to_hub"]
        assert "save_pretrained(state_dict=...) is not supported" in errors["state_dict"]
        assert "save_pretrained(safe_serialization=...) is not supported" in errors["safe_serialization"]
        assert "unsupported arguments ['save_function']" in errors["unknown save argument"]
        assert errors["inputs_embeds"].startswith("TypeError") and "inputs_embeds: the graphs take token ids: " \
            "pass input_ids" in errors["inputs_embeds"]
        assert "output_hidden_states: hidden states are not returned" in errors["output_hidden_states"]
        assert errors["device"].startswith("ShardingError: this parallel model was captured and loaded in float32 "
                                           "on cpu; moving it to float32 on meta is not supported: pass device=")
        assert errors["prepare_inputs_for_generation"].startswith("NotImplementedError") and \
            "model.new_cache(length)" in errors["prepare_inputs_for_generation"]
        assert errors["get_decoder"].startswith("MissingHuggingFaceMethod") and \
            "does not implement PreTrainedModel.get_decoder" in errors["get_decoder"]
        assert "save_pretrained it, and parallelize the saved directory" in errors["set_input_embeddings"]
        assert "resize_token_embeddings is not supported" in errors["resize_token_embeddings"]
        import torch

        assert out["cast"][:4] == (torch.bfloat16, {torch.bfloat16}, "bfloat16", torch.bfloat16), out["cast"]
        assert out["cast"][4:] == (0.0, 0.0, True), out["cast"]
        assert out["cast drops the kept cache"] == (True, True, True), out["cast drops the kept cache"]
        assert "cannot cast the parallel model to float16 under apply_data_parallel" in out["fsdp cast"]
        assert "data parallel: shard" in out["fsdp repr"], out["fsdp repr"]
    first = results[0]
    assert "model.safetensors.index.json" in first["saved files"] and "generation_config.json" in first["saved files"]
    assert first["saved logits"] < 1e-5, first["saved logits"]
    assert first["saved generation_config"] == 33
    assert first["fsdp saved logits"] < 1e-5, first["fsdp saved logits"]
