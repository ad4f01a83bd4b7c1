"""Whole experts per rank, or every expert split inside like a dense MLP: the planner's choice where
``parallelize`` is left its default ``expert_parallel=None``, and the checks of a choice the user makes.

Both forms hold 1/tp of the experts' bytes on each rank and sum the routed experts in the MoE block's one
all-reduce: they move the same bytes in the same collectives (the backward at most the routing weights'
gradient more; ``tests/test_expert_parallel.py`` compares the two plans). What differs is the matrix products,
and that depends on transformers' experts kernel:

* ``grouped_mm`` (transformers' default off CPU) runs each expert on the rows routed to it. Split inside, every
  rank runs all E experts at 1/tp of their width; whole, E/tp experts at their full width on their rows: the
  same multiply-adds in products tp times wider. Whole experts.
* ``batched_mm`` (what ``parallelize`` picks on CPU, where grouped_mm's histogram has no kernel) gathers every
  routed (token, expert) pair's weights, so with whole experts each rank computes every routed row, the other
  ranks' with a stand-in expert: tp times the experts' multiply-adds. Split inside.
* any other kernel (transformers' ``eager`` loop over the experts): split inside.

Whole experts also need at least one expert per rank in every layer, and no context parallelism (not yet
composed); a saved plan decides by its own placements (an expert weight split on dim 0 is a whole-expert split).
Where the kernel favours whole experts, the training graph is planned both ways from one capture and whole
experts are kept only if they plan and cost no more collectives and bytes than the split plan (``settle``: a model
whose experts' rows meet an op the expert rules do not follow, or whose plan with whole experts needs more
collectives, keeps them split). The choice and its reason go into the plan report (``ShardingPlan.experts``)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from ..errors import ShardingError
from .layout import expert_parameters, text_config

WHOLE = "whole experts per rank"
SPLIT = "every expert split inside (like a dense MLP)"
WHOLE_ON_EVERY_RANK = "kept whole on every rank"
KEPT = f"the experts' weights {WHOLE_ON_EVERY_RANK}"


@dataclass(frozen=True)
class ExpertChoice:
    """``whole``: expert parallelism; ``why``: the reason the plan report gives, after the form the plan holds
    (``experts_line``; empty for a model without experts). ``pending``: whole experts chosen by the kernel, to be
    settled against the split plan's collectives (``settle``), ``why`` then the products' part of the reason."""

    whole: bool
    why: str = ""
    pending: bool = False


def experts_kernel(model) -> Optional[str]:
    """transformers' experts implementation the model runs (``config._experts_implementation``)."""
    config = text_config(model.config)
    return getattr(config, "_experts_implementation", None) or getattr(model.config, "_experts_implementation", None)


def check_expert_parallel(meta, tp: int) -> None:
    """``expert_parallel=True`` needs stacked experts and at least one per rank (before any capture). (Sequence
    parallelism keeps the MoE blocks' rows whole, and context parallelism gives each tp group its chunks' rows,
    routed as on one device: both compose.)"""
    kind = getattr(meta.config, "model_type", type(meta).__name__)
    counts = set(expert_parameters(meta).values())
    if not counts:
        raise ShardingError(f"expert_parallel=True, but the {kind} model has no mixture-of-experts layer with "
                            "stacked expert weights ([experts, ...] parameters, as transformers' experts modules "
                            "hold them)")
    if min(counts) < tp:
        raise ShardingError(f"expert_parallel=True: the {kind} model has {min(counts)} experts in a layer, fewer "
                            f"than the tp size {tp}: a rank would hold none")


def _expert_width(meta, experts: dict) -> int:
    """The experts' inner width: the narrowest size of their matrices other than the hidden size."""
    hidden = getattr(text_config(meta.config), "hidden_size", None)
    params = dict(meta.named_parameters())
    sizes = [int(s) for name in experts if name in params and params[name].dim() == 3
             for s in params[name].shape[1:] if s != hidden]
    return min(sizes) if sizes else int(hidden or 0)


def saved_whole_experts(meta, fixed: Optional[dict]) -> Optional[bool]:
    """Whether a saved plan's placements (``fixed``) split the experts whole (dim 0), None without a say."""
    placed = [fixed[name] for name in expert_parameters(meta) if fixed and name in fixed]
    if not placed:
        return None
    return any(p.is_shard and p.dim == 0 for p in placed)


