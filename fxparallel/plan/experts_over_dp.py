"""Experts spread over data-parallel ranks (``parallelize(..., ep_group=...)``): which weights, and the checks
made before any capture. The exchange of rows is ``ops/expert_exchange.py``; the rewrite that inserts it
``rewrite/expert_exchange.py``; each rank keeps its run of experts (``load/expert_runs.py``)."""
from __future__ import annotations

from ..errors import ShardingError
from .expert_choice import experts_kernel
from .layout import expert_parameters


def stacked_expert_weights(meta) -> frozenset:
    """HF names of the stacked expert weights ([experts, out, in]; not their biases, which every rank keeps)."""
    params = dict(meta.named_parameters())
    return frozenset(name for name in expert_parameters(meta)
                     if name in params and params[name].dim() >= 3)


def check_experts_over_dp(meta, ep: int, adapters=()) -> None:
    """Refuse, before any capture, what the exchange cannot do: a model without stacked experts, fewer experts
    than ep ranks, a kernel other than grouped_mm, a LoRA adapter on the expert weights (``adapters``:
    ``load/adapter_files.AdapterSource``)."""
    kind = getattr(meta.config, "model_type", type(meta).__name__)
    stacked = stacked_expert_weights(meta)
    for adapter in adapters:  # (PEFT matches target_parameters as a name or a name's dotted suffix)
        targets = getattr(adapter.config, "target_parameters", None) or ()
        hit = sorted(n for n in stacked if any(n == t or n.endswith("." + t) for t in targets))
        if hit:
            raise ShardingError(f"ep_group: LoRA adapter {adapter.name!r} targets expert weights ({hit[0]}"
                                f"{f' and {len(hit) - 1} more' if len(hit) > 1 else ''}), which experts over "
                                "data-parallel ranks do not adapt yet: leave the experts out of target_parameters, "
                                "or parallelize without ep_group")
    counts = {count for name, count in expert_parameters(meta).items() if name in stacked}
    if not counts:
        raise ShardingError(f"ep_group: {kind} has no stacked expert weights (a mixture-of-experts layer of "
                            "transformers' experts modules) to spread over data-parallel ranks")
    if min(counts) < ep:
        raise ShardingError(f"ep_group of size {ep}: {kind} has {min(counts)} experts in a layer, fewer than the "
                            "expert-parallel ranks; use an ep size of at most the experts per layer")
    kernel = experts_kernel(meta)
    if kernel not in (None, "grouped_mm"):
        raise ShardingError(f"ep_group: the experts kernel is {kernel!r}; experts over data-parallel ranks exchange "
                            "rows sorted by expert, which transformers' grouped_mm kernel computes (set "
                            "experts_implementation='grouped_mm')")
