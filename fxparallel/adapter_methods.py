"""transformers' PEFT-integration names on the parallel model: ``load_adapter`` (a saved PEFT LoRA adapter),
``add_adapter`` (a new one from a ``LoraConfig``), ``active_adapters``, ``set_adapter``, ``disable_adapters`` /
``enable_adapters`` (the graphs re-planned without / with the adapter, its matrices kept), ``delete_adapter``,
``get_adapter_state_dict`` and ``merge_and_unload``. Attaching an adapter re-plans the graphs with PEFT's LoRA
layers in them (``capture/adapters.py``), every base parameter's placement kept, and adds shards for the
adapter's matrices, read from the adapter's file or initialized as PEFT initializes them (A Kaiming-uniform,
B zero), alike on every rank. Several adapters may be attached: each keeps its shards, the graphs compute the
active one(s) (the last attached, or those ``set_adapter`` names). The base model is frozen, as PEFT freezes it."""
from __future__ import annotations

import copy
import dataclasses
import math

import torch

from .callers import functions_on_stack
from .capture.adapters import check_lora_config, is_adapter_parameter, without_adapter_name
from .dtensor_parameters import dtensor_views, follow_requires_grad
from .errors import ArgumentError
from .hf_methods import called_from_peft
from .load.adapter_files import AdapterSource, read_adapter
from .load.adapter_weights import load_adapter_weights, set_trainable


PEFT_STATE_DICT = (
    "peft.get_peft_model_state_dict / set_peft_model_state_dict cannot take the parallel model's adapter: its "
    "state_dict() holds this rank's shards of the adapter's matrices. Use model.get_adapter_state_dict() (the "
    "complete matrices under PEFT's names; every tp rank calls it), model.save_pretrained(dir) (adapter_config.json "
    "and adapter_model.safetensors), or model.load_adapter(dir)")


