"""LoRA adapters in the captured model: PEFT's own LoRA layers are injected into the meta model
(``peft.inject_adapter_in_model``), so the graph holds exactly the products PEFT computes
(``base(x) + lora_B(lora_A(dropout(x))) * scaling``) and the solver places the adapter matrices like
any other (plan/rules/linear.py). Parameter names stay Hugging Face's: PEFT's ``<module>.base_layer.weight``
is the base model's ``<module>.weight``; the adapter's are ``<module>.lora_A.<adapter>.weight`` (as
transformers' PEFT integration names them in ``model.state_dict()``)."""
from __future__ import annotations

from typing import Optional

from ..errors import ArgumentError

BASE_LAYER = "base_layer"  # PEFT's module holding the layer it adapts
ADAPTER_MARKS = (".lora_A.", ".lora_B.")

# LoraConfig fields whose non-default values change what is computed in ways not supported here yet
_REFUSED = {
    "use_dora": "DoRA (use_dora=True)",
    "lora_bias": "a bias on lora_B (lora_bias=True)",
    "modules_to_save": "modules_to_save (fully trained copies of modules)",
    "trainable_token_indices": "trainable_token_indices",
    "layer_replication": "layer_replication",
    "alora_invocation_tokens": "activated LoRA (alora_invocation_tokens)",
    "use_qalora": "QALoRA (use_qalora=True)",
    "use_bdlora": "use_bdlora",
    "megatron_config": "megatron_config",
    "arrow_config": "arrow_config",
}


def hf_name(name: str) -> str:
    """The Hugging Face name of a parameter of the meta model with adapters injected; an adapter matrix keeps
    PEFT's name (a LoRA of a parameter wrapped inside another: ``experts.base_layer.lora_A.<adapter>.weight``)."""
    return name if is_adapter_parameter(name) else hf_path(name)


def hf_path(path: str) -> str:
    """The Hugging Face path of a module (or parameter) of the meta model with adapters injected: PEFT's
    ``base_layer`` levels left out."""
    return ".".join(part for part in path.split(".") if part != BASE_LAYER)


def adapted_weight(path: str, layer) -> tuple:
    """(name, output features' dim, input features' dim) of the weight the LoRA layer at ``path`` adapts: a
    linear layer's ``weight`` ([out, in]; GPT-2's Conv1D [in, out]), or the parameter a ``ParamWrapper`` adapts
    (``target_parameters``: [out, in], or stacked experts [experts, out, in] / [experts, in, out])."""
    name = hf_path(path)
    parameter = getattr(layer, "parameter_name", None)
    if parameter is not None:
        if layer._param_ndim == 2:
            return f"{name}.{parameter}", 0, 1
        return (f"{name}.{parameter}",) + ((1, 2) if layer._did_swap_in_out_features else (2, 1))
    return (f"{name}.weight",) + ((1, 0) if getattr(layer, "fan_in_fan_out", False) else (0, 1))


def named_parameters(model):
    """``model.named_parameters(remove_duplicate=False)`` under Hugging Face names (base layers unwrapped)."""
    for name, p in model.named_parameters(remove_duplicate=False):
        yield hf_name(name), p


def is_adapter_parameter(name: str, adapter: Optional[str] = None) -> bool:
    """Whether ``name`` is a LoRA matrix (of the adapter named ``adapter``, where given)."""
    if adapter is not None:
        return any(f"{mark}{adapter}." in name for mark in ADAPTER_MARKS)
    return any(mark in name for mark in ADAPTER_MARKS)


def without_adapter_name(name: str, adapter: str) -> str:
    """An adapter matrix's name as PEFT stores it, without its adapter's name (``...lora_A.<adapter>.weight`` ->
    ``...lora_A.weight``; an adapter may be named like a module, "mlp")."""
    for mark in ADAPTER_MARKS:
        name = name.replace(f"{mark}{adapter}.", mark)
    return name


def check_lora_config(config, where: str) -> None:
    """Refuse PEFT methods other than LoRA, and LoRA options this library does not support, by name."""
    from peft import LoraConfig

    if not isinstance(config, LoraConfig):
        kind = getattr(getattr(config, "peft_type", None), "value", type(config).__name__)
        raise ArgumentError(f"{where}: the adapter is {kind}; the parallel model supports LoRA adapters only")
    default = LoraConfig()
    for field, what in _REFUSED.items():
        value = getattr(config, field, None)
        if value and value != getattr(default, field, None):
            raise ArgumentError(f"{where}: {what} is not supported by the parallel model's LoRA yet")
    if config.bias != "none":
        raise ArgumentError(f"{where}: LoRA with bias={config.bias!r} trains the base model's biases; only "
                            "bias='none' is supported")


def inject(meta_model, adapters, active):
    """``meta_model`` (on the meta device) with the LoRA layers of ``adapters`` ((LoraConfig, name) pairs, in the
    order they were attached), ``active`` the name(s) of those the layers compute (PEFT's ``set_adapter``; the
    others' matrices are in the model but not in its graphs). Every parameter is captured as one that takes
    gradients (as build_meta_model leaves them), so the plan holds the reductions of any parameter a user trains;
    the module freezes the others at run time."""
    import copy

    from peft import inject_adapter_in_model
    from peft.functional import set_adapter

    from .adapter_parameters import make_capturable
    from .dropout_sites import dropout_rates

    model = meta_model
    for config, name in adapters:
        # created on the meta device (PEFT moves a second adapter to its base layer's device only off meta)
        model = inject_adapter_in_model(copy.deepcopy(config), model, adapter_name=name, low_cpu_mem_usage=True)
    set_adapter(model, active)
    make_capturable(model)  # LoRA on parameters (target_parameters)
    for p in model.parameters():
        p.requires_grad_(True)
    model.fxparallel_dropout = dropout_rates(model)  # lora_dropout too
    return model.eval()


def adapters_of(meta_model) -> dict:
    """{adapter name: its LoraConfig as JSON data, and whether its layers compute} of a meta model with adapters
    (empty without)."""
    import json

    configs = getattr(meta_model, "peft_config", None) or {}
    if not configs:
        return {}
    from peft.tuners.tuners_utils import BaseTunerLayer

    active = next(m for m in meta_model.modules() if isinstance(m, BaseTunerLayer)).active_adapters
    return {name: {"config": json.loads(json.dumps(config.to_dict(), sort_keys=True, default=str)),
                   "active": name in active}
            for name, config in sorted(configs.items())}
