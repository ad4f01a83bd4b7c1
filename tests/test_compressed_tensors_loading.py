"""compressed-tensors FP8 checkpoints (llm-compressor's layout: quant_method "compressed-tensors", format
"float-quantized", float8 ``weight`` with ``weight_scale`` per tensor or per output channel, ``input_scale`` for
static activations) load exactly, dequantized to the compute dtype while each rank reads its own slice: loss,
logits and every gradient equal transformers' ``CompressedTensorsConfig(dequantize=True)`` model (fp32, 1e-5) at
TP=1, 2, 4 and 3 (uneven: kv heads 2/1/1, MLP 43/43/42), each weight bit for bit (fp32 and the config's bf16), and
a Qwen3-MoE's per-expert FP8 weights merged into 3-D experts and split by segments at TP=2; a rank
reads its slice's float8 bytes and the scales of its rows (a row-parallel slice: every row's scale), never the
input scales; save_pretrained writes the dequantized weights without quantization_config. Every other
compressed-tensors scheme, and a float8 weight without its scale or with a scale of another shape, is refused by
name.

The checkpoint mixes llm-compressor's FP8 scheme (attention: a float32 scale per tensor, static input scales) and
FP8_DYNAMIC (MLP: a bf16 scale per channel, dynamic activations). It is first checked to be transformers' layout:
its loader (with the compressed-tensors package) takes it, leaving only the input scales unused, and dequantizes it
to what ``ct_fp8_reference`` (plain torch: the weight in the scale's dtype times the scale) gives."""
from __future__ import annotations

import importlib.util
import os

import pytest
import torch

from checks import check_saved_dequantized
from distributed import run_ranks
from models import tiny_config
from quantized_checkpoints import (ct_fp8_checkpoint, ct_fp8_reference, ct_quantization_config, stored_tensors,
                                   transformers_ct)

TOL = 1e-5
transformers_loader = pytest.mark.skipif(importlib.util.find_spec("compressed_tensors") is None,
                                         reason="transformers reads compressed-tensors checkpoints with the "
                                                "compressed-tensors package (pip install compressed-tensors)")


@pytest.fixture(scope="module")
def ct(tmp_path_factory):
    root = tmp_path_factory.mktemp("ct")
    return {"path": ct_fp8_checkpoint(str(root / "llama"), tiny_config("llama"), seed=3), "root": root}


def _moe_checkpoint(directory: str) -> str:
    """A tiny Qwen3-MoE whose per-expert linears are FP8 per channel (merged by transformers' conversion mapping
    into 3-D experts, which it dequantizes in float32)."""
    import sys

    sys.path.insert(0, os.path.join(os.path.dirname(__file__), os.pardir, "benchmarks"))
    from tiny_configs import tiny_config as any_config

    config = any_config("qwen3_moe", hidden_size=64, moe_intermediate_size=64, head_dim=16, vocab_size=128,
                        num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=2)
    return ct_fp8_checkpoint(directory, config, seed=5)


def _reference(path: str, dtype=torch.float32):
    """transformers' decompressed model, or (without the compressed-tensors package) a float copy of the
    checkpoint dequantized by ``ct_fp8_reference``."""
    try:
        import compressed_tensors  # noqa: F401
    except ImportError:
        from transformers import AutoConfig, AutoModelForCausalLM

        config = AutoConfig.from_pretrained(path)
        del config.quantization_config
        stored = stored_tensors(path)
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
        model.load_state_dict({n: ct_fp8_reference(stored[n], stored[n + "_scale"], dtype) if n + "_scale" in stored
                               else stored[n].to(dtype) for n in model.state_dict()})
        return model.eval()
    return transformers_ct(path, dtype=dtype).eval()


# ---- the checkpoint is llm-compressor's layout, as transformers reads it (one process) ------------------------

