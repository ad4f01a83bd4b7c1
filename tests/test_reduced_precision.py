"""Reduced precision (bf16, fp16) on CPU/gloo (on a GPU: test_cuda.py)."""
from __future__ import annotations

import pytest
import torch

from distributed import run_ranks


DTYPES = ("bfloat16", "float16")


def _low_precision(rank, tp, path):
    """Per dtype (one spawn for both): loss, logits and gradient errors vs transformers in that dtype."""
    import torch
    import torch.distributed as dist

    import fxparallel
    from checks import batch
    from transformers import AutoModelForCausalLM

    results = {}
    for dtype_name in DTYPES:
        dtype = getattr(torch, dtype_name)
        model = fxparallel.parallelize(path, dist.group.WORLD, dtype=dtype)
        ref = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()
        ids = batch(128, 2, 9)
        out = model(input_ids=ids, labels=ids, gather_logits=True)  # complete logits from the labelled call
        r = ref(input_ids=ids, labels=ids)
        out.loss.backward()
        r.loss.backward()
        ref_params = dict(ref.named_parameters())
        grad_err = max(
            ((p.grad.float() - p._fxparallel.shard_of(ref_params[n].grad, rank, tp).float()).abs().max().item())
            for n, p in model.named_parameters()
        )
        results[dtype_name] = ((out.loss.float() - r.loss.float()).abs().item(),
                               (out.logits.float() - r.logits.float()).abs().max().item(), grad_err,
                               {p.dtype for p in model.parameters()}, out.logits.dtype)
    return results


@pytest.fixture(scope="module")
def low_precision(checkpoints):
    return run_ranks(2, _low_precision, checkpoints["llama"])


@pytest.mark.parametrize("dtype_name", DTYPES)
def test_reduced_precision_tp2_close_to_single_device(low_precision, dtype_name):
    dtype = getattr(torch, dtype_name)
    for results in low_precision:
        loss_err, logit_err, grad_err, param_dtypes, logits_dtype = results[dtype_name]
        assert param_dtypes == {dtype} and logits_dtype == dtype
        # same dtype, different summation order: differences of a few ulps of the dtype
        eps = torch.finfo(dtype).eps
        assert loss_err < 8 * eps * 5, loss_err
        assert logit_err < 64 * eps, logit_err
        assert grad_err < 64 * eps, grad_err
