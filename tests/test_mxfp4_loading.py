"""MXFP4 checkpoints (GPT-OSS's experts as ``*_blocks`` / ``*_scales``, quant_method "mxfp4") load exactly,
dequantized to the compute dtype while each rank reads its own slice: loss, logits and every gradient equal
transformers' dequantized model (fp32, 1e-5) at TP=1, 2, 4 and 3 (uneven: MLP 160 as 54/53/53), with splits
that cut 32-value blocks (down_proj's blocked dim splits 80/80 and 40 x 4); a rank reads only its slice's blocks
and their scales; save_pretrained writes the dequantized weights and a config without quantization_config; every
weight equals transformers' bit for bit (fp32 and the config's bf16); pieces by experts, rows or columns read
exactly; blocks without scales, or of the wrong shape, and MXFP4 outside GPT-OSS are refused naming them.

The checkpoint is first checked to be transformers' layout: its loader takes it with nothing missing or
unexpected and dequantizes it to what ``mxfp4_reference`` (the format's definition in plain torch) gives."""
from __future__ import annotations

import os

import pytest
import torch

from checks import check_saved_dequantized
from distributed import run_ranks
from quantized_checkpoints import (MXFP4_EXPERTS, mxfp4_checkpoint, mxfp4_reference, stored_tensors,
                                   transformers_mxfp4)

TOL = 1e-5


@pytest.fixture(scope="module")
def mxfp4(tmp_path_factory):
    root = tmp_path_factory.mktemp("mxfp4")
    return {"path": mxfp4_checkpoint(str(root / "gpt-oss"), seed=3), "root": root}


# ---- the checkpoint is the hub's layout, as transformers reads it (one process) ----------------------------

def test_layout_is_the_one_transformers_loads_and_dequantizes_as_the_format_says(mxfp4):
    model, info = transformers_mxfp4(mxfp4["path"], output_loading_info=True)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    assert getattr(model.config, "quantization_config", None) is None  # transformers drops it once dequantized
    stored = stored_tensors(mxfp4["path"])
    experts = 0
    for name, p in model.named_parameters():
        if name + "_blocks" in stored:
            assert stored[name + "_blocks"].dtype == stored[name + "_scales"].dtype == torch.uint8
            assert torch.equal(p, mxfp4_reference(stored[name + "_blocks"], stored[name + "_scales"])), name
            experts += 1
        else:
            assert torch.equal(p, stored[name].float()), name
    assert experts == 2 * model.config.num_hidden_layers


def test_any_piece_reads_its_blocks_and_scales_only(mxfp4):
    """Pieces of the stored [E, rows, cols] by experts, rows and columns (cutting blocks, partial at both ends)
    dequantize to the reference's piece, reading exactly the piece's blocks."""
    from fxparallel.load.mxfp4 import read_dequantized
    from fxparallel.load.safetensors_io import SafetensorsFile

    stored = stored_tensors(mxfp4["path"])
    name = "model.layers.1.mlp.experts.down_proj"  # [4, 160, 64]: stored [4, 64, 160] in blocks of 32 columns
    full = mxfp4_reference(stored[name + "_blocks"], stored[name + "_scales"]).transpose(1, 2)
    handle = SafetensorsFile(os.path.join(mxfp4["path"], "model.safetensors"))
    with handle:
        for index in [((0, 4), (0, 64), (0, 160)), ((1, 3), (0, 64), (0, 160)), ((0, 4), (17, 40), (0, 160)),
                      ((0, 4), (0, 64), (54, 107)), ((2, 3), (5, 6), (31, 33)), ((3, 4), (63, 64), (159, 160))]:
            (e0, e1), (r0, r1), (c0, c1) = index
            g0, g1 = c0 // 32, (c1 - 1) // 32 + 1
            scales = stored[name + "_scales"][e0:e1, r0:r1, g0:g1]
            out = torch.empty(e1 - e0, r1 - r0, c1 - c0, dtype=torch.float32)
            nbytes = read_dequantized(handle, name + "_blocks", index, out, scales)
            assert torch.equal(out, full[e0:e1, r0:r1, c0:c1]), index
            assert nbytes == (e1 - e0) * (r1 - r0) * (g1 - g0) * 16, (index, nbytes)