class AdapterMethods:
    """Mixed into ``ParallelCausalLM``; see the module docstring."""

    def load_adapter(self, peft_model_id=None, adapter_name=None, revision=None, token=None, is_trainable=False,
                     **unsupported):
        """Attach the LoRA adapter saved in ``peft_model_id`` (a directory or hub id; collective over the tp
        group), for inference, or trainable with ``is_trainable=True``; it becomes the active adapter (as PEFT's
        injection makes it)."""
        if unsupported or peft_model_id is None:
            raise ArgumentError(f"load_adapter takes peft_model_id, adapter_name, revision, token and is_trainable; "
                                f"got {sorted(unsupported) if unsupported else 'no peft_model_id'}")
        hub_kwargs = {k: v for k, v in dict(revision=revision, token=token).items() if v is not None}
        self._attach(read_adapter(str(peft_model_id), hub_kwargs, adapter_name or "default", is_trainable))

    def add_adapter(self, adapter_config, adapter_name=None):
        """Attach a new LoRA adapter of ``adapter_config`` (a ``peft.LoraConfig``), trainable and active,
        initialized as PEFT initializes it (``init_lora_weights=True``; collective over the tp group)."""
        check_lora_config(adapter_config, "add_adapter")
        if adapter_config.init_lora_weights is not True:
            raise ArgumentError(f"add_adapter: init_lora_weights={adapter_config.init_lora_weights!r} is not supported "
                                "on the parallel model (PEFT's default, True, is); initialize the adapter with PEFT, "
                                "save it and load it with load_adapter")
        self._attach(AdapterSource(copy.deepcopy(adapter_config), adapter_name or "default", None, True, "add_adapter"))

    @property
    def peft_config(self) -> dict:
        """{adapter name: LoraConfig} of the attached adapters, absent without one, as on transformers' models; a
        new dict per read, from the graphs' source. Absent to PEFT's tuner too, which would add its config to it in
        place before failing to wrap the parallel model (``hf_methods.called_from_peft``)."""
        attached = self._all_adapters()
        if attached and functions_on_stack("peft.utils.save_and_load"):
            raise ArgumentError(PEFT_STATE_DICT)
        if not attached or called_from_peft():
            raise AttributeError("peft_config: no adapter is attached" if not attached else "peft_config")
        return {a.name: a.config for a in attached}

    def active_adapters(self) -> list:
        return [self._adapter("active_adapters").name, *self._graph_set.factory.source.co_active]

    def set_adapter(self, adapter_name) -> None:
        """Make ``adapter_name`` (a name, or a list: their outputs add up, as in PEFT) the active adapter(s) (the
        graphs re-planned with them, every adapter's matrices kept; collective over the tp group) and, as PEFT's
        ``set_adapter`` does, the only trainable ones."""
        active = self._adapter("set_adapter")
        names = list(adapter_name) if isinstance(adapter_name, (list, tuple)) else [adapter_name]
        attached = {a.name: a for a in self._all_adapters()}
        missing = [n for n in names if n not in attached]
        if missing or not names:
            raise ArgumentError(f"set_adapter: adapter(s) {missing or names} not found; the model holds "
                                f"{list(attached)}")
        names = list(dict.fromkeys(names))
        if names != self.active_adapters():
            self._activate(attached[names[0]], names[1:], active.enabled)
        set_trainable(self, names, True)
        follow_requires_grad(self)  # Trainer's DTensor views, when it took them

    def disable_adapters(self) -> None:
        """Run the base model only: the graphs are re-planned without the adapters; their matrices stay
        (collective over the tp group)."""
        self._switch_adapter("disable_adapters", enabled=False)

    def enable_adapters(self) -> None:
        """Run the active adapter again after ``disable_adapters`` (collective over the tp group)."""
        self._switch_adapter("enable_adapters", enabled=True)

    def delete_adapter(self, adapter_names) -> None:
        """Remove the adapters named (their matrices and their layers; collective over the tp group). Deleting the
        active one makes the first remaining active and trainable, as PEFT does; deleting all leaves the base
        model."""
        active = self._adapter("delete_adapter")
        names = [adapter_names] if isinstance(adapter_names, str) else list(adapter_names)
        attached = self._all_adapters()
        missing = [n for n in names if n not in {a.name for a in attached}]
        if missing:
            raise ArgumentError(f"delete_adapter: adapter(s) {missing} not found; the model holds "
                                f"{[a.name for a in attached]}")
        self._refuse_parameter_views("delete_adapter", "delete adapters before apply_data_parallel or Trainer")
        kept = [a for a in attached if a.name not in names]
        chosen = next((a for a in kept if a.name == active.name), kept[0] if kept else None)
        if chosen is not None:
            chosen = dataclasses.replace(chosen, enabled=active.enabled)
        others = tuple(a for a in kept if chosen is None or a.name != chosen.name)
        co_active = tuple(n for n in self._graph_set.factory.source.co_active
                          if n not in names and chosen is not None and n != chosen.name)
        factory = self._graph_set.factory.with_adapter(chosen, others, co_active)
        planned = factory.training_graph()  # planned first: a failure changes nothing
        for name in names:
            for p in self.plan.params:
                if is_adapter_parameter(p.name, name):
                    _drop_path(self, p.name.rsplit(".", 1)[0])
        self._replace_graphs(factory, planned)
        if chosen is not None and chosen.name != active.name:
            set_trainable(self, [chosen.name, *co_active], True)

    def get_adapter_state_dict(self, adapter_name=None, state_dict=None) -> dict:
        """The matrices of the adapter named (the active one by default) as full tensors under PEFT's names for a
        transformers model (``model.layers.0.self_attn.q_proj.lora_A.weight``), on every rank (collective over the
        tp group)."""
        from .runtime.dtensor import full_tensor

        active = self._adapter("get_adapter_state_dict").name
        name = adapter_name or active
        held = [a.name for a in self._all_adapters()]
        if name not in held or state_dict is not None:
            raise ArgumentError(f"get_adapter_state_dict: adapter_name={adapter_name!r} (the model holds {held}) "
                                "and state_dict=None are taken")
        group = self.tp_group
        return {without_adapter_name(p.name, name): full_tensor(self.get_parameter(p.name), p, group).detach()
                for p in self.plan.params if is_adapter_parameter(p.name, name)}

    def merge_and_unload(self, progressbar: bool = False, safe_merge: bool = False, adapter_names=None):
        """PEFT's ``merge_and_unload``: fold the active adapter(s) into the base model's shards (each rank its
        pieces of ``scaling * B @ A``) and run the graphs without adapters (the others dropped, as PEFT unloads
        them): those of the plan the base layers follow, planned again only where it is not at hand (after
        ``model.to(dtype)``); returns the model (collective over the tp group)."""
        adapter = self._adapter("merge_and_unload")
        if safe_merge or adapter_names is not None:
            raise ArgumentError("merge_and_unload: safe_merge and adapter_names are not supported on the parallel model")
        self._refuse_parameter_views("merge_and_unload", "merge before apply_data_parallel or Trainer, or save the "
                                                         "adapter (save_pretrained) and merge it in a new process")
        del progressbar
        factory = self._graph_set.factory
        plain = factory.without_adapters()  # planned without the adapters first: a failure changes nothing
        planned = plain.training_graph()
        # the LoRA layers' scaling and layout from a meta model with the adapter in (disabled or not)
        source = factory.source
        adapted = factory.with_adapter(dataclasses.replace(adapter, enabled=True), source.inactive_adapters,
                                       source.co_active).meta
        for name in self.active_adapters():
            _merge(self, adapted, name)
        for path in {p.name.split(".lora_")[0] for p in self.plan.params if is_adapter_parameter(p.name)}:
            parent = self.get_submodule(path)
            parent._modules.pop("lora_A", None)
            parent._modules.pop("lora_B", None)
        self._replace_graphs(plain, planned)
        return self

    def _attached(self):
        """The active adapter (an AdapterSource), or None."""
        return getattr(getattr(self._graph_set.factory, "source", None), "adapter", None)

    def _all_adapters(self) -> tuple:
        """Every attached adapter (AdapterSource): the inactive ones, then the active one."""
        active = self._attached()
        return () if active is None else self._graph_set.factory.source.inactive_adapters + (active,)

    def _adapter(self, where: str) -> AdapterSource:
        """The active adapter; transformers' error when there is none."""
        adapter = self._attached()
        if adapter is None:
            raise ArgumentError(f"{where}: no adapter loaded; attach one first (load_adapter or add_adapter)")
        return adapter

    def _switch_adapter(self, where: str, enabled: bool) -> None:
        adapter = self._adapter(where)
        if adapter.enabled != enabled:
            self._activate(adapter, self._graph_set.factory.source.co_active, enabled)

    def _activate(self, adapter: AdapterSource, co_active, enabled: bool) -> None:
        """Re-plan the graphs with ``adapter`` active (and the adapters named ``co_active`` beside it), enabled or
        not; every adapter's matrices and every placement kept."""
        chosen = dataclasses.replace(adapter, enabled=enabled)
        others = tuple(a for a in self._all_adapters() if a.name != chosen.name)
        factory = self._graph_set.factory.with_adapter(chosen, others, tuple(co_active))
        self._replace_graphs(factory, factory.training_graph(), keep_plan=True)

    def _refuse_parameter_views(self, where: str, instead: str) -> None:
        """Refuse under FSDP (``apply_data_parallel``) or Trainer's DTensor views: their parameters are other
        objects than the shards this changes."""
        from .runtime.fsdp import is_data_parallel

        if is_data_parallel(self) or dtensor_views(self):
            raise ArgumentError(f"{where}: {instead}")

    def _attach(self, adapter: AdapterSource) -> None:
        where = "load_adapter" if adapter.files is not None else "add_adapter"
        attached = self._all_adapters()
        if adapter.name in {a.name for a in attached}:
            raise ArgumentError(f"{where}: adapter with name {adapter.name!r} already exists; pass another "
                                "adapter_name")
        self._refuse_parameter_views(where, "attach the adapter before apply_data_parallel or Trainer (their "
                                            "parameter views would not hold the adapter's)")
        factory = self._graph_set.factory.with_adapter(adapter, attached)  # planned first: a failure changes nothing
        planned = factory.training_graph()
        for p in planned.plan.params:
            if is_adapter_parameter(p.name, adapter.name):
                self._add_shard(p)
        self._replace_graphs(factory, planned)
        group = self.tp_group
        if adapter.files is not None:
            load_adapter_weights(self, self.plan, adapter, group.rank, group.size)
        else:
            _initialize(self, adapter, group.rank, group.size)


