"""transformers' ``output_router_logits`` under capture.

A mixture-of-experts model returns its router logits through output recorders: forward hooks that
transformers installs on first use, under a thread lock Dynamo cannot enter. Installed here before the
capture (they do nothing unless a call collects), the same hooks are traced like any other code."""
from __future__ import annotations

import inspect

from transformers import PreTrainedModel
from transformers.utils.output_capturing import maybe_install_capturing_hooks


def takes_router_logits(model) -> bool:
    """Does the model's forward take transformers' ``output_router_logits`` (its MoE models do)?"""
    return "output_router_logits" in inspect.signature(type(model).forward).parameters


def install_output_recorders(model) -> None:
    for module in model.modules():
        if isinstance(module, PreTrainedModel):
            maybe_install_capturing_hooks(module)
