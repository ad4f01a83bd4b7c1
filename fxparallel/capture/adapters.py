"""LoRA adapters in the captured model: PEFT's own LoRA layers are injected into the meta model
(``peft.inject_adapter_in_model``), so the graph holds exactly the products PEFT computes
(``base(x) + lora_B(lora_A(dropout(x))) * scaling``) and the solver places the adapter matrices like
any other (plan/rules/linear.py). Parameter names stay Hugging Face's: PEFT's ``<module>.base_layer.weight``
is the base model's ``<module>.weight``; the adapter's are ``<module>.lora_A.<adapter>.weight`` (as
transformers' PEFT integration names them in ``model.state_dict()``)."""
from __future__ import annotations

from ..errors import ArgumentError

BASE_LAYER = ".base_layer."
ADAPTER_MARKS = (".lora_A.", ".lora_B.")

# LoraConfig fields whose non-default values change what is computed in ways not supported here yet
_REFUSED = {
    "use_dora": "DoRA (use_dora=True)",
    "lora_bias": "a bias on lora_B (lora_bias=True)",
    "modules_to_save": "modules_to_save (fully trained copies of modules)",
    "trainable_token_indices": "trainable_token_indices",
    "target_parameters": "target_parameters (LoRA on expert weights given as parameters)",
    "layer_replication": "layer_replication",
    "alora_invocation_tokens": "activated LoRA (alora_invocation_tokens)",
    "use_qalora": "QALoRA (use_qalora=True)",
    "use_bdlora": "use_bdlora",
    "megatron_config": "megatron_config",
    "arrow_config": "arrow_config",
}


def hf_name(name: str) -> str:
    """The Hugging Face name of a parameter of the meta model with adapters injected."""
    return name.replace(BASE_LAYER, ".")


def hf_path(path: str) -> str:
    """The Hugging Face module path of a module of the meta model with adapters injected."""
    return hf_name(path + ".")[:-1] if path.endswith(".base_layer") else hf_name(path)


def named_parameters(model):
    """``model.named_parameters(remove_duplicate=False)`` under Hugging Face names (base layers unwrapped)."""
    for name, p in model.named_parameters(remove_duplicate=False):
        yield hf_name(name), p


def is_adapter_parameter(name: str) -> bool:
    return any(mark in name for mark in ADAPTER_MARKS)


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


def inject(meta_model, config, adapter_name: str):
    """``meta_model`` (on the meta device) with ``config``'s LoRA layers, named ``adapter_name``. Every
    parameter is captured as one that takes gradients (as build_meta_model leaves them), so the plan holds
    the reductions of any parameter a user trains; the module freezes the base model's at run time."""
    import copy

    from peft import inject_adapter_in_model

    from .dropout_sites import dropout_rates

    model = inject_adapter_in_model(copy.deepcopy(config), meta_model, adapter_name=adapter_name)
    for p in model.parameters():
        p.requires_grad_(True)
    model.fxparallel_dropout = dropout_rates(model)  # lora_dropout too
    return model.eval()


def adapters_of(meta_model) -> dict:
    """{adapter name: its LoraConfig as JSON data} of a meta model with adapters (empty without)."""
    import json

    configs = getattr(meta_model, "peft_config", None) or {}
    return {name: json.loads(json.dumps(config.to_dict(), sort_keys=True, default=str))
            for name, config in sorted(configs.items())}
