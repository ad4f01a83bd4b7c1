"""The parallel models alive in this process, and their parameters by id.

torch's optimizer hooks are process-wide: an optimizer reaches our code knowing only its parameter tensors. This
registry answers which of them belong to a parallel model (the registered parameters and their DTensor views),
for the checks before a step (``optimizer_checks.py``) and DCP's view of the state after it (``dcp_optimizer.py``)."""
from __future__ import annotations

import weakref
from typing import NamedTuple, Optional

from torch.distributed.tensor import DTensor

_MODELS: "weakref.WeakSet" = weakref.WeakSet()


class Known(NamedTuple):
    """One tensor an optimizer may hold: a parallel model's parameter under its Hugging Face name, or its view."""
    name: str
    plan: object  # its ParamPlan (whole shape, placement)
    tp_group: object  # its model's TPGroup
    plain: bool  # a plain tensor (this rank's shard or a replicated copy), not a DTensor (a view, FSDP's)
    view: bool = False  # a DTensor view of a parameter (``dtensor_parameters.py``), not a registered parameter
    run: Optional[tuple] = None  # (first, count, of): this rank's run of the experts (``load/expert_runs.py``)

    @property
    def sharded(self) -> bool:
        """Split over tp ranks: each rank's tensor is a piece of the whole."""
        return self.plan.placement.is_shard and self.tp_group.size > 1


def register(model) -> None:
    _MODELS.add(model)


def known_parameters() -> dict:
    """{id(tensor): Known} of every parameter of the parallel models alive, and of its DTensor view."""
    from .dtensor_parameters import dtensor_views

    out = {}
    for model in list(_MODELS):
        views = dtensor_views(model) or {}
        for name, param in model.local_named_parameters():
            plan = model.plan.param(name)
            out[id(param)] = Known(name, plan, model.tp_group, not isinstance(param, DTensor),
                                   run=getattr(param, "_fxparallel_expert_run", None))
            if id(param) in views:
                out[id(views[id(param)])] = Known(name, plan, model.tp_group, False, view=True)
    return out
