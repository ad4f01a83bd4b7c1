"""Tokens routed to each expert, as graph outputs (``output_tokens_per_expert``).

transformers' experts modules (those ``use_experts_implementation`` marks) take the routing as their second
argument, ``top_k_index`` [tokens, top_k]: whatever the router (softmax top-k, DeepSeek-V3's grouped routing with
its correction bias), these are the experts that compute. A forward pre-hook on each counts them while a
capture that asks collects (``Collector.counts`` a list); otherwise it does nothing, so other graphs are
unchanged."""
from __future__ import annotations

import torch


class Collector:
    counts = None  # a list while a capture collects (set and read back by the captured function itself)


def experts_modules(model) -> list:
    """[(path, module, experts)] of ``model``'s experts modules (those ``use_experts_implementation`` marks) that
    hold weights stacked by expert, ``experts`` their first size, in the order of the model's modules."""
    found = []
    for path, module in model.named_modules():
        if hasattr(module, "_is_expert_parallel"):
            stacked = [int(p.shape[0]) for p in module.parameters(recurse=False) if p.dim() == 3]
            if stacked:
                found.append((path, module, stacked[0]))
    return found


def _count(module, args, kwargs):
    if Collector.counts is None:
        return
    index = args[1] if len(args) > 1 else kwargs.get("top_k_index", kwargs.get("router_indices"))
    flat = index.reshape(-1)
    experts = module._fxparallel_experts
    counts = torch.zeros(experts, dtype=torch.int64, device=flat.device).scatter_add_(0, flat, torch.ones_like(flat))
    Collector.counts.append(counts)


def install_counters(model) -> None:
    for _, module, experts in experts_modules(model):
        if not hasattr(module, "_fxparallel_experts"):
            module._fxparallel_experts = experts
            module.register_forward_pre_hook(_count, with_kwargs=True)