@transformers_loader
def test_layout_is_the_one_transformers_loads_and_dequantizes_as_the_format_says(ct):
    model, info = transformers_ct(ct["path"], output_loading_info=True)
    assert not info["missing_keys"] and not info["mismatched_keys"], info
    assert info["unexpected_keys"] == {n for n in stored_tensors(ct["path"]) if n.endswith("input_scale")}  # not applied
    assert getattr(model.config, "quantization_config", None) is None
    assert all(type(m) is torch.nn.Linear for n, m in model.named_modules() if n.endswith("proj"))  # dense
    stored = stored_tensors(ct["path"])
    kinds = set()
    for name, p in model.named_parameters():
        if name + "_scale" in stored:
            assert stored[name].dtype == torch.float8_e4m3fn
            assert torch.equal(p, ct_fp8_reference(stored[name], stored[name + "_scale"])), name
            kinds.add((tuple(stored[name + "_scale"].shape) == (1,), stored[name + "_scale"].dtype))
        else:
            assert torch.equal(p, stored[name].float()), name
    assert kinds == {(True, torch.float32), (False, torch.bfloat16)}  # per tensor in f32, per channel in bf16


def test_any_piece_reads_its_rows_scales_only(ct):
    """Row and column pieces of a per-channel and a per-tensor weight dequantize to the reference's piece."""
    from fxparallel.load.fp8 import read_dequantized
    from fxparallel.load.safetensors_io import SafetensorsFile

    stored = stored_tensors(ct["path"])
    with SafetensorsFile(os.path.join(ct["path"], "model.safetensors")) as handle:
        for name, block in (("model.layers.0.mlp.up_proj.weight", (1, 64)),  # [128, 64], scales [128, 1]
                            ("model.layers.1.self_attn.q_proj.weight", (64, 64))):  # [64, 64], scale [1]
            full = ct_fp8_reference(stored[name], stored[name + "_scale"])
            for (r0, r1), (c0, c1) in (((0, 43), (0, 64)), ((43, 64), (0, 64)), ((0, 64), (21, 43)), ((5, 9), (1, 2))):
                scales = stored[name + "_scale"].reshape(-1, 1)[r0:r1] if block[0] == 1 else \
                    stored[name + "_scale"].reshape(1, 1)
                out = torch.empty(r1 - r0, c1 - c0)
                nbytes = read_dequantized(handle, name, (slice(r0, r1), slice(c0, c1)), out, scales, block)
                assert torch.equal(out, full[r0:r1, c0:c1]) and nbytes == (r1 - r0) * (c1 - c0), (name, r0, c0)


# ---- exact against transformers' decompressed model, on real ranks (one group of 4 for every case) -----------

def _compare(rank, world, path, save_to, moe):
    """tp=2 on ranks 0-1 (then save_pretrained) while rank 2 loads alone in fp32 and rank 3 alone in the config's
    bf16; tp=4 on all; tp=3 on ranks 0-2 (uneven); then ranks 0-1 load the Qwen3-MoE (``moe``, if given) at
    tp=2. Alone, every weight is compared bit for bit."""
    import warnings

    import torch.distributed as dist

    import fxparallel
    from checks import compare

    pair, triple = dist.new_group([0, 1]), dist.new_group([0, 1, 2])
    singles = [dist.new_group([r]) for r in range(world)]  # every rank creates every group
    cases = [(2, pair, None) if rank < 2 else (1, singles[rank], None if rank == 2 else torch.bfloat16),
             (4, dist.group.WORLD, None)]
    cases += [(3, triple, None)] if rank < 3 else []
    cases += [("moe", pair, None)] if moe and rank < 2 else []
    reference = _reference(path)
    out = {}
    for tp, group, dtype in cases:
        if tp == "moe":  # experts split by segments: gate rows and up rows of every expert
            model = fxparallel.parallelize(moe, group, dtype=torch.float32)
            out[tp] = compare(model, transformers_ct(moe).eval(), model.tp_group.rank, 2)
            out[tp]["summary"] = repr(model).splitlines()[0]
            continue
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            model = fxparallel.parallelize(path, group, dtype=dtype or torch.float32)
        tp_rank = model.tp_group.rank
        r = {"summary": repr(model).splitlines()[0], "bytes_read": model.bytes_read, "tp_rank": tp_rank,
             "unused": [str(w.message) for w in caught if "does not use" in str(w.message)],
             "expected_bytes": _expected_bytes(model, path, tp_rank, tp)}
        if dtype is None:
            r.update(compare(model, reference, tp_rank, tp))
        if tp == 1:
            expected = dict((reference if dtype is None else _reference(path, dtype)).named_parameters())
            r["unequal"] = [n for n, p in model.named_parameters()
                            if p.dtype != expected[n].dtype or not torch.equal(p, expected[n])]
        if tp == 2:
            model.save_pretrained(save_to)
        out[tp if dtype is None else "bf16"] = r
    return out


