"""Fine-grained FP8 checkpoints (quant_method "fp8", weight_block_size [128, 128], as DeepSeek-V3/R1 and
Qwen3-*-FP8 publish them) load exactly, dequantized to the compute dtype while each rank reads its own slice:
loss, logits and every gradient equal transformers' dequantized model (fp32, 1e-5) at TP=1, 2, 4 and 3 (uneven),
with splits that cut through 128 x 128 blocks; a rank reads only its slice's float8 bytes and the scale blocks
covering it; save_pretrained writes the dequantized weights and a config without quantization_config; in bf16
(the config's dtype) every weight equals transformers' bit for bit; per-expert FP8 weights merged into 3-D experts
and split by segments (Qwen3-MoE) match too; a float8 weight without its scales is refused naming it.
The "aligned" Llama (dimensions multiples of 128) is compared with transformers' dequantize=True model; the
"unaligned" one (partial last blocks, which transformers 5.24's dequantize=True path cannot read) with a float
copy dequantized by transformers' FP8Linear dequantization (fp8_checkpoints.dequantized_copy).

Every multi-rank case runs in one spawned group of 4 ranks (``_every_case``), whose results the tests assert."""
from __future__ import annotations

import os

import pytest
import torch

from checks import check_saved_dequantized
from distributed import run_ranks
from fp8_checkpoints import (ALIGNED, UNALIGNED, dequantized_copy, fp8_checkpoint, transformers_dequantized)
from models import tiny_config

TOL = 1e-5


@pytest.fixture(scope="module")
def fp8(tmp_path_factory):
    root = tmp_path_factory.mktemp("fp8")
    aligned = fp8_checkpoint(str(root / "aligned"), tiny_config("llama", **ALIGNED), seed=3)
    unaligned = fp8_checkpoint(str(root / "unaligned"), tiny_config("llama", **UNALIGNED), seed=4)
    return {"aligned": aligned, "unaligned": unaligned,
            "unaligned-reference": dequantized_copy(unaligned, str(root / "unaligned-reference")), "root": root}


def _reference(paths: dict, kind: str):
    from models import reference

    return transformers_dequantized(paths[kind]) if kind == "aligned" else reference(paths[kind + "-reference"])


# ---- the checkpoints are the hub's layout, as transformers reads it (one process) ----------------------------

def test_layout_is_the_one_transformers_loads(fp8):
    from safetensors import safe_open
    from transformers import AutoConfig, AutoModelForCausalLM, FineGrainedFP8Config
    from transformers.integrations.finegrained_fp8 import replace_with_fp8_linear

    # transformers' loader takes the aligned checkpoint whole: every tensor consumed, nothing missing
    model, info = AutoModelForCausalLM.from_pretrained(
        fp8["aligned"], dtype=torch.float32, quantization_config=FineGrainedFP8Config(dequantize=True),
        output_loading_info=True)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    assert all(p.dtype == torch.float32 for p in model.parameters())
    assert getattr(model.config, "quantization_config", None) is None  # transformers drops it once dequantized
    # both checkpoints hold exactly the parameters of transformers' FP8 model (FP8Linear: float8 weight and
    # float32 weight_scale_inv of [ceil(out/128), ceil(in/128)]; lm_head and the skipped o_proj plain)
    for kind in ("aligned", "unaligned"):
        config = AutoConfig.from_pretrained(fp8[kind])
        qc = FineGrainedFP8Config(**{k: v for k, v in config.quantization_config.items() if k != "quant_method"})
        with torch.device("meta"):
            quantized = AutoModelForCausalLM.from_config(config)
        replace_with_fp8_linear(quantized, ["lm_head", "model.layers.1.self_attn.o_proj"], qc, pre_quantized=True)
        expected = {n: (tuple(t.shape), t.dtype) for n, t in quantized.state_dict().items()}
        with safe_open(os.path.join(fp8[kind], "model.safetensors"), "pt") as f:
            stored = {n: (tuple(f.get_slice(n).get_shape()), f.get_tensor(n).dtype) for n in f.keys()}
        plain = {n: s for n, (s, dt) in expected.items() if dt != torch.float8_e4m3fn and "scale" not in n}
        assert set(stored) == set(expected), (kind, set(stored) ^ set(expected))
        for n, (shape, dtype) in expected.items():
            assert stored[n][0] == shape, (kind, n, stored[n], shape)
            if n not in plain:
                assert stored[n][1] == dtype, (kind, n, stored[n], dtype)


