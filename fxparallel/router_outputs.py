"""transformers' ``output_router_logits`` on the parallel model: the mixture-of-experts load-balancing loss and
the routers' logits, as the Hugging Face model returns them; and ``output_tokens_per_expert``: the tokens routed to
each expert of every MoE layer, for any router (capture/expert_counts.py).

Asked for by the argument or, when it is None, by ``config.output_router_logits`` read at each call (as
transformers reads it), so a config changed after ``parallelize`` is followed: such calls run a graph captured
with the flag (capture/spec.py). The routers' inputs are replicated over the tensor-parallel ranks, so their
logits and the loss term are the single-device values on every rank."""
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
    if model.cp_group is not None:
        raise ArgumentError(f"{where} is not supported with context parallelism: the load-balancing loss is a "
                            f"product of means over all tokens of the batch, and each cp rank holds chunks of them")
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