def test_compressed_tensors_fp8_matches_transformers_dequantized_at_tp_1_2_3_4(ct):
    save_to = str(ct["root"] / "saved-tp2")
    moe = _moe_checkpoint(str(ct["root"] / "moe")) if importlib.util.find_spec("compressed_tensors") else None
    per_rank = run_ranks(4, _compare, ct["path"], save_to, moe)
    stored = stored_tensors(ct["path"])
    total = sum(t.numel() * t.element_size() for t in stored.values())
    inputs = sum(t.numel() * t.element_size() for n, t in stored.items() if n.endswith("input_scale"))
    by_tp = {}
    for rank, results in enumerate(per_rank):
        moe_result = results.pop("moe", None)
        if moe_result is not None:
            assert moe_result["loss"] < TOL and moe_result["logits"] < TOL and moe_result["grad"] < TOL, moe_result
            assert "(per-channel and per-tensor scales)" in moe_result["summary"], moe_result["summary"]
        for tp, r in results.items():
            if tp != "bf16":
                assert r["loss"] < TOL and r["logits"] < TOL and r["grad"] < TOL, (tp, rank, r)
            assert not r.get("unequal"), (tp, r["unequal"])
            assert not r["unused"], r["unused"]  # the scales are read with their weights, input scales named
            assert ("weights dequantized from compressed-tensors fp8 (per-channel and per-tensor scales) on load"
                    in r["summary"]), r["summary"]
            assert r["bytes_read"] == r["expected_bytes"], (tp, rank, r["bytes_read"], r["expected_bytes"])
            by_tp.setdefault(tp, {})[r["tp_rank"]] = r["bytes_read"]
    assert by_tp[1][0] == by_tp["bf16"][0] == total - inputs  # one rank reads every tensor but the input scales
    for tp in (2, 3, 4):
        assert sorted(by_tp[tp]) == list(range(tp)), (tp, by_tp[tp])
        assert max(by_tp[tp].values()) < {2: 0.6, 3: 0.45, 4: 0.35}[tp] * total, (tp, by_tp[tp], total)
    print(f"compressed-tensors fp8 Llama: tensors {total} B (input scales {inputs} B); read per rank: " + "; ".join(
        f"tp={tp}: " + ", ".join(f"{by_tp[tp][r]} B ({100 * by_tp[tp][r] / total:.1f}%)" for r in sorted(by_tp[tp]))
        for tp in (2, 3, 4)))
    check_saved_dequantized(save_to, lambda: _reference(ct["path"]).state_dict())


def _expected_bytes(model, path: str, rank: int, tp: int) -> int:
    """The bytes a rank's slice needs: its slice of every tensor, and of a float8 weight's scales the whole
    per-tensor scale or the scales of the slice's rows; no input scale."""
    from fxparallel.load.safetensors_io import SafetensorsFile

    header = SafetensorsFile(os.path.join(path, "model.safetensors")).tensors
    total = 0
    for p in model.plan.params:
        info = header[p.name]
        scale = header.get(p.name + "_scale")
        for source, _ in p.pieces(rank, tp):
            bounds = [(s.start, s.stop) for s in source]
            n = 1
            for a, b in bounds:
                n *= b - a
            total += n * info.itemsize
            if scale is not None:
                rows = 1 if scale.shape == (1,) else bounds[0][1] - bounds[0][0]
                total += rows * scale.itemsize
    return total


# ---- refused by name ---------------------------------------------------------------------------------------