# ---- exact against transformers' dequantized model, on real ranks (one group of 3 for every case) -----------

def _moe_checkpoint(directory: str) -> str:
    """Each expert's gate/up/down stored as float8 with its scales (``mlp.experts.{e}.gate_proj.weight``,
    ``..._scale_inv``), merged by transformers' conversion into ``mlp.experts.gate_up_proj`` [E, 2 x 384, 256],
    whose TP=2 slice is two segments (gate rows 0..191 and up rows 0..191 of every expert) cutting block 1."""
    import sys

    sys.path.insert(0, os.path.join(os.path.dirname(__file__), os.pardir, "benchmarks"))
    from tiny_configs import tiny_config as any_config

    config = any_config("qwen3_moe", hidden_size=256, moe_intermediate_size=384, head_dim=32, vocab_size=128,
                        num_attention_heads=8, num_key_value_heads=4, num_hidden_layers=2)
    return fp8_checkpoint(directory, config, seed=5, not_converted=("lm_head",))


def _load_and_compare(group, tp, paths, references, save_to, kinds=("aligned", "unaligned")):
    """The Llamas ``kinds`` over ``group`` (``tp`` ranks) against transformers' dequantized models; ``save_to``:
    then save_pretrained each into it."""
    import warnings

    import fxparallel
    from checks import compare

    out = {}
    for kind in kinds:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            model = fxparallel.parallelize(paths[kind], group, dtype=torch.float32)
        tp_rank = model.tp_group.rank
        r = compare(model, references[kind], tp_rank, tp)
        r["tp_rank"] = tp_rank
        r["bytes_read"] = model.bytes_read
        r["expected_bytes"] = _expected_bytes(model, paths[kind], tp_rank, tp)
        r["summary"] = repr(model)
        r["unused"] = [str(w.message) for w in caught if "does not use" in str(w.message)]
        if save_to is not None:
            model.save_pretrained(os.path.join(save_to, kind))
        out[kind] = r
    return out


def _compare_moe(group, path):
    import fxparallel
    from checks import compare

    model = fxparallel.parallelize(path, group, dtype=torch.float32)
    reference, info = _moe_reference(path)
    r = compare(model, reference, model.tp_group.rank, model.tp_group.size)
    r["info"] = {k: list(v) for k, v in info.items() if k != "error_msgs"}
    r["placements"] = {p.name: str(p.placement) for p in model.plan.params if "experts" in p.name}
    return r


def _every_case(rank, world, paths, save_to, moe):
    """tp=2 on ranks 0-1 (then save_pretrained) while rank 2 loads alone (tp=1); the aligned Llama at tp=4 on all
    four; the unaligned one at tp=3 on ranks 0-2 (uneven: MLP columns 107/107/106, splits through
    blocks); then the per-expert Qwen3-MoE at tp=2 on ranks 0-1. Each rank builds the references it needs once."""
    import torch.distributed as dist

    pair, triple = dist.new_group([0, 1]), dist.new_group([0, 1, 2])
    singles = [dist.new_group([r]) for r in range(world)]  # every rank creates every group
    references = {kind: _reference(paths, kind) for kind in ("aligned", "unaligned")}
    out = {}
    if rank < 2:
        out[2] = _load_and_compare(pair, 2, paths, references, save_to)
    elif rank == 2:
        out[1] = _load_and_compare(singles[rank], 1, paths, references, None)
    out[4] = _load_and_compare(dist.group.WORLD, 4, paths, references, None, kinds=("aligned",))
    if rank < 3:
        out[3] = _load_and_compare(triple, 3, paths, references, None, kinds=("unaligned",))
    if rank < 2:
        out["moe"] = _compare_moe(pair, moe)
    return out