def _merge(model, meta, adapter: str) -> None:
    """Add each LoRA layer's change (``scaling * B @ A``, transposed for fan_in_fan_out weights, GPT-2's Conv1D;
    per expert for a LoRA of stacked expert weights) to this rank's shard of the weight it adapts; the scaling and
    layout are those of PEFT's layer in the meta model."""
    from .capture.adapter_parameters import parameter_delta
    from .capture.adapters import adapted_weight
    from .runtime.dtensor import full_tensor

    group = model.tp_group
    for path, layer in meta.named_modules():
        if adapter not in getattr(layer, "lora_A", {}):
            continue
        a_name, b_name = f"{path}.lora_A.{adapter}.weight", f"{path}.lora_B.{adapter}.weight"
        a = full_tensor(model.get_parameter(a_name), model.plan.param(a_name), group).float()
        b = full_tensor(model.get_parameter(b_name), model.plan.param(b_name), group).float()
        scaling = layer.scaling[adapter]
        if getattr(layer, "parameter_name", None) is not None:
            delta = parameter_delta(layer, a, b, scaling)
        else:
            delta = (b @ a) * scaling
            if getattr(layer, "fan_in_fan_out", False):
                delta = delta.T
        base = model.plan.param(adapted_weight(path, layer)[0])
        with torch.no_grad():
            shard = model.get_parameter(base.name)
            shard.add_(base.shard_of(delta, group.rank, group.size).to(shard.dtype))


