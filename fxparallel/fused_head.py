"""TRL's fused LM head on the parallel model: per-token log-probabilities computed across the vocabulary shards.

TRL's trainers (``SFTTrainer``, ``GRPOTrainer`` ...) call ``trl.trainer.utils.add_fused_lm_head(model, ...)``,
which replaces ``model.forward`` with one that answers ``model(..., labels=..., fused_lm_head=True)`` with
per-token log-probabilities (and entropy, top-1 hits ...) instead of logits: it runs ``model.base_model`` and
multiplies the hidden states by the whole ``lm_head.weight`` in tiles. On the parallel model the head is split by
vocabulary rows, so that forward would need the whole weight on every rank (or compute with a shard as if it were
whole). The model therefore keeps its own forward when TRL assigns that one, reads TRL's options from it
(``temperature``, the ``outputs`` asked for), and answers ``fused_lm_head=True`` itself: the graph computes this
rank's logits shard (the model's own logit scaling and softcapping included, as TRL applies them), and the
log-softmax is combined over the tp group, Megatron's vocab-parallel way: a max, a sum of exponentials, the label's
logit and the sum of p * z per token are each one all-reduce of a number per token (sums with an identity
backward, so every gradient is the single-device one); top-1 is the first index of the global maximum, as
``argmax`` picks it. The outputs are TRL's ``FusedCausalLMOutput``, zero where the label is -100. A mixture of
experts with ``output_router_logits`` (which TRL's trainers turn on) adds the model's load-balancing loss with the
config's coefficient and returns it as ``aux_loss``, as TRL's fused forward does (router_outputs.py).
"""
from __future__ import annotations

import functools
import inspect
from dataclasses import dataclass

import torch
import torch.distributed as dist

OPTIONAL_OUTPUTS = ("entropy", "log_sum_sq_probs", "mean_logits", "is_top1")
TRL_FUSED_FORWARD = "add_fused_lm_head.<locals>._fused_forward"


@dataclass(frozen=True)
class FusedHead:
    """TRL's options of a fused head: the temperature the logits are divided by, the optional outputs."""

    temperature: float = 1.0
    outputs: tuple = ("log_probs",)


def is_trl_fused_forward(value) -> bool:
    """Whether ``value`` (assigned to ``model.forward``) is the forward TRL's ``add_fused_lm_head`` builds."""
    func = getattr(value, "__func__", value)
    code = getattr(func, "__code__", None)  # (TRL's functools.wraps gives it the model's forward's names)
    return code is not None and getattr(code, "co_qualname", code.co_name) in (TRL_FUSED_FORWARD, "_fused_forward") \
        and func.__globals__.get("__name__", "").startswith("trl.")


def options_of(value) -> FusedHead:
    """The options TRL's fused forward ``value`` was built with; an error naming TRL's version when it does not
    hold them as this module knows (a TRL release that changed ``add_fused_lm_head``)."""
    import trl

    func = getattr(value, "__func__", value)
    found = inspect.getclosurevars(func).nonlocals
    missing = sorted({"temperature", "outputs", "cast_lm_head_to_fp32"} - set(found))
    if missing or not set(found["outputs"]) <= set(OPTIONAL_OUTPUTS) | {"log_probs"}:
        raise NotImplementedError(
            f"TRL {trl.__version__}'s add_fused_lm_head is not the one fxparallel computes across the vocabulary "
            f"shards (its forward holds {sorted(found)}, outputs {found.get('outputs')!r}); fxparallel is tested "
            "with trl 1.16")
    return FusedHead(float(found["temperature"]), tuple(found["outputs"]))


def adopt(model, value) -> bool:
    """``model.forward = value``: when ``value`` is TRL's fused forward, keep the model's own and record TRL's
    options (True); False for any other forward (assigned as usual)."""
    if not is_trl_fused_forward(value):
        return False
    model.__dict__["_fused_head"] = options_of(value)
    return True


def forward_of(model):
    """The model's forward for ``fused_lm_head=True``; a TypeError when no TRL fused head was added."""
    head = model.__dict__.get("_fused_head")
    if head is None:
        raise TypeError("fused_lm_head=True / shift_labels: TRL's fused LM head was not added to this model "
                        "(trl.trainer.utils.add_fused_lm_head(model) adds it, as TRL's trainers do)")
    return functools.partial(fused_forward, model, head)


