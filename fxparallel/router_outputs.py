"""transformers' ``output_router_logits`` on the parallel model: the mixture-of-experts load-balancing loss and
the routers' logits, as the Hugging Face model returns them; and ``output_tokens_per_expert``: the tokens routed to
each expert of every MoE layer, for any router (capture/expert_counts.py).

Asked for by the argument or, when it is None, by ``config.output_router_logits`` read at each call (as
transformers reads it), so a config changed after ``parallelize`` is followed: such calls run a graph captured
with the flag (capture/spec.py). The routers' inputs are replicated over the tensor-parallel ranks, so their
logits and the loss term are the single-device values on every rank.

Under context parallelism each cp rank routes its own chunks of the sequences, and the term is a product of means
over all tokens: the graph's term (of this rank's tokens) is replaced by the model's own ``load_balancing_loss_func``
applied to every cp rank's router logits, gathered (``whole_sequence_balancing``). That gather's backward sums the
ranks' gradients, so when each rank's loss is weighted by its share of the label tokens (``runtime``'s
``scaled_loss``, whose weights add up to 1 over the cp ranks), the summed gradient is the single device's."""
from __future__ import annotations

from typing import Optional

import torch

from .errors import ArgumentError, ShardingError


def router_logits_asked(model, argument) -> bool:
    """Whether this call computes the router logits (and adds the load-balancing term to the loss), or why not."""
    asked = getattr(model.config, "output_router_logits", False) if argument is None else argument
    if not asked:
        return False
    where = "output_router_logits=True" if argument else "config.output_router_logits=True"
    if not model.takes_router_logits:
        raise ArgumentError(f"{where}: the forward of {model.config.model_type} has no output_router_logits argument "
                            f"(not a mixture-of-experts model transformers gives router logits for)")
    if model.cp_group is not None and model.load_balancing is None:
        raise ArgumentError(f"{where} is not supported with context parallelism for {model.config.model_type}: its "
                            f"modeling module has no load_balancing_loss_func (with num_experts and "
                            f"num_experts_per_tok) to compute the load-balancing loss over the whole sequences, of "
                            f"which each cp rank holds chunks")
    return True


def expert_counts_asked(model, argument) -> bool:
    """Whether this call counts the tokens routed to each expert (``output_tokens_per_expert``), or why not."""
    if not argument:
        return False
    if not model.moe_layers:
        raise ArgumentError(f"output_tokens_per_expert=True: {model.config.model_type} has no experts modules "
                            f"(transformers' stacked experts) to count tokens for")
    return True


def whole_sequence_counts(counts: Optional[torch.Tensor], cp_group) -> Optional[torch.Tensor]:
    """Under context parallelism each cp rank routes its own chunks of the sequences: their counts summed over the cp
    ranks (one all-reduce of [MoE layers, experts] integers, only when asked) are the whole sequences', as one device
    counts them."""
    if counts is None or cp_group is None:
        return counts
    import torch.distributed as dist

    counts = counts.clone()
    dist.all_reduce(counts, group=cp_group.process_group)
    return counts


def whole_sequence_balancing(model, results: dict, batch: int) -> dict:
    """``results`` (the graph's outputs) with the load-balancing term of the whole sequences, under context
    parallelism (see the module docstring): ``aux_loss`` replaced, and the loss holding it instead of this rank's
    term. On the first call the model's function is checked to give the graph's term on this rank's tokens (every cp
    rank learns whether all passed before any raises)."""
    import torch.distributed as dist

    from .ops.context_parallel_attention import gather_sequence

    function, experts, top_k = model.load_balancing
    local, aux = results["router_logits"], results.get("aux_loss")  # [layers, batch * local tokens, experts]
    if aux is None:  # a forward that returns router logits without a term: nothing to replace
        return results
    if not model._balancing_checked:
        own = function(tuple(local.detach().unbind(0)), experts, top_k, None)
        wrong = torch.tensor(0 if torch.allclose(own.to(aux.dtype), aux.detach(), rtol=1e-3, atol=1e-6) else 1,
                             device=aux.device)
        dist.all_reduce(wrong, op=dist.ReduceOp.MAX, group=model.cp_group.process_group)
        if wrong.item():
            raise ArgumentError(
                f"output_router_logits under context parallelism: {model.config.model_type}'s forward computes a "
                f"load-balancing loss other than its module's load_balancing_loss_func(router_logits, {experts}, "
                f"{top_k}) (on some cp rank's tokens they differ), so the term over the whole sequences cannot be "
                f"formed from the ranks' router logits; not supported")
        model._balancing_checked = True
    rows = local.reshape(local.shape[0] * batch, -1, local.shape[-1])  # [layers * batch, local tokens, experts]
    whole = gather_sequence(rows, model.cp_group.handle).reshape(local.shape[0], -1, local.shape[-1])
    term = function(tuple(whole.unbind(0)), experts, top_k, None)
    results = dict(results, aux_loss=term)
    if results.get("loss") is not None:
        results["loss"] = results["loss"] + model.router_aux_loss_coef * (term - aux).to(results["loss"].dtype)
    return results


def loss_without_aux(loss: Optional[torch.Tensor], aux_loss: Optional[torch.Tensor], coefficient: float):
    """The language-model part of a loss that holds ``coefficient * aux_loss`` (transformers adds it)."""
    if loss is None or aux_loss is None:
        return loss
    return loss - coefficient * aux_loss.to(loss.dtype)


def split_router_logits(stacked: Optional[torch.Tensor], placement) -> Optional[tuple]:
    """transformers' ``router_logits``: one [tokens, experts] tensor per MoE layer (the graph stacks them).
    ``placement``: the graph output's; the routers' inputs are whole on every rank, so a shard here would be a
    plan this code does not expect, refused rather than returned as if whole."""
    if stacked is None:
        return None
    if placement is not None and placement.is_shard:
        raise ShardingError(f"router_logits came out of the graph split ({placement}) where the whole logits are "
                            "expected; output_router_logits is not supported for this plan")
    return tuple(stacked.unbind(0))
