"""Comparisons of a parallelized model with the single-device transformers model (run inside ranks), and the
small helpers the tests share: a left-padded batch of prompts, the largest difference of two sets of tensors, what a call raised, a saved
dequantized checkpoint checked, an example script loaded."""
from __future__ import annotations

import os

import torch


def batch(vocab: int, b: int = 2, s: int = 9, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (b, s), generator=g)


def left_padded_prompts(shape=(2, 7), high: int = 200, seed: int = 4, low: int = 3):
    """(ids, attention_mask) of a batch of prompts whose first row is padded on the left by 2 tokens (id 0)."""
    ids = torch.randint(low, high, shape, generator=torch.Generator().manual_seed(seed))
    mask = torch.ones_like(ids)
    mask[0, :2] = 0
    return ids * mask, mask


def compare(model, reference, rank: int, tp: int, ids=None, gather_logits: bool = False, **kwargs) -> dict:
    """Loss, complete logits and every parameter gradient vs the reference; returns max abs errors.

    ``gather_logits``: take the complete logits from the labelled call (``gather_logits=True``)
    instead of a second call without labels (one graph instead of two)."""
    ids = batch(model.config.vocab_size) if ids is None else ids
    for p in list(model.parameters()) + list(reference.parameters()):
        p.grad = None
    out = model(input_ids=ids, labels=ids, **({"gather_logits": True} if gather_logits else {}), **kwargs)
    ref = reference(input_ids=ids, labels=ids, **kwargs)
    out.loss.backward()
    ref.loss.backward()
    logits = out.logits if gather_logits else model(input_ids=ids, **kwargs).logits
    # every alias of a tied parameter: transformers names it by module order, which can differ from ours
    ref_params = dict(reference.named_parameters(remove_duplicate=False))
    grad_err, checked = 0.0, 0
    for name, p in model.named_parameters():
        if ref_params[name].grad is None:  # not used by this forward (e.g. cross-attention of a decoder-only run)
            assert p.grad is None or not p.grad.any(), f"{name} has a gradient the reference does not"
            checked += 1
            continue
        expected = model.plan.param(name).shard_of(ref_params[name].grad, rank, tp)
        assert p.grad is not None, f"{name} got no gradient"
        assert p.grad.shape == expected.shape, (name, p.grad.shape, expected.shape)
        grad_err = max(grad_err, (p.grad - expected).abs().max().item())
        checked += 1
    assert checked == len(list(reference.parameters())), "every parameter must be compared"
    return {
        "loss": (out.loss - ref.loss).abs().item(),
        "logits": (logits - ref.logits).abs().max().item(),
        "grad": grad_err,
        "local_logits": tuple(out.local_logits.shape) if out.local_logits is not None else None,
        "logits_gathered_with_labels": out.logits is not None,
    }


def mask_some_labels(batch: dict) -> dict:
    """Mask some labels (-100), so dp ranks count different numbers of tokens."""
    labels = batch["labels"].clone()
    labels[batch["input_ids"] % 5 == 0] = -100
    return {"input_ids": batch["input_ids"], "labels": labels}


def full_values(model, mesh, of=None) -> dict:
    """Every parameter as a full tensor (a copy), by its plan name; ``of(p)`` picks another tensor of
    the parameter's shape instead (its gradient, an optimizer state). Collective: call on every rank."""
    from fxparallel.runtime.dtensor import full_tensor
    from fxparallel.runtime.fsdp import reshard

    reshard(model)
    return {model.plan.param(n).name: full_tensor(of(p) if of else p, model.plan.param(n), mesh).clone()
            for n, p in model.named_parameters()}


def as_numpy(tensors: dict) -> dict:
    return {k: v.float().numpy() for k, v in tensors.items()}


def single_process_training(path: str, *, steps: int, save_at: int, optimizer, rows, global_batch: int, mask,
                            max_norm: float) -> dict:
    """The reference a training layout must match: transformers' model in one process over the
    same global batches (``mask`` applied to each), clipped like the runtime clips. Returns the
    (loss, grad norm) history, the parameters at step ``save_at`` and at the end, the last
    gradients and the logits of the batch after the last step."""
    from transformers import AutoModelForCausalLM

    from fxparallel.runtime import StepBatches

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    opt = optimizer(model.parameters())
    data = StepBatches(rows, global_batch, 0, 1)
    ref = {"history": []}
    for step in range(steps):
        if step == save_at:
            ref["saved_params"] = {n: p.detach().clone() for n, p in model.named_parameters()}
        opt.zero_grad()
        loss = model(**mask(data.global_batch_at(step))).loss
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
        opt.step()
        ref["history"].append((loss.item(), norm.item()))
    ref["grads"] = {n: p.grad.clone() for n, p in model.named_parameters()}
    ref["params"] = {n: p.detach().clone() for n, p in model.named_parameters()}
    with torch.no_grad():
        ref["logits"] = model(input_ids=data.global_batch_at(steps)["input_ids"]).logits
    return ref


def max_diff(a: dict, b: dict) -> float:
    """The largest absolute difference over tensors (or arrays) of the same names; the names must agree."""
    assert set(a) == set(b), set(a) ^ set(b)
    return max((torch.as_tensor(a[k]) - torch.as_tensor(b[k])).abs().max().item() for k in a)


def raised(fn, kind=Exception) -> str:
    """What ``fn()`` raised, as "Type: message", or "no error"; an error not of ``kind`` propagates."""
    try:
        fn()
    except kind as err:  # the type and message are what the tests check
        return f"{type(err).__name__}: {err}"
    return "no error"


def check_saved_dequantized(directory: str, expected) -> dict:
    """save_pretrained of a model loaded from a quantized checkpoint wrote a config without quantization_config
    and float32 weights equal to ``expected()`` (a state dict, read after the saved model is loaded); returns
    the saved state dict."""
    import json

    from transformers import AutoModelForCausalLM

    with open(os.path.join(directory, "config.json")) as f:
        assert "quantization_config" not in json.load(f)
    saved = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).state_dict()
    reference = expected()
    for name, t in saved.items():
        assert t.dtype == torch.float32 and torch.equal(t, reference[name]), name
    return saved


def load_example(name: str = "train_3d", module_name: str = None):
    """examples/<name>.py as a module (not registered in sys.modules)."""
    import importlib.util

    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples", f"{name}.py")
    spec = importlib.util.spec_from_file_location(module_name or name, path)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    return example
