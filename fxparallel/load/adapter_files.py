"""A PEFT LoRA adapter as a source of weights: ``adapter_config.json`` (JSON, read by PEFT's own config
class) and ``adapter_model.safetensors``, in a local directory or a hub repo. A pickled
``adapter_model.bin`` is refused (no code from data). Stored names are PEFT's:
``base_model.model.<module>.lora_A.weight`` holds the parameter ``<module>.lora_A.<adapter>.weight``."""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Optional

from ..capture.adapters import check_lora_config, without_adapter_name
from ..errors import CheckpointError
from .checkpoint_files import CheckpointFiles, from_file

CONFIG = "adapter_config.json"
WEIGHTS = "adapter_model.safetensors"
PICKLED = "adapter_model.bin"
PREFIX = "base_model.model."


@dataclass
class AdapterSource:
    config: object  # peft.LoraConfig
    name: str = "default"
    files: Optional[CheckpointFiles] = None  # None: from ``state``, or initialized as PEFT initializes (add_adapter)
    trainable: bool = False  # only the adapter's matrices take gradients; the base model is frozen
    where: str = ""  # the directory or hub id, for messages
    state: Optional[dict] = None  # {parameter name: full tensor} of the adapter's matrices (a PeftModel's)
    enabled: bool = True  # False after ``disable_adapters``: the graphs leave the adapter out, its matrices are kept


def stored_name(name: str, adapter: str) -> str:
    """The name PEFT stores the adapter parameter ``name`` under (its adapter name left out)."""
    return PREFIX + without_adapter_name(name, adapter)


def _file(name: str, filename: str, hub_kwargs: dict) -> Optional[str]:
    if os.path.isdir(name):
        path = os.path.join(name, filename)
        return path if os.path.isfile(path) else None
    from .hub import _download

    return _download(name, filename, hub_kwargs, None)


def is_adapter(name: str, hub_kwargs: dict) -> bool:
    """Whether ``name`` (a directory or hub id) holds a PEFT adapter (its adapter_config.json)."""
    try:
        return _file(name, CONFIG, hub_kwargs) is not None
    except CheckpointError:
        return False


def adapters_of_peft_model(model, is_trainable: bool) -> tuple:
    """(base PreTrainedModel, its active AdapterSource, the others) of a ``peft.PeftModel`` with LoRA adapters,
    one active. Their matrices come from the model; the active one takes gradients where it does in the model,
    or with ``is_trainable``."""
    from ..capture.adapters import hf_name, is_adapter_parameter

    where = f"the {type(model).__name__} passed"
    configs = dict(getattr(model, "peft_config", {}) or {})
    active = list(getattr(model, "active_adapters", None) or [])
    if not configs or len(active) != 1:
        raise CheckpointError(f"{where} holds adapters {sorted(configs)}, active {active}: one active LoRA adapter "
                              "is supported")
    base = model.get_base_model()
    adapters = {}
    for name, config in configs.items():
        check_lora_config(config, where)
        matrices = {hf_name(n): p for n, p in base.named_parameters() if is_adapter_parameter(n, name)}
        trainable = name == active[0] and (is_trainable or any(p.requires_grad for p in matrices.values()))
        state = {n: p.detach() for n, p in matrices.items()}
        adapters[name] = AdapterSource(config, name, None, trainable, where, state)
    return base, adapters.pop(active[0]), tuple(adapters.values())


def read_adapter(name: str, hub_kwargs: dict, adapter_name: str = "default", trainable: bool = False) -> AdapterSource:
    """The adapter in ``name``: its LoraConfig (checked: LoRA only, supported options) and weights file."""
    try:
        from peft import PeftConfig
    except ImportError as err:
        raise CheckpointError(f"{name!r} is a PEFT adapter, which needs the peft package: pip install "
                              "'fxparallel[peft]'") from err

    where = repr(name)
    try:
        config = PeftConfig.from_pretrained(_file(name, CONFIG, hub_kwargs).rsplit(os.sep, 1)[0])
    except Exception as err:  # noqa: BLE001 - a bad or unknown config, named
        raise CheckpointError(f"{where}: {CONFIG} cannot be read as a PEFT config: {type(err).__name__}: {err}") \
            from err
    check_lora_config(config, where)
    weights = _file(name, WEIGHTS, hub_kwargs)
    if weights is None:
        pickled = _file(name, PICKLED, hub_kwargs) is not None
        raise CheckpointError(f"{where} has no {WEIGHTS}" + (f"; its {PICKLED} is a pickle, which fxparallel does not "
                                                            "load (save the adapter with safe_serialization=True)"
                                                            if pickled else ""))
    return AdapterSource(config, adapter_name, from_file(weights), trainable, where)