def fused_forward(model, head: FusedHead, input_ids=None, labels=None, shift_labels=None, num_items_in_batch=None,
                  past_key_values=None, use_cache=None, logits_to_keep=0, gather_logits=None, compile_config=None,
                  return_dict=None, **kwargs):
    """``model(..., fused_lm_head=True)`` under TRL's fused head ``head``: TRL's ``FusedCausalLMOutput``."""
    from trl.trainer.utils import FusedCausalLMOutput

    asked = {"past_key_values": past_key_values is not None, "use_cache=True": bool(use_cache),
             "logits_to_keep": bool(logits_to_keep), "gather_logits": gather_logits is not None,
             "compile_config": compile_config is not None, "return_dict=False": return_dict is False}
    if any(asked.values()):
        raise TypeError(f"fused_lm_head=True scores every position without a KV cache and returns TRL's "
                        f"FusedCausalLMOutput: {', '.join(k for k, v in asked.items() if v)} is not taken with it")
    if (labels is None) == (shift_labels is None):
        raise TypeError("fused_lm_head=True needs labels (scored against the next position) or shift_labels "
                        "(already shifted), one of them")
    if model.cp_group is not None:
        raise NotImplementedError("TRL's fused LM head with context parallelism (cp_group) is not supported")
    text_config = model.config.get_text_config()
    # MoE models: the load-balancing loss as TRL's fused forward adds it (the config's flag and coefficient)
    if getattr(text_config, "output_router_logits", False):
        kwargs.setdefault("output_router_logits", True)
    out = model(input_ids=input_ids, gather_logits=False, use_cache=False, **kwargs)
    logits, start = (out.logits, 0) if out.local_logits is None else (out.local_logits, out.vocab_range[0])
    if shift_labels is None:
        logits, labels = logits[:, :-1], labels[:, 1:]
    else:
        labels = shift_labels
    labels = labels.to(logits.device)
    mask = labels != -100
    fields = _per_token(logits.float() / head.temperature, labels, mask, start, model, head.outputs)
    log_probs = fields["log_probs"]
    count = mask.sum().clamp(min=1) if num_items_in_batch is None else num_items_in_batch
    loss = -log_probs.sum() / count
    if out.aux_loss is not None:
        loss = loss + getattr(text_config, "router_aux_loss_coef", 0.0) * out.aux_loss
    return FusedCausalLMOutput(loss=loss, label_mask=mask, aux_loss=out.aux_loss, **fields)


def _per_token(z: torch.Tensor, labels: torch.Tensor, mask: torch.Tensor, start: int, model, outputs) -> dict:
    """TRL's per-token fields from this rank's logits ``z`` (vocabulary ``start`` .. ``start + z.shape[-1]``),
    zero where ``mask`` is False; each cross-rank combination one all-reduce over the tp group."""
    from .ops import collectives

    group = model.tp_group
    handle, tp = group.handle, group.size

    def total(x: torch.Tensor) -> torch.Tensor:  # a sum over the group; its backward is the identity
        return collectives.all_reduce(x, handle) if tp > 1 else x

    def reduced(x: torch.Tensor, op) -> torch.Tensor:  # without gradient
        if tp > 1:
            dist.all_reduce(x, op=op, group=group.process_group)
        return x

    local = z.shape[-1]
    peak = reduced(z.detach().amax(-1), dist.ReduceOp.MAX)
    shifted = z - peak.unsqueeze(-1)
    exp = shifted.exp()
    sum_exp = total(exp.sum(-1))
    log_z = peak + sum_exp.log()
    index = labels - start
    mine = mask & (index >= 0) & (index < local)
    label_logit = total(torch.where(mine, z.gather(-1, index.clamp(0, local - 1).unsqueeze(-1)).squeeze(-1), 0.0))
    fields = {"log_probs": (label_logit - log_z).masked_fill(~mask, 0.0)}
    fields.update({name: None for name in OPTIONAL_OUTPUTS})
    if "entropy" in outputs:  # log Z - sum p z
        fields["entropy"] = (log_z - total((exp * z).sum(-1)) / sum_exp).masked_fill(~mask, 0.0)
    with torch.no_grad():
        if "log_sum_sq_probs" in outputs:
            sq = reduced((shifted * 2).exp().sum(-1), dist.ReduceOp.SUM)
            fields["log_sum_sq_probs"] = (sq.log() - 2 * sum_exp.log()).masked_fill(~mask, 0.0)
        if "mean_logits" in outputs:
            vocab = reduced(z.new_tensor(float(local)), dist.ReduceOp.SUM)
            fields["mean_logits"] = (reduced(z.sum(-1), dist.ReduceOp.SUM) / vocab).masked_fill(~mask, 0.0)
        if "is_top1" in outputs:  # the first index of the global maximum, as argmax picks it
            first = z.argmax(-1) + start
            beyond = torch.iinfo(first.dtype).max
            first = reduced(torch.where(z.amax(-1) == peak, first, beyond), dist.ReduceOp.MIN)
            fields["is_top1"] = (first == labels) & mask
    return fields
