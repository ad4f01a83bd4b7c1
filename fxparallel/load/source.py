"""Resolve what the user passed to ``parallelize`` into a config and a weight source.

Accepted: a hub model id, a local checkpoint directory, a PretrainedConfig, or a
PreTrainedModel (on the meta device or with real weights).
"""
from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from typing import Optional

import torch

from ..capture.adapters import hf_name
from ..errors import CheckpointError, ConfigError, FxParallelError
from .quantization import check_checkpoint_not_quantized, check_model_not_quantized

try:  # transformers' configs are strict dataclasses: a bad field or value raises one of these
    from huggingface_hub.errors import StrictDataclassError
except ImportError:  # pragma: no cover - older huggingface_hub
    StrictDataclassError = ()


@dataclass
class ModelSource:
    config: object
    checkpoint: Optional[str] = None  # hub id or directory holding safetensors
    state_dict: Optional[dict] = None  # weights of a given in-memory model
    model_class: Optional[type] = None
    hub_kwargs: dict = field(default_factory=dict)
    adapter: Optional[object] = None  # the active LoRA adapter on the model (load/adapter_files.AdapterSource)
    inactive_adapters: tuple = ()  # the other adapters attached (AdapterSource), in the order they were attached
    co_active: tuple = ()  # names of inactive_adapters that compute beside the active one (set_adapter([...]))


def causal_lm_class(config, where: str, trust_remote_code: bool) -> Optional[type]:
    """None where AutoModelForCausalLM builds ``config``; else the causal-LM class that wrote it.

    A text config saved by e.g. ``Emu3ForCausalLM.save_pretrained`` (model_type ``emu3_text_model``) is not
    a key of transformers' Auto mapping, though the class its ``architectures`` names takes it: that class
    loads it, as ``Emu3ForCausalLM.from_pretrained`` would."""
    import transformers
    from transformers import AutoModelForCausalLM
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    if type(config) in AutoModelForCausalLM._model_mapping:
        return None
    auto_map = getattr(config, "auto_map", None) or {}
    if trust_remote_code and "AutoModelForCausalLM" in auto_map:
        return None
    causal = set(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values())
    for name in getattr(config, "architectures", None) or ():
        cls = getattr(transformers, name, None) if name in causal else None
        if cls is not None and isinstance(config, cls.config_class):
            return cls
    model_type = getattr(config, "model_type", type(config).__name__)
    raise FxParallelError(
        f"{where} is not a causal language model: model_type {model_type!r} ({type(config).__name__}) has no "
        "AutoModelForCausalLM class in transformers"
        + (" (it ships remote code: pass trust_remote_code=True to allow it)" if "AutoModelForCausalLM" in auto_map else "")
    )


def _config_error(name: str, hub_kwargs: dict, err: Exception) -> str:
    from .hub import is_offline

    if os.path.isdir(name):
        return f"cannot load the config of {name!r}: {err}"
    if name.startswith((".", "/", "~")) or os.sep + os.sep in name or name.count("/") > 1:
        return f"{name!r} is not a directory, nor a hub id (org/name): {err}"
    if is_offline(hub_kwargs):
        from huggingface_hub import constants

        cache = hub_kwargs.get("cache_dir") or constants.HF_HUB_CACHE
        return (f"hub id {name!r} cannot be resolved offline (HF_HUB_OFFLINE=1 or local_files_only=True): its "
                f"config.json is not in the hub cache {cache}"
                + (f" for revision {hub_kwargs['revision']!r}" if hub_kwargs.get("revision") else "")
                + f". Download it once online (e.g. `hf download {name}`) or pass a local directory")
    return f"cannot load the config of hub id {name!r}: {err}"


def _fields_named(message: str, keys) -> list:
    """The config fields a validator's message speaks of, by name or in words ("number of attention heads")."""
    found = []
    for key in keys:
        if not isinstance(key, str) or len(key) < 4:
            continue
        forms = {key, key.replace("_", " "), key.replace("num_", "number of ", 1).replace("_", " ")}
        if any(re.search(rf"(?<![A-Za-z_]){re.escape(f)}(?![A-Za-z_])", message) for f in forms):
            found.append(key)
    return sorted(found)


def invalid_config_error(err: Exception, where: str, model_type=None, config_class=None, keys=()) -> ConfigError:
    """fxparallel's one-line error for transformers' strict-dataclass validation error ``err``."""
    text = str(err)
    cause = err.__cause__
    detail = f"{type(cause).__name__}: {cause}" if cause is not None else text.split("\n", 1)[-1].strip()
    detail = " ".join(detail.split())
    field = re.search(r"for field '([^']+)'", text)
    validator = re.search(r"for validator '([^']+)'", text)
    if field:
        fields = [field.group(1)]
    else:
        fields = _fields_named(str(cause) if cause is not None else text, keys)
    what = (f"model_type {model_type!r}" if model_type else "the config") + (f" ({config_class})" if config_class else "")
    named = ("config field " + ", ".join(fields) if len(fields) == 1 else
             "config fields " + ", ".join(fields) if fields else "the config")
    check = f" (transformers' check {validator.group(1)})" if validator else ""
    return ConfigError(f"invalid config of {where}, {what}: {named}: {detail}{check}")


