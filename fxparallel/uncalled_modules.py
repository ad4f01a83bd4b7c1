"""Hooks on modules the parallel model's graphs never call, refused when they are registered.

The captured graphs compute the whole model in one call (or one call per decoder layer, ``ops/layer_units.py``).
The modules that hold the shards under the Hugging Face names (``model.layers.0.self_attn.q_proj``,
``model.embed_tokens``, ``lm_head``) and the views ``get_input_embeddings()`` / ``get_output_embeddings()`` return
are never called by them, so a forward or backward hook on one would never run, silently: NEFTune (Trainer's and
TRL's ``neftune_noise_alpha``, a forward hook on the input embeddings) would train without its noise, a probe
would record nothing. Hooks on the model itself and on its decoder layers run."""
from __future__ import annotations

from torch import nn

from .callers import functions_on_stack
from .errors import ArgumentError, ContextParallelError
from .trainer_context_parallel import PARALLELIZE_WITH_CP

NEFTUNE_HOOK = "neftune_post_forward_hook"  # transformers.integrations.neftune's


def _refuse(module, method: str, hook):
    if "_attach_context_parallel_hooks" in functions_on_stack("accelerate.big_modeling", limit=3):
        raise ContextParallelError(
            "accelerate's context parallelism (ParallelismConfig(cp_size=N)) hooks the attention modules of a model "
            "it prepares, which the parallel model's graphs never call. Trainer gives a model parallelized with "
            f"cp_group no such hooks: {PARALLELIZE_WITH_CP}. accelerate's own loop with context parallelism is "
            "not supported")
    what = getattr(module, "hook_target", "a submodule of the parallel model")
    message = (f"{what}.{method}(...): the parallel model's captured graphs compute the model in one call and never "
               f"call this module (it holds this rank's shards under the Hugging Face name), so the hook would "
               "never run. Hooks on the model itself and on its decoder layers (the modules the graphs call per "
               "layer) run.")
    if getattr(hook, "__name__", "") == NEFTUNE_HOOK:
        message += (" NEFTune (neftune_noise_alpha in TrainingArguments / SFTConfig) adds its noise through this "
                    "hook: it is not supported on the parallel model; leave neftune_noise_alpha unset")
    raise ArgumentError(message)


class RefusesHooks:
    """Module hooks refused by name (``hook_target`` says which module)."""

    def register_forward_hook(self, hook, *args, **kwargs):
        _refuse(self, "register_forward_hook", hook)

    def register_forward_pre_hook(self, hook, *args, **kwargs):
        _refuse(self, "register_forward_pre_hook", hook)

    def register_full_backward_hook(self, hook, *args, **kwargs):
        _refuse(self, "register_full_backward_hook", hook)

    def register_full_backward_pre_hook(self, hook, *args, **kwargs):
        _refuse(self, "register_full_backward_pre_hook", hook)

    def register_backward_hook(self, hook, *args, **kwargs):
        _refuse(self, "register_backward_hook", hook)


class UncalledModule(RefusesHooks, nn.Module):
    """A module on the path of the parallel model's parameters (``model``, ``model.layers.0.mlp.up_proj``, ...)."""

    def __init__(self, path: str):
        super().__init__()
        self.hook_target = f"the parallel model's module {path!r}"


class UncalledLayers(UncalledModule):
    """The container of the decoder layers (``model.layers``), indexed, counted and iterated as transformers'
    ``nn.ModuleList`` is: ``model.model.layers[i]``, ``len(...)``, ``for layer in ...``."""

    def __getitem__(self, index: int) -> nn.Module:
        return list(self._modules.values())[index]

    def __len__(self) -> int:
        return len(self._modules)

    def __iter__(self):
        return iter(self._modules.values())


def parent_of(root: nn.Module, dotted: str, layers: bool = False) -> tuple:
    """The module holding the last name of ``dotted`` under ``root``, and that name; the modules above it made
    where missing (``layers``: the innermost of them holds the decoder layers)."""
    *parents, leaf = dotted.split(".")
    module = root
    for i, part in enumerate(parents):
        if part not in module._modules:
            path = ".".join(parents[:i + 1])
            module.add_module(part, UncalledLayers(path) if layers and i == len(parents) - 1 else UncalledModule(path))
        module = module._modules[part]
    return module, leaf