@pytest.fixture(scope="module")
def on_ranks(fp8):
    """Every multi-rank case, run in one spawned group of 4: {tp: results per tp rank, "moe": results per rank,
    "saved": the tp=2 save_pretrained folder}."""
    saved = str(fp8["root"] / "saved-tp2")
    moe = _moe_checkpoint(str(fp8["root"] / "moe"))
    per_rank = run_ranks(4, _every_case, {k: v for k, v in fp8.items() if k != "root"}, saved, moe, timeout=900)
    out = {"saved": saved}
    for key in (1, 2, 3, 4, "moe"):
        ranked = [r[key] for r in per_rank if key in r]
        if key != "moe":  # in tp-rank order
            ranked.sort(key=lambda results: next(iter(results.values()))["tp_rank"])
            assert [r["tp_rank"] for results in ranked for r in results.values()] == \
                [i for i in range(key) for _ in ranked[0]], (key, ranked)
        out[key] = ranked
    return out


@pytest.mark.parametrize("tp", [1, 2, 3, 4])
def test_fp8_matches_transformers_dequantized(fp8, on_ranks, tp):
    per_rank = on_ranks[tp]
    assert len(per_rank) == tp
    for rank, results in enumerate(per_rank):
        for kind, r in results.items():
            assert r["loss"] < TOL and r["logits"] < TOL and r["grad"] < TOL, (kind, tp, rank, r)
            assert not r["unused"], r["unused"]  # the scales are read with their weights
            assert "weights dequantized from fp8 (blocks 128x128) on load" in r["summary"], r["summary"]
    if tp == 1:  # one rank reads every tensor whole
        for kind in ("aligned", "unaligned"):
            assert per_rank[0][kind]["bytes_read"] == sum(_stored_bytes(fp8[kind]).values()), (kind, per_rank[0][kind])
    if tp > 1:
        for kind in per_rank[0]:
            _check_bytes_read(fp8[kind], [r[kind] for r in per_rank], tp)
    if tp == 2:
        for kind in ("aligned", "unaligned"):
            reference = _reference(fp8, kind)
            check_saved_dequantized(os.path.join(on_ranks["saved"], kind), reference.state_dict)