def choose_experts(meta, tp: int, requested: Optional[bool],
                   saved_whole: Optional[bool] = None) -> ExpertChoice:
    """How the experts of ``meta`` (the meta model, its experts kernel chosen for the device) are split over
    ``tp`` ranks: ``requested`` True / False as the user asked (True checked here, before any capture), None
    for the planner's choice (``saved_whole``: what a saved plan's placements say, which then decide)."""
    experts = expert_parameters(meta)
    if not experts or tp == 1:
        if requested:
            check_expert_parallel(meta, tp)
        return ExpertChoice(bool(requested))
    if saved_whole is not None:
        if requested is not None and requested != saved_whole:
            raise ShardingError(f"expert_parallel={requested}, but the saved plan (plan=) places the experts "
                                f"{'whole' if saved_whole else 'split inside'}: leave expert_parallel out or pass "
                                f"expert_parallel={saved_whole}")
        return ExpertChoice(saved_whole, "as the saved plan places them")
    if requested is not None:
        if requested:
            check_expert_parallel(meta, tp)
        return ExpertChoice(requested, f"expert_parallel={requested}")
    count, kernel = min(experts.values()), experts_kernel(meta)
    if count < tp:
        return ExpertChoice(False, f"chosen: a layer has {count} experts, fewer than the {tp} ranks")
    if kernel == "batched_mm":
        return ExpertChoice(False, f"chosen: transformers' batched_mm experts kernel gathers every routed pair's "
                                   f"weights, so with whole experts every rank would compute every routed row: {tp}x "
                                   "the experts' multiply-adds; expert_parallel=True forces whole experts")
    if kernel != "grouped_mm":
        return ExpertChoice(False, f"chosen: whole experts need transformers' grouped_mm experts kernel, which "
                                   f"computes a rank's own rows only; this model runs {kernel}")
    width = _expert_width(meta, experts)
    return ExpertChoice(True, f"transformers' grouped_mm kernel runs each expert on its routed rows only, so "
                              f"{-(-count // tp)} whole experts {width} wide per rank instead of {count} experts "
                              f"{-(-width // tp)} wide do the same multiply-adds in {tp}x wider products",
                        pending=True)


def _cost(plan) -> tuple:
    """(collectives per step, bytes per token, fixed bytes per step) of a ShardingPlan, forward and backward."""
    return (sum(c.count for c in plan.collectives), plan.bytes_per_token(),
            sum(c.count * c.bytes_per_call for c in plan.collectives))


def _said(cost: tuple) -> str:
    return f"{cost[0]} collectives per step, {cost[1]:.0f} bytes per token" + (f" + {cost[2]:.0f} per step"
                                                                                 if cost[2] else "")


def settle(pending: ExpertChoice, whole, split, experts) -> ExpertChoice:
    """The planner's choice once the training graph is planned both ways: ``whole`` (its ShardingPlan with whole
    experts, or the error planning it raised) against ``split`` (the plan with every expert split inside);
    ``experts``: the names of the stacked expert weights. Whole experts are kept where that plan places them whole
    and costs no more collectives, bytes per token and bytes per step."""
    if isinstance(whole, Exception):
        error = str(whole) if isinstance(whole, ShardingError) else f"{type(whole).__name__}: {whole}"
        return ExpertChoice(False, f"chosen: whole experts per rank cannot be planned for this model: {error}")
    other = next((n for n in sorted(experts) if not _whole(whole.param(n).placement)), None)
    if other is not None:
        return ExpertChoice(False, f"chosen: the plan with whole experts holds {other} as "
                                   f"{whole.param(other).placement}")
    mine, theirs = _cost(whole), _cost(split)
    if any(a > b + 1e-9 * max(1.0, b) for a, b in zip(mine, theirs)):  # (sums of fractions: rounding aside)
        return ExpertChoice(False, f"chosen: whole experts per rank would cost {_said(mine)} against {_said(theirs)}; "
                                   "expert_parallel=True forces them")
    return ExpertChoice(True, f"chosen: {pending.why}, at {_said(mine)} against {_said(theirs)} with every expert "
                              "split inside; expert_parallel=False splits every expert instead")


def _whole(placement) -> bool:
    return placement.is_shard and placement.dim == 0


def experts_line(plan, why: str, experts) -> str:
    """The plan report's line on the experts (``ShardingPlan.experts``): the form ``plan`` holds them in, and
    ``why``; "" without experts or reason."""
    if not why or not experts:
        return ""
    placements = {n: plan.param(n).placement for n in sorted(experts)}
    kept = [n for n, p in placements.items() if not p.is_shard]
    if not kept:
        form = WHOLE if all(_whole(p) for p in placements.values()) else SPLIT
    else:
        form = KEPT if len(kept) == len(placements) else \
            f"the experts' weights partly split ({kept[0]} {WHOLE_ON_EVERY_RANK})"
    return f"{form} ({why})"
