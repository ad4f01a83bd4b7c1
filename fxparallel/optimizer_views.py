"""An optimizer built before the DTensor mode began still trains the model.

accelerate's habit is to build the optimizer first and prepare both together
(``opt = AdamW(model.parameters()); model, opt = accelerator.prepare(model, opt)``). The parallel model's
``parameters()`` are then its plain local tensors: the DTensor views (``dtensor_parameters.py``) appear only when
accelerate reads ``model.tp_size``, after its own step that re-points an optimizer at a model's DTensors has
already looked and found none. From then on every gradient goes to the views, so such an optimizer would find no
gradient on its parameters and skip them: training that changes nothing, silently.

A process-wide optimizer step pre-hook (torch's ``register_optimizer_step_pre_hook``, installed when the first
model enters the mode) re-points the optimizer before it steps: each plain parameter of a model in the mode is
replaced in its param group by that parameter's view, on the same storage, so the update lands in the model's
shards; optimizer state already kept for the plain parameter moves to the view (as DTensors over the same
placements). What accelerate itself does for transformers' tensor-parallel models, by address, when their
parameters are DTensors before it looks."""
from __future__ import annotations

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook

_HOOK = []


def follow_view(param, view) -> None:
    """From now on, an optimizer stepping the plain parameter ``param`` steps ``view`` instead (the view is kept
    on the parameter: a view keeps its object for good, ``refresh_views`` swaps its contents)."""
    param._fxparallel_view = view
    if not _HOOK:
        _HOOK.append(register_optimizer_step_pre_hook(_repoint))


def _repoint(optimizer, args, kwargs) -> None:
    for group in optimizer.param_groups:
        params = group["params"]
        for i, param in enumerate(params):
            view = getattr(param, "_fxparallel_view", None)
            if view is None:
                continue
            params[i] = view
            state = optimizer.state.pop(param, None)
            if state is not None:
                optimizer.state[view] = {k: _like(view, v, param) for k, v in state.items()}


def _like(view, value, param):
    """A state tensor shaped like the plain parameter (Adam's moments) as a DTensor like the view; others as kept."""
    from .dtensor_parameters import like_view

    if torch.is_tensor(value) and value.dim() > 0 and value.shape == param.shape:
        return like_view(view, value)
    return value