def _initialize(model, adapter: AdapterSource, rank: int, tp: int) -> None:
    """PEFT's initialization of the adapter's matrices (A Kaiming-uniform, B zero), drawn whole on every rank
    from the same seed so that the ranks agree, each keeping its pieces."""
    from .load.weights import load_from_state_dict

    generator = torch.Generator().manual_seed(0)
    state = {}
    params = [p for p in model.plan.params if is_adapter_parameter(p.name, adapter.name)]
    for p in params:
        full = torch.empty(p.shape, dtype=torch.float32)
        if ".lora_A." in p.name:
            bound = math.sqrt(6.0 / ((1 + 5.0) * p.shape[1]))  # kaiming_uniform_(a=sqrt(5)) over fan_in
            full.uniform_(-bound, bound, generator=generator)
        else:
            full.zero_()
        state[p.name] = full.to(model.dtype_)
    load_from_state_dict(model, dataclasses.replace(model.plan, params=params), state, rank, tp)
    set_trainable(model, adapter.name, adapter.trainable)


def _drop_path(model, path: str) -> None:
    """Remove the module at ``path`` (an adapter's ``<layer>.lora_A.<name>``) and its ``lora_A`` / ``lora_B``
    holder when that is left empty."""
    holder, _, name = path.rpartition(".")
    parent = model.get_submodule(holder)
    parent._modules.pop(name, None)
    if not parent._modules and not parent._parameters:
        owner, _, kind = holder.rpartition(".")
        model.get_submodule(owner)._modules.pop(kind, None)
