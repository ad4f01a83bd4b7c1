"""transformers' ``output_router_logits`` under capture.

A mixture-of-experts model returns its router logits through output recorders: forward hooks that
transformers installs on first use, under a thread lock Dynamo cannot enter. Installed here before the
capture (they do nothing unless a call collects), the same hooks are traced like any other code."""
from __future__ import annotations

import inspect
import sys

from transformers import PreTrainedModel
from transformers.utils.output_capturing import maybe_install_capturing_hooks


def takes_router_logits(model) -> bool:
    """Does the model's forward take transformers' ``output_router_logits`` (its MoE models do)?"""
    return "output_router_logits" in inspect.signature(type(model).forward).parameters


def load_balancing_of(model):
    """(``load_balancing_loss_func`` of the model's modeling module, its number of experts, experts per token), as
    its forward calls it (``load_balancing_loss_func(router_logits, self.num_experts, self.num_experts_per_tok,
    attention_mask)``), or None where the module has no such function or the model does not say those numbers.
    Whether the forward really computes that is checked on first use (router_outputs.py)."""
    function = getattr(sys.modules.get(type(model).__module__), "load_balancing_loss_func", None)
    text = getattr(model.config, "get_text_config", lambda: model.config)()
    experts = getattr(model, "num_experts", None) or getattr(text, "num_experts", None) or \
        getattr(text, "num_local_experts", None)
    top_k = getattr(model, "num_experts_per_tok", None) or getattr(text, "num_experts_per_tok", None)
    if not callable(function) or not isinstance(experts, int) or not isinstance(top_k, int):
        return None
    return function, experts, top_k


def install_output_recorders(model) -> None:
    for module in model.modules():
        if isinstance(module, PreTrainedModel):
            maybe_install_capturing_hooks(module)
