"""LoRA on parameters (PEFT's ``target_parameters``: a MoE block's stacked expert weights, [experts, out, in]).
PEFT's ``ParamWrapper`` adds its low-rank change to the parameter through ``torch.nn.utils.parametrize``, whose
in-place ``param.set_`` Dynamo cannot capture in one graph. In the meta model each wrapper computes the same
sum instead, ``W + scaling * lhs @ rhs`` with PEFT's factors (``ParamWrapper.get_delta_factors``), and runs its
base module with the sum in the parameter's place (``torch.func.functional_call``): the graph then holds the
products, and the solver places them like any other. Wrappers of two parameters of one module are nested (the
inner one is the outer one's ``base_layer``); the outer one applies both."""
from __future__ import annotations

import functools

import torch


def parameter_delta(layer, weight_a: torch.Tensor, weight_b: torch.Tensor, scaling: float) -> torch.Tensor:
    """The change the LoRA of ``layer`` (a ParamWrapper) makes to its parameter, from its matrices ``weight_a``
    [r * experts, in] and ``weight_b`` [out, r * experts]: PEFT's ``get_delta_factors`` and product."""
    if layer._param_ndim == 2:
        return (weight_b @ weight_a) * scaling
    experts = layer.num_experts
    a = weight_a.reshape(experts, -1, weight_a.shape[-1])  # [experts, r, in]
    b = weight_b.reshape(weight_b.shape[0], -1, experts).permute(2, 0, 1)  # [experts, out, r]
    if layer._did_swap_in_out_features:  # stored [experts, out, in]
        return torch.bmm(b, a) * scaling
    return torch.bmm(a.transpose(-2, -1), b.transpose(-2, -1)) * scaling  # stored [experts, in, out]


def make_capturable(model) -> None:
    """Give each outermost ``ParamWrapper`` of ``model`` the forward described in the module docstring."""
    from peft.tuners.lora.layer import ParamWrapper

    inner = {id(m.base_layer) for m in model.modules() if isinstance(m, ParamWrapper)}
    for module in model.modules():
        if isinstance(module, ParamWrapper) and id(module) not in inner:
            module.__class__ = _captured_class()


@functools.lru_cache(maxsize=None)
def _captured_class():
    from peft.tuners.lora.layer import ParamWrapper

    class CapturedParamWrapper(ParamWrapper):
        def forward(self, x, *args, **kwargs):
            if kwargs.pop("adapter_names", None) is not None:
                raise ValueError("lora.ParamWrapper does not support mixed batch inference")
            values = {}
            layer = self
            while isinstance(layer, ParamWrapper):
                active = [a for a in layer.active_adapters if a in layer.lora_A]
                if active and not layer.disable_adapters and not layer.merged:
                    (name,) = active
                    delta = parameter_delta(layer, layer.lora_A[name].weight, layer.lora_B[name].weight,
                                            layer.scaling[name])
                    values[layer.parameter_name] = layer.get_param() + delta.to(layer.get_param().dtype)
                layer = layer.base_layer
            return torch.func.functional_call(layer, values, (x,) + args, kwargs)

    return CapturedParamWrapper