def _scheme(kind="float", bits=8, strategy="tensor", fmt="float-quantized", **weights):
    config = ct_quantization_config(fmt=fmt)
    for group in config["config_groups"].values():
        group["weights"].update(type=kind, num_bits=bits, strategy=strategy, **weights)
    return config


REFUSED = {  # llm-compressor's other schemes (and FP8 variants fxparallel does not read) -> what the error names
    "W4A16": (_scheme("int", 4, "group", "pack-quantized", group_size=128),
              r"quantizes int 4-bit weights, strategy 'group' \(format 'pack-quantized'\)"),
    "W8A8 int8": (_scheme("int", 8, "channel", "int-quantized"),
                  r"quantizes int 8-bit weights, strategy 'channel' \(format 'int-quantized'\)"),
    "NVFP4": (_scheme("float", 4, "tensor_group", "nvfp4-pack-quantized", group_size=16),
              r"quantizes float 4-bit weights, strategy 'tensor_group' \(format 'nvfp4-pack-quantized'\)"),
    "FP8 blocks": (_scheme(strategy="block", block_structure=[128, 128]),
                   r"float 8-bit weights, strategy 'block': fxparallel reads FP8 scales per tensor or per channel"),
    "FP8 packed": (_scheme(fmt="pack-quantized"), r"stored in format 'pack-quantized'"),
    "asymmetric": (_scheme(symmetric=False), r"asymmetric weights \(zero points\)"),
    "KV cache": (dict(ct_quantization_config(), kv_cache_scheme={"num_bits": 8, "type": "float"}),
                 r"quantizes the KV cache"),
    "2:4 sparse": (dict(ct_quantization_config(), sparsity_config={"format": "sparse-24-bitmask"}),
                   r"sparse \(sparsity_config format 'sparse-24-bitmask'\)"),
    "no groups": ({"quant_method": "compressed-tensors", "format": "dense"}, r"it has no config_groups"),
}


@pytest.mark.parametrize("scheme", sorted(REFUSED))
def test_other_compressed_tensors_schemes_are_refused_by_name(scheme):
    import fxparallel
    from fxparallel.errors import CheckpointError

    config = tiny_config("llama")
    config.quantization_config, message = REFUSED[scheme]
    with pytest.raises(CheckpointError, match=r"quant_method='compressed-tensors'\) \(.*" + message + r".*\); "
                                              r"fxparallel does not load these quantized weights .*dequantize=True"):
        fxparallel.plan_model(config, 2)


def _edits():
    def no_scale(tensors):
        del tensors["model.layers.0.mlp.up_proj.weight_scale"]

    def per_input_channel(tensors):  # [1, in]: a scale per input channel, which FP8 "channel" is not
        tensors["model.layers.1.mlp.down_proj.weight_scale"] = torch.ones(1, 128, dtype=torch.bfloat16)

    def zero_point(tensors):
        tensors["model.layers.0.self_attn.k_proj.weight_zero_point"] = torch.zeros(1, dtype=torch.float32)

    return {
        "no scale": (no_scale, r"'model.layers.0.mlp.up_proj.weight' in .* is torch.float8_e4m3fn but the checkpoint "
                               r"has no 'model.layers.0.mlp.up_proj.weight_scale'"),
        "scale shape": (per_input_channel, r"'model.layers.1.mlp.down_proj.weight_scale' has shape \[1, 128\], but "
                                           r"'model.layers.1.mlp.down_proj.weight' of shape \[64, 128\] needs \[1\] "
                                           r"\(a scale per tensor\) or \[64, 1\] \(per output channel\)"),
        "zero point": (zero_point, r"'model.layers.0.self_attn.k_proj.weight' in .* has zero points"),
    }


def test_weights_that_cannot_be_dequantized_are_refused_naming_them(tmp_path):
    import fxparallel
    from fxparallel.errors import CheckpointError
    from fxparallel.group import fake_group

    for i, (name, (edit, message)) in enumerate(sorted(_edits().items())):
        path = ct_fp8_checkpoint(str(tmp_path / f"edit{i}"), tiny_config("llama"), seed=3, edit=edit)
        with pytest.raises(CheckpointError, match=message):
            fxparallel.parallelize(path, fake_group(1), dtype=torch.float32)
