"""A saved ShardingPlan (``fxparallel plan --json``, ``model.plan.save``) driving ``parallelize``.

The plan is checked against the model and the group before anything is captured; the first
mismatch is named. Its placements are then fixed for every parameter, so the solver has no
decision left: it walks the graph once, placing activations around them (no search)."""
from __future__ import annotations

import os
from typing import Union

from ..capture import adapters
from ..errors import ShardingError
from .plan import ShardingPlan


def read_plan(plan: Union[ShardingPlan, str, os.PathLike]) -> ShardingPlan:
    """``plan=`` of ``parallelize``: a ShardingPlan, or the path of its JSON."""
    if isinstance(plan, ShardingPlan):
        return plan
    if not isinstance(plan, (str, os.PathLike)):
        raise ShardingError(f"plan= must be a ShardingPlan or the path of one saved as JSON, got {type(plan).__name__}")
    try:
        return ShardingPlan.load(plan)
    except FileNotFoundError:
        raise ShardingError(f"plan={os.fspath(plan)!r}: no such file (write one with `fxparallel plan MODEL --tp N "
                            "--json PATH` or model.plan.save(PATH))") from None
    except (ValueError, KeyError, TypeError) as err:
        raise ShardingError(f"plan={os.fspath(plan)!r} is not a saved ShardingPlan ({type(err).__name__}: {err})") \
            from None


def fixed_placements(plan: ShardingPlan, meta, tp: int) -> dict:
    """{parameter name: Placement} of every parameter the plan's forward uses, after checking the plan
    fits ``meta`` (the meta model) split over ``tp`` ranks."""
    kind = getattr(meta.config, "model_type", type(meta).__name__)
    if plan.model_type != kind:
        raise ShardingError(f"the saved plan is for model type {plan.model_type!r}, this model is {kind!r}")
    if plan.tp != tp:
        raise ShardingError(f"the saved plan splits over tp={plan.tp} ranks, this tp_group has {tp}")
    shapes = {name: tuple(p.shape) for name, p in adapters.named_parameters(meta)}
    planned = set()
    fixed = {}
    for p in plan.params:
        for name in (p.name, *p.aliases):
            if name not in shapes:
                raise ShardingError(f"the saved plan names parameter {name!r}, which this {kind} model does not have")
            if shapes[name] != tuple(p.shape):
                raise ShardingError(f"parameter {name!r}: the saved plan has shape {tuple(p.shape)}, this model "
                                    f"{shapes[name]}")
            planned.add(name)
        placement = p.placement  # a Placement: ParamPlan parses it (a bad one fails in read_plan)
        if placement.is_shard and not 0 <= placement.dim < len(p.shape):
            raise ShardingError(f"parameter {p.name!r}: the saved plan shards dim {placement.dim} of a "
                                f"{len(p.shape)}-D tensor {tuple(p.shape)}")
        if placement.is_shard and placement.segments and sum(placement.segments) != p.shape[placement.dim]:
            raise ShardingError(f"parameter {p.name!r}: the saved plan's segments {placement.segments} do not add up "
                                f"to dim {placement.dim} of size {p.shape[placement.dim]}")
        if placement.is_partial:
            raise ShardingError(f"parameter {p.name!r}: a parameter cannot be a partial sum (P) in a saved plan")
        if placement.block is not None or placement.is_expert_rows:
            raise ShardingError(f"parameter {p.name!r}: a parameter cannot be placed {placement} in a saved plan "
                                "(blocked shards and expert rows are layouts of activations)")
        if p.used:
            fixed[p.name] = placement
    missing = [name for name in shapes if name not in planned]
    if missing:
        raise ShardingError(f"parameter {missing[0]!r} of this {kind} model is not in the saved plan"
                            + (f" (nor {len(missing) - 1} more)" if len(missing) > 1 else ""))
    return fixed


def check_applied(saved: ShardingPlan, applied: ShardingPlan) -> None:
    """Every parameter got the placement the saved plan gives it."""
    for want in saved.params:
        got = applied.param(want.name)
        if got.placement != want.placement:
            raise ShardingError(f"parameter {want.name!r}: the saved plan places it {want.placement!r}, but the "
                                f"graph needs {got.placement!r}")