def _expected_bytes(model, path: str, rank: int, tp: int) -> int:
    """The bytes a rank's slice needs: of a float8 weight its slice (1 byte an element) and the float32 scales
    of the 128 x 128 blocks the slice touches; of any other tensor its slice."""
    from fxparallel.load.safetensors_io import SafetensorsFile

    header = SafetensorsFile(os.path.join(path, "model.safetensors")).tensors
    total = 0
    for p in model.plan.params:
        info = header[p.name]
        for source, _ in p.pieces(rank, tp):
            (r0, r1), (c0, c1) = [(s.start, s.stop) for s in source] if len(source) == 2 else [(0, 1), (
                source[0].start, source[0].stop)]
            total += (r1 - r0) * (c1 - c0) * info.itemsize
            if p.name + "_scale_inv" in header:
                total += ((r1 - 1) // 128 - r0 // 128 + 1) * ((c1 - 1) // 128 - c0 // 128 + 1) * 4
    return total


def _stored_bytes(path: str) -> dict:
    from fxparallel.load.safetensors_io import SafetensorsFile

    return {n: i.end - i.start for n, i in SafetensorsFile(os.path.join(path, "model.safetensors")).tensors.items()}


def _check_bytes_read(path: str, results: list, tp: int) -> None:
    """Each rank reads exactly its slice of every tensor (the norms whole) and of the scales only the blocks its
    slice touches."""
    stored = _stored_bytes(path)
    total = sum(stored.values())
    for rank, r in enumerate(results):
        assert r["bytes_read"] == r["expected_bytes"], (path, rank, r["bytes_read"], r["expected_bytes"])
        assert r["bytes_read"] < 0.7 * total, (path, rank, r["bytes_read"], total)
    float8 = sum(n for k, n in stored.items() if k + "_scale_inv" in stored)
    print(f"{os.path.basename(path)}: file {os.path.getsize(os.path.join(path, 'model.safetensors'))} B, tensors "
          f"{total} B (float8 {float8} B, scales {sum(n for k, n in stored.items() if k.endswith('_scale_inv'))} B, "
          f"others {total - float8 - sum(n for k, n in stored.items() if k.endswith('_scale_inv'))} B), read at "
          f"tp={tp}: "
          + ", ".join(f"rank {i} {r['bytes_read']} B ({100 * r['bytes_read'] / total:.1f}%)"
                      for i, r in enumerate(results)))


def test_default_dtype_bf16_weights_equal_transformers_bit_for_bit(fp8):
    """Without dtype=, the config's (bfloat16, as the hub's FP8 configs say): every weight equals transformers'
    dequantized bf16 model exactly (float32 product, then one cast)."""
    import fxparallel
    from fxparallel.group import fake_group

    model = fxparallel.parallelize(fp8["aligned"], fake_group(1))
    reference = dict(transformers_dequantized(fp8["aligned"], dtype=torch.bfloat16).named_parameters())
    for name, p in model.named_parameters():
        assert p.dtype == torch.bfloat16 and torch.equal(p, reference[name]), name


# ---- refused by name ---------------------------------------------------------------------------------------

def test_fp8_weight_without_its_scales_is_refused_naming_it(tmp_path):
    import fxparallel
    from fxparallel.errors import CheckpointError
    from fxparallel.group import fake_group

    def drop(tensors):
        del tensors["model.layers.0.mlp.up_proj.weight_scale_inv"]

    path = fp8_checkpoint(str(tmp_path / "noscale"), tiny_config("llama", **UNALIGNED), edit=drop)
    with pytest.raises(CheckpointError, match=r"'model.layers.0.mlp.up_proj.weight' in .* is torch.float8_e4m3fn "
                                              r"but the checkpoint has no "
                                              r"'model.layers.0.mlp.up_proj.weight_scale_inv'"):
        fxparallel.parallelize(path, fake_group(1), dtype=torch.float32)


def test_fp8_scales_of_the_wrong_shape_are_refused(tmp_path):
    import fxparallel
    from fxparallel.errors import CheckpointError
    from fxparallel.group import fake_group

    def per_tensor(tensors):  # one scale for the whole weight, in a config that says 128 x 128 blocks
        tensors["model.layers.0.mlp.down_proj.weight_scale_inv"] = torch.ones(1, 1)

    path = fp8_checkpoint(str(tmp_path / "badscale"), tiny_config("llama", **UNALIGNED), edit=per_tensor)
    with pytest.raises(CheckpointError, match=r"'model.layers.0.mlp.down_proj.weight_scale_inv' has shape \[1, 1\], "
                                              r"but 'model.layers.0.mlp.down_proj.weight' of shape \[192, 320\] in "
                                              r"blocks of \[128, 128\] \(weight_block_size\) needs \[2, 3\]"):
        fxparallel.parallelize(path, fake_group(1), dtype=torch.float32)


# ---- per-expert FP8 weights merged into 3-D experts (Qwen3-*-A3B-FP8's layout) -------------------------------

def _moe_reference(path):
    from transformers import AutoModelForCausalLM, FineGrainedFP8Config

    model, info = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, output_loading_info=True,
                                                       quantization_config=FineGrainedFP8Config(dequantize=True))
    return model.eval(), info


def test_fp8_experts_merged_and_split_by_segments(on_ranks):
    """Each expert's gate/up/down stored as float8 with its scales, merged into 3-D experts and split at TP=2 by
    segments (``_moe_checkpoint``), on ranks 0-1 of the group."""
    per_rank = on_ranks["moe"]
    assert len(per_rank) == 2
    for rank, r in enumerate(per_rank):
        assert not any(r["info"].values()), r["info"]
        assert r["loss"] < TOL and r["logits"] < TOL and r["grad"] < TOL, (rank, r)