# ---- exact against transformers' dequantized model, on real ranks (one group of 4 for every case) -----------

def _compare(rank, world, path, save_to):
    """tp=4 on all four ranks; tp=2 on ranks 0-1 (then save_pretrained) while rank 2 loads alone in fp32 and rank 3
    alone in the config's bf16 (every weight compared bit for bit); tp=3 on ranks 0-2 (uneven)."""
    import warnings

    import torch.distributed as dist

    import fxparallel
    from checks import compare

    groups = {4: dist.group.WORLD, 2: dist.new_group([0, 1]), 3: dist.new_group([0, 1, 2])}
    singles = [dist.new_group([r]) for r in range(world)]  # every rank creates every group
    cases = [(4, None), (2, None) if rank < 2 else (1, None if rank == 2 else torch.bfloat16)]
    cases += [(3, None)] if rank < 3 else []
    reference = transformers_mxfp4(path).eval()
    out = {}
    for tp, dtype in cases:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            model = fxparallel.parallelize(path, groups.get(tp, singles[rank]), dtype=dtype or torch.float32)
        unused = [str(w.message) for w in caught if "does not use" in str(w.message)]
        r = {"summary": repr(model).splitlines()[0], "unused": unused, "bytes_read": model.bytes_read,
             "expected_bytes": _expected_bytes(model, path, model.tp_group.rank, tp), "tp_rank": model.tp_group.rank}
        if dtype is None:
            r.update(compare(model, reference, model.tp_group.rank, tp))
        if tp == 1:  # every weight, bit for bit
            expected = dict((reference if dtype is None else transformers_mxfp4(path, dtype=dtype)).named_parameters())
            r["unequal"] = [n for n, p in model.named_parameters()
                            if p.dtype != expected[n].dtype or not torch.equal(p, expected[n])]
        if tp == 2:
            model.save_pretrained(save_to)
        out[tp if dtype is None else "bf16"] = r
    return out


def test_mxfp4_matches_transformers_dequantized_at_tp_1_2_3_4(mxfp4):
    save_to = str(mxfp4["root"] / "saved-tp2")
    per_rank = run_ranks(4, _compare, mxfp4["path"], save_to)
    total = sum(t.numel() * t.element_size() for t in stored_tensors(mxfp4["path"]).values())
    by_tp = {}
    for rank, results in enumerate(per_rank):
        for tp, r in results.items():
            if tp != "bf16":
                assert r["loss"] < TOL and r["logits"] < TOL and r["grad"] < TOL, (tp, rank, r)
            assert not r.get("unequal"), (tp, r["unequal"])
            assert not r["unused"], r["unused"]  # the scales are read with their blocks
            assert "weights dequantized from mxfp4 on load" in r["summary"], r["summary"]
            assert r["bytes_read"] == r["expected_bytes"], (tp, rank, r["bytes_read"], r["expected_bytes"])
            by_tp.setdefault(tp, {})[r["tp_rank"]] = r["bytes_read"]
    assert by_tp[1][0] == by_tp["bf16"][0] == total  # one rank reads every tensor whole
    for tp in (2, 3, 4):
        assert max(by_tp[tp].values()) < {2: 0.7, 3: 0.55, 4: 0.45}[tp] * total, (tp, by_tp[tp], total)
    print(f"mxfp4 GPT-OSS: tensors {total} B; read per rank: " + "; ".join(
        f"tp={tp}: " + ", ".join(f"{by_tp[tp][r]} B ({100 * by_tp[tp][r] / total:.1f}%)" for r in sorted(by_tp[tp]))
        for tp in (2, 3, 4)))
    _check_saved(save_to, mxfp4["path"])


