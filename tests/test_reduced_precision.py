"""Reduced precision (bf16, fp16) on CPU/gloo (on a GPU: test_cuda.py).

The bounds are relative to the values and to transformers' own error: the parallel model in a reduced dtype is
compared with transformers' float32 model, and its error must be within a few times the error transformers'
own model makes in that dtype (against the same float32 model), plus a floor of a few ulps of the values'
scale. A wrong value (an all-zero logit, a gradient not reduced over the ranks) is off by the order of the
values themselves, far outside such a bound; the test checks that for each tensor too (``_meaningful``).
"""
from __future__ import annotations

import pytest
import torch

from distributed import run_ranks


DTYPES = ("bfloat16", "float16")
K = 4.0  # times transformers' own reduced-precision error
FLOOR_ULPS = 4.0  # plus this many ulps of the tensor's largest value
REL_NORM = 0.05  # relative norm error, ||ours - fp32|| / ||fp32||: transformers' own is below 1 % here


def _errors(ours, theirs, fp32) -> tuple:
    """(max abs error vs fp32, transformers' own max abs error vs fp32, max |fp32|, relative norm error,
    transformers' own relative norm error); every tensor in float32."""
    ours, theirs, fp32 = ours.float(), theirs.float(), fp32.float()
    norm = fp32.norm().item()
    return ((ours - fp32).abs().max().item(), (theirs - fp32).abs().max().item(), fp32.abs().max().item(),
            (ours - fp32).norm().item() / norm if norm else 0.0,
            (theirs - fp32).norm().item() / norm if norm else 0.0)


def _low_precision(rank, tp, path):
    """Per dtype (one spawn for both): the errors of the loss, the complete logits and every gradient shard,
    ours and transformers' own in that dtype, each against transformers' float32 model."""
    import torch
    import torch.distributed as dist

    import fxparallel
    from checks import batch
    from transformers import AutoModelForCausalLM

    ids = batch(128, 2, 9)
    fp32 = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    r32 = fp32(input_ids=ids, labels=ids)
    r32.loss.backward()
    fp32_params = dict(fp32.named_parameters())
    results = {}
    for dtype_name in DTYPES:
        dtype = getattr(torch, dtype_name)
        model = fxparallel.parallelize(path, dist.group.WORLD, dtype=dtype)
        ref = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()
        out = model(input_ids=ids, labels=ids, gather_logits=True)  # complete logits from the labelled call
        r = ref(input_ids=ids, labels=ids)
        out.loss.backward()
        r.loss.backward()
        ref_params = dict(ref.named_parameters())
        grads = {}
        for n, p in model.named_parameters():
            shard = p._fxparallel.shard_of
            grads[n] = _errors(p.grad, shard(ref_params[n].grad, rank, tp), shard(fp32_params[n].grad, rank, tp))
        results[dtype_name] = {
            "loss": _errors(out.loss, r.loss, r32.loss),
            "logits": _errors(out.logits, r.logits, r32.logits),
            "grads": grads,
            "dtypes": ({p.dtype for p in model.parameters()}, out.logits.dtype),
        }
    return results


@pytest.fixture(scope="module")
def low_precision(checkpoints):
    return run_ranks(2, _low_precision, checkpoints["llama"])


def _bound(errors, eps) -> float:
    _, own, scale, _, _ = errors
    return K * own + FLOOR_ULPS * eps * scale


def _meaningful(name, errors, eps):
    """The bound rejects a wrong value: an all-zero tensor (error = its scale) or half of it (a sum over two
    ranks left unreduced is off by the other rank's part) are both outside it."""
    _, _, scale, _, own_rel = errors
    assert _bound(errors, eps) < 0.25 * scale, (name, errors)
    assert own_rel < REL_NORM / 2, (name, errors)


@pytest.mark.parametrize("dtype_name", DTYPES)
def test_reduced_precision_tp2_close_to_single_device(low_precision, dtype_name):
    dtype = getattr(torch, dtype_name)
    eps = torch.finfo(dtype).eps
    for results in low_precision:
        r = results[dtype_name]
        assert r["dtypes"] == ({dtype}, dtype)
        loss = r["loss"]
        assert loss[0] <= _bound(loss, eps), ("loss", loss)
        checks = [("logits", r["logits"])] + sorted(r["grads"].items())
        assert len(r["grads"]) == 3 + 2 * 9  # embed, norm, lm_head and 9 tensors per layer: every gradient
        for name, errors in checks:
            _meaningful(name, errors, eps)
            err, own, scale, rel, own_rel = errors
            assert err <= _bound(errors, eps), f"{name}: max error {err:.3g} > {K} x transformers' {own:.3g} + " \
                                               f"{FLOOR_ULPS} ulps of {scale:.3g}"
            assert rel < REL_NORM, f"{name}: relative norm error {rel:.3g} (transformers' own {own_rel:.3g})"