def _invalid_loaded_config(name: str, hub_kwargs: dict, err: Exception) -> ConfigError:
    """The error for a config file that transformers refuses to build: name its field and model type."""
    model_type, config_class, keys = None, None, ()
    try:
        from transformers import PretrainedConfig
        from transformers.models.auto.configuration_auto import CONFIG_MAPPING

        raw, _ = PretrainedConfig.get_config_dict(name, **hub_kwargs)
        model_type = raw.get("model_type")
        keys = list(raw)
        if model_type in CONFIG_MAPPING:
            config_class = CONFIG_MAPPING[model_type].__name__
    except Exception:  # noqa: BLE001 - only used to word the error
        pass
    where = name if not os.path.isdir(name) else os.path.join(name, "config.json")
    return invalid_config_error(err, repr(where), model_type, config_class, keys)


def resolve_source(model, *, revision=None, cache_dir=None, local_files_only=None, token=None,
                   trust_remote_code=False, is_trainable: bool = False) -> ModelSource:
    from transformers import AutoConfig, PretrainedConfig, PreTrainedModel

    hub_kwargs = {k: v for k, v in dict(revision=revision, cache_dir=cache_dir, token=token).items() if v is not None}
    if local_files_only is not None:
        hub_kwargs["local_files_only"] = local_files_only
    if type(model).__module__.startswith("peft."):  # a PeftModel: its base model and its LoRA adapters
        from .adapter_files import adapters_of_peft_model

        base, adapter, inactive = adapters_of_peft_model(model, is_trainable)
        source = resolve_source(base, trust_remote_code=trust_remote_code)
        source.adapter, source.inactive_adapters = adapter, inactive
        return source
    if isinstance(model, PreTrainedModel):
        causal_lm_class(model.config, type(model).__name__, trust_remote_code)
        check_model_not_quantized(model)
        has_weights = any(p.device.type != "meta" for p in model.parameters())
        # (a PeftModel's base holds its adapter's layers: the base weights under transformers' names)
        state = {hf_name(k): v.detach() for k, v in model.state_dict().items()} if has_weights else None
        return ModelSource(model.config, state_dict=state, model_class=type(model))
    if isinstance(model, PretrainedConfig):
        check_checkpoint_not_quantized(model, f"the {type(model).__name__} passed")
        return ModelSource(model, model_class=causal_lm_class(model, type(model).__name__, trust_remote_code))
    if isinstance(model, (str, os.PathLike)):
        name = os.fspath(model)
        try:
            config = AutoConfig.from_pretrained(name, trust_remote_code=trust_remote_code, **hub_kwargs)
        except StrictDataclassError as err:
            raise _invalid_loaded_config(name, hub_kwargs, err) from err
        except (OSError, ValueError) as err:
            adapter = _adapter_source(name, hub_kwargs, is_trainable)
            if adapter is None:
                raise CheckpointError(_config_error(name, hub_kwargs, err)) from err
            # a PEFT adapter: the base model it names, with the adapter on it
            base = resolve_source(adapter.config.base_model_name_or_path, revision=None, cache_dir=cache_dir,
                                  local_files_only=local_files_only, token=token,
                                  trust_remote_code=trust_remote_code)
            base.adapter = adapter
            return base
        check_checkpoint_not_quantized(config, repr(name))
        model_class = causal_lm_class(config, repr(name), trust_remote_code)
        return ModelSource(config, checkpoint=name, model_class=model_class, hub_kwargs=hub_kwargs)
    raise FxParallelError(
        f"model must be a hub id, a directory, a PretrainedConfig or a PreTrainedModel; got {type(model).__name__}"
    )


def _adapter_source(name: str, hub_kwargs: dict, is_trainable: bool):
    """The PEFT adapter in ``name`` (load/adapter_files.py), or None where it holds none."""
    from .adapter_files import is_adapter, read_adapter

    if not is_adapter(name, hub_kwargs):
        return None
    adapter = read_adapter(name, hub_kwargs, trainable=is_trainable)
    if not adapter.config.base_model_name_or_path:
        raise CheckpointError(f"{adapter.where}: its adapter_config.json names no base_model_name_or_path; pass the "
                              "base model to fxparallel.parallelize and load the adapter with model.load_adapter")
    return adapter


def default_dtype(config) -> torch.dtype:
    dtype = getattr(config, "dtype", None)  # transformers >= 5: torch_dtype is a deprecated alias of it
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype[len("torch."):] if dtype.startswith("torch.") else dtype, None)
    return dtype if isinstance(dtype, torch.dtype) else torch.float32