def _expected_bytes(model, path: str, rank: int, tp: int) -> int:
    """The bytes a rank's slice needs: of an expert weight the blocks (16 B) and scale (1 B) of every 32-value block
    its piece touches (the piece transposed: the parameter's last dim is the stored rows); of any other tensor its
    slice."""
    from fxparallel.load.safetensors_io import SafetensorsFile

    header = SafetensorsFile(os.path.join(path, "model.safetensors")).tensors
    total = 0
    for p in model.plan.params:
        for source, _ in p.pieces(rank, tp):
            bounds = [(s.start, s.stop) for s in source]
            if p.name + "_blocks" in header:
                (e0, e1), (c0, c1), (r0, r1) = bounds  # [E, cols, rows] = the stored [E, rows, cols] transposed
                total += (e1 - e0) * (r1 - r0) * ((c1 - 1) // 32 - c0 // 32 + 1) * 17
            else:
                info = header[p.name]
                n = 1
                for a, b in bounds:
                    n *= b - a
                total += n * info.itemsize
    return total


def _check_saved(directory: str, path: str) -> None:
    """save_pretrained wrote the dequantized weights (plain gate_up_proj / down_proj) and no quantization_config."""
    saved = check_saved_dequantized(directory, lambda: transformers_mxfp4(path).state_dict())
    assert any(n.endswith(MXFP4_EXPERTS[0]) for n in saved)


# ---- refused by name ---------------------------------------------------------------------------------------

def test_blocks_without_scales_are_refused_naming_them(tmp_path):
    import fxparallel
    from fxparallel.errors import CheckpointError
    from fxparallel.group import fake_group

    def drop(tensors):
        del tensors["model.layers.0.mlp.experts.down_proj_scales"]

    path = mxfp4_checkpoint(str(tmp_path / "noscale"), seed=3, edit=drop)
    with pytest.raises(CheckpointError, match=r"'model.layers.0.mlp.experts.down_proj' is stored as MXFP4 but .* has "
                                              r"'model.layers.0.mlp.experts.down_proj_blocks' and the checkpoint no "
                                              r"'model.layers.0.mlp.experts.down_proj_scales'"):
        fxparallel.parallelize(path, fake_group(1), dtype=torch.float32)


def test_blocks_of_the_wrong_shape_are_refused(tmp_path):
    import fxparallel
    from fxparallel.errors import CheckpointError
    from fxparallel.group import fake_group

    def regroup(tensors):  # blocks of 64 values (32 bytes) instead of 32
        name = "model.layers.1.mlp.experts.gate_up_proj"
        tensors[name + "_blocks"] = tensors[name + "_blocks"].reshape(4, 320, 1, 32)
        tensors[name + "_scales"] = tensors[name + "_scales"][..., :1].contiguous()

    path = mxfp4_checkpoint(str(tmp_path / "badshape"), seed=3, edit=regroup)
    with pytest.raises(CheckpointError, match=r"'model.layers.1.mlp.experts.gate_up_proj' is stored as MXFP4 blocks "
                                              r"'model.layers.1.mlp.experts.gate_up_proj_blocks' \[4, 320, 1, 32\] and "
                                              r"scales .* \[4, 320, 1\] .*fxparallel reads "
                                              r"\[experts, rows, blocks, 16\]"):
        fxparallel.parallelize(path, fake_group(1), dtype=torch.float32)


def test_mxfp4_outside_gpt_oss_is_refused():
    import fxparallel
    from fxparallel.errors import CheckpointError
    from models import tiny_config

    config = tiny_config("llama")
    config.quantization_config = {"quant_method": "mxfp4", "modules_to_not_convert": ["lm_head"]}
    with pytest.raises(CheckpointError, match=r"quant_method='mxfp4'\) \(transformers dequantizes MXFP4 experts of "
                                              r"gpt_oss only, and this config is a 'llama'\)"):
        fxparallel.plan_model(config, 2)
