"""transformers' PEFT-integration names on the parallel model: ``load_adapter`` (a saved PEFT LoRA adapter),
``add_adapter`` (a new one from a ``LoraConfig``), ``active_adapters``. A parallel model without an adapter
gets one by re-planning its graphs with PEFT's LoRA layers in them (``capture/adapters.py``), every base
parameter's placement kept, and new shards for the adapter's matrices, read from the adapter's file or
initialized as PEFT initializes them (A Kaiming-uniform, B zero), alike on every rank. The base model is then
frozen, as PEFT freezes it."""
from __future__ import annotations

import copy
import dataclasses
import math

import torch

from .capture.adapters import check_lora_config, is_adapter_parameter
from .errors import ArgumentError
from .load.adapter_files import AdapterSource, read_adapter
from .load.adapter_weights import load_adapter_weights, set_trainable


class AdapterMethods:
    """Mixed into ``ParallelCausalLM``; see the module docstring."""

    def load_adapter(self, peft_model_id=None, adapter_name=None, revision=None, token=None, is_trainable=False,
                     **unsupported):
        """Attach the LoRA adapter saved in ``peft_model_id`` (a directory or hub id; collective over the tp
        group), for inference, or trainable with ``is_trainable=True``."""
        if unsupported or peft_model_id is None:
            raise ArgumentError(f"load_adapter takes peft_model_id, adapter_name, revision, token and is_trainable; "
                                f"got {sorted(unsupported) if unsupported else 'no peft_model_id'}")
        hub_kwargs = {k: v for k, v in dict(revision=revision, token=token).items() if v is not None}
        self._attach(read_adapter(str(peft_model_id), hub_kwargs, adapter_name or "default", is_trainable))

    def add_adapter(self, adapter_config, adapter_name=None):
        """Attach a new LoRA adapter of ``adapter_config`` (a ``peft.LoraConfig``), trainable, initialized as PEFT
        initializes it (``init_lora_weights=True``; collective over the tp group)."""
        check_lora_config(adapter_config, "add_adapter")
        if adapter_config.init_lora_weights is not True:
            raise ArgumentError(f"add_adapter: init_lora_weights={adapter_config.init_lora_weights!r} is not supported "
                                "on the parallel model (PEFT's default, True, is); initialize the adapter with PEFT, "
                                "save it and load it with load_adapter")
        self._attach(AdapterSource(copy.deepcopy(adapter_config), adapter_name or "default", None, True, "add_adapter"))

    def active_adapters(self) -> list:
        return list(self.peft_config)

    def merge_and_unload(self, progressbar: bool = False, safe_merge: bool = False, adapter_names=None):
        """PEFT's ``merge_and_unload``: fold the adapter into the base model's shards (each rank its pieces of
        ``scaling * B @ A``) and re-plan the graphs without it; returns the model (collective over the tp group)."""
        if not self.peft_config:
            raise ArgumentError("merge_and_unload: the model holds no adapter")
        if safe_merge or adapter_names is not None:
            raise ArgumentError("merge_and_unload: safe_merge and adapter_names are not supported on the parallel model")
        del progressbar
        factory = self._graph_set.factory
        plain = factory.with_adapter(None)  # planned without the adapter first: a failure changes nothing
        planned = plain.training_graph()
        _merge(self, factory.meta, next(iter(self.peft_config)))
        for p in [p for p in self.plan.params if is_adapter_parameter(p.name)]:
            parent = self.get_submodule(p.name.split(".lora_")[0])
            parent._modules.pop("lora_A", None)
            parent._modules.pop("lora_B", None)
        self._replace_graphs(plain, planned)
        self.peft_config = {}
        return self

    def _attach(self, adapter: AdapterSource) -> None:
        from .dtensor_parameters import dtensor_views
        from .runtime.export import is_data_parallel

        where = "load_adapter" if adapter.files is not None else "add_adapter"
        if self.peft_config:
            raise ArgumentError(f"{where}: the model holds adapter {next(iter(self.peft_config))!r} already; one "
                                "adapter is supported")
        if is_data_parallel(self) or dtensor_views(self):
            raise ArgumentError(f"{where}: attach the adapter before apply_data_parallel or Trainer (their parameter "
                                "views would not hold the adapter's)")
        factory = self._graph_set.factory.with_adapter(adapter)  # the meta model first: a failure changes nothing
        planned = factory.training_graph()
        for p in planned.plan.params:
            if is_adapter_parameter(p.name):
                self._add_shard(p)
        self._replace_graphs(factory, planned)
        self.peft_config = {adapter.name: adapter.config}
        group = self.tp_group
        if adapter.files is not None:
            load_adapter_weights(self, self.plan, adapter, group.rank, group.size)
        else:
            _initialize(self, adapter, group.rank, group.size)


def _merge(model, meta, adapter: str) -> None:
    """Add each LoRA layer's ``scaling * B @ A`` (transposed for fan_in_fan_out weights, GPT-2's Conv1D) to this
    rank's shard of its base weight; the scaling and layout are those of PEFT's layer in the meta model."""
    from .capture.adapters import hf_path
    from .runtime.dtensor import full_tensor

    group = model.tp_group
    for path, layer in meta.named_modules():
        if not hasattr(layer, "lora_A") or adapter not in getattr(layer, "lora_A", {}):
            continue
        name = hf_path(path)
        a_name, b_name = f"{name}.lora_A.{adapter}.weight", f"{name}.lora_B.{adapter}.weight"
        a = full_tensor(model.get_parameter(a_name), model.plan.param(a_name), group)
        b = full_tensor(model.get_parameter(b_name), model.plan.param(b_name), group)
        delta = (b.float() @ a.float()) * layer.scaling[adapter]
        if getattr(layer, "fan_in_fan_out", False):
            delta = delta.T
        base = model.plan.param(f"{name}.weight")
        with torch.no_grad():
            shard = model.get_parameter(base.name)
            shard.add_(base.shard_of(delta, group.rank, group.size).to(shard.dtype))


def _initialize(model, adapter: AdapterSource, rank: int, tp: int) -> None:
    """PEFT's initialization of the adapter's matrices (A Kaiming-uniform, B zero), drawn whole on every rank
    from the same seed so that the ranks agree, each keeping its pieces."""
    from .load.weights import load_from_state_dict

    generator = torch.Generator().manual_seed(0)
    state = {}
    params = [p for p in model.plan.params if is_adapter_parameter(p.name)]
    for p in params:
        full = torch.empty(p.shape, dtype=torch.float32)
        if ".lora_A." in p.name:
            bound = math.sqrt(6.0 / ((1 + 5.0) * p.shape[1]))  # kaiming_uniform_(a=sqrt(5)) over fan_in
            full.uniform_(-bound, bound, generator=generator)
        else:
            full.zero_()
        state[p.name] = full.to(model.dtype_)
    load_from_state_dict(model, dataclasses.replace(model.plan, params=params), state, rank, tp)
    set_trainable(model, adapter.trainable)
