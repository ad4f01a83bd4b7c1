"""Build a Hugging Face causal LM whose parameters live on the meta device.

Parameters cost nothing there; buffers (rotary frequencies and the like) are
computed for real by the model's own ``__init__``, because checkpoints do not
hold them and the rewritten graph needs their values.
"""
from __future__ import annotations

import contextlib

import torch
from torch import nn

from .dropout_sites import dropout_rates
from .names import check_model_names
from .own_caches import states_in_cache


@contextlib.contextmanager
def parameters_on_meta():
    """Within this context every new nn.Parameter is created on the meta device."""
    original = nn.Module.register_parameter

    def register_parameter(module, name, param):
        if param is not None and param.device.type != "meta":
            param = nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)
        original(module, name, param)

    nn.Module.register_parameter = register_parameter
    try:
        yield
    finally:
        nn.Module.register_parameter = original


def build_meta_model(config, *, dtype: torch.dtype, trust_remote_code: bool = False, model_class=None):
    """Instantiate the causal LM of ``config`` entirely on the meta device.

    Buffer values are computed for real by ``__init__`` (on CPU) and kept in
    ``model.fxparallel_buffers`` (name -> tensor); the module itself holds meta
    copies, so that capture never mixes devices. ``model.fxparallel_dropout``: its
    dropout rates above 0 (where -> rate), which make capture use training mode.
    """
    from transformers import AutoModelForCausalLM

    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype if dtype.is_floating_point else previous)
    try:
        with parameters_on_meta():
            if model_class is not None:
                model = model_class._from_config(config, dtype=dtype)
            else:
                model = AutoModelForCausalLM.from_config(config, dtype=dtype, trust_remote_code=trust_remote_code)
    finally:
        torch.set_default_dtype(previous)
    check_model_names(model)
    for p in model.parameters():
        p.requires_grad_(True)
    values = {}
    for module_name, module in model.named_modules():
        for name, buf in list(module._buffers.items()):
            if buf is None:
                continue
            full = f"{module_name}.{name}" if module_name else name
            values[full] = buf
            module._buffers[name] = buf.to("meta")
    model.fxparallel_buffers = values
    states_in_cache(model)  # (own_caches.py: RecurrentGemma's module states)
    model.fxparallel_dropout = dropout_rates(model)  # capture/dropout_sites.py: captured in training mode if any
    return model.eval()
