"""The Hugging Face model methods of the parallel model (``ParallelCausalLM`` inherits this mixin).

Whoever swaps ``AutoModelForCausalLM.from_pretrained`` for ``fxparallel.parallelize`` reaches for
the same methods. Each one either means what it means in transformers, or raises an error that
names what to do instead. What each does on the parallel model:

Work as in transformers
    ``config``, ``generation_config`` (the checkpoint's generation_config.json, else the defaults
    of the config), ``name_or_path``, ``main_input_name``, ``can_generate()``, ``device``,
    ``dtype``, ``generate`` (module.py), ``eval()`` / ``train()`` / ``requires_grad_()`` /
    ``zero_grad()`` (nn.Module's, on this rank's shards), ``num_parameters()`` (the whole
    model's count; ``local=True``: this rank's), ``forward(..., return_dict=False)`` (transformers'
    tuple: the loss when labels are given, the logits, the cache; logits left sharded are refused,
    naming ``gather_logits=True``: a vocabulary shard never sits where the logits are read).
``save_pretrained(dir, ...)``
    A consolidated transformers checkpoint (config.json, generation_config.json, safetensors),
    written once; collective: every tp rank calls it (every rank of the job under
    ``apply_data_parallel``). Tensors are gathered to the writer alone, one at a time
    (``runtime/export.py``). Takes ``max_shard_size``, ``variant``, ``save_original_format``,
    ``is_main_process`` (False: this rank does not write; a tp group without a writer gathers
    nothing; for replicas that should not write) and
    ``safe_serialization=True``; plus ``dtype`` (cast on writing) and ``mesh`` (a training
    job's ParallelMesh: the writer is global rank 0). Refuses ``state_dict``, ``push_to_hub``,
    ``distributed_checkpoint=True`` and anything else by name.
``get_input_embeddings()`` / ``get_output_embeddings()``
    Views over this rank's shard (``embeddings.py``): ``.weight`` is the model's parameter
    (this rank's rows ``.vocab_range``), calling the view computes the full embeddings / logits
    (collective). ``set_*_embeddings`` and ``resize_token_embeddings`` are refused: change the
    Hugging Face model, save it, parallelize the saved directory.
``print(model)``
    This rank's placement of every parameter, identical layers grouped (``summary.py``).
``to(dtype)``, ``half()``, ``float()``, ``bfloat16()``, ``double()``
    Cast the shards and re-capture the graphs in the new dtype (a meta model built in it, every
    placement kept): the model then computes what ``parallelize(..., dtype=new)`` computes.
    Refused under ``apply_data_parallel`` (use its ``mixed_precision``). KV caches made before
    are not valid afterwards. A device change (``cuda()``, ``to("cuda")``) is refused: pass
    ``device=`` to ``parallelize``.
``tie_weights()``
    Nothing to do: tied parameters are one parameter object under both names.
``get_memory_footprint()``
    This rank's bytes (its shards, and buffers unless ``return_buffers=False``).
``state_dict()`` / ``load_state_dict()``
    nn.Module's: this rank's shards (local shapes) under the Hugging Face names, tied weights
    under both. Complete tensors: ``save_pretrained`` or ``runtime.gather_full_state_dict``;
    checkpoints that load into another layout: ``runtime.save_checkpoint``.
``enable_input_require_grads()`` / ``disable_input_require_grads()``
    Nothing to do: activation checkpointing here is non-reentrant, which needs no input that
    requires grad (PEFT calls these).
``prepare_inputs_for_generation``, ``push_to_hub``, ``get_decoder``, ``base_model``, ... and any
other attribute transformers' PreTrainedModel has and this class lacks
    An error (an AttributeError, so ``hasattr`` stays False) naming what to use instead.
Forward arguments the graphs do not take
    (``inputs_embeds``, ``output_attentions``, ``output_hidden_states``, ``cache_position``,
    ``num_logits_to_keep``, ...): a TypeError naming the argument and the alternative; a value that
    asks for nothing (``output_attentions=False``, ``inputs_embeds=None``) is accepted.
``gradient_checkpointing_enable`` / ``_disable``: module.py (activation checkpointing).
"""
from __future__ import annotations

import dataclasses
import inspect
from typing import Optional

import torch
from torch import nn

from . import fused_head
from .callers import functions_on_stack
from .dtensor_parameters import CLIPPING, dtensor_views, refresh_views, use_dtensor_parameters, views_for_clipping
from .errors import ArgumentError, ShardingError
from .inputs import ARGUMENTS
from .trainer_counts import flops_share
from .trainer_data_parallel import no_gradient_sync
from .trainer_fsdp import clip_views as fsdp_clip_views

# forward arguments the graphs do not take: what to do instead
ALTERNATIVES = {
    "inputs_embeds": "the graphs take token ids: pass input_ids (model.get_input_embeddings()(input_ids) computes "
                     "the embeddings the model uses, but forward cannot start from embeddings)",
    "output_attentions": "attention weights are not returned (each rank computes its own heads, with fused attention "
                         "kernels); inspect them on the single-device transformers model",
    "output_hidden_states": "hidden states are not returned (the graphs output the loss and logits only); inspect "
                            "them on the single-device transformers model",
    "cache_position": "positions come from position_ids (and the KV cache from past_key_values): pass position_ids",
    "num_logits_to_keep": "transformers' older name: pass logits_to_keep=k",
    "token_type_ids": "token type ids are not supported by the parallel model",
    "head_mask": "head masks are not supported by the parallel model",
}
# values of those arguments that ask for nothing
_HARMLESS = (None, False)


def refuse_arguments(unsupported: dict) -> None:
    """Raise a TypeError naming each forward argument the parallel model does not take (and what to do
    instead); arguments whose value asks for nothing (None, False) are ignored."""
    asked = {k: v for k, v in unsupported.items() if not any(v is h for h in _HARMLESS)}
    if not asked:
        return

    lines = [f"{name}: {ALTERNATIVES[name]}" for name in sorted(asked) if name in ALTERNATIVES]
    unknown = sorted(set(asked) - set(ALTERNATIVES))
    if unknown:
        lines.append(f"{', '.join(unknown)}: not an argument of the parallel model")
    raise TypeError(f"fxparallel models take {', '.join(ARGUMENTS)}, past_key_values, use_cache, gather_logits, "
                    f"logits_to_keep, return_dict; got unsupported {sorted(asked)}:\n  " + "\n  ".join(lines))


def _dtype_name(dtype) -> str:
    return str(dtype).replace("torch.", "")


def _pretrained_model_attribute(name: str) -> bool:
    if name.startswith("__"):
        return False
    try:
        from transformers import PreTrainedModel
    except ImportError:  # pragma: no cover - transformers is a dependency
        return False
    return hasattr(PreTrainedModel, name)


class MissingHuggingFaceMethod(AttributeError):
    """A transformers PreTrainedModel attribute that the parallel model does not have."""


# attributes of PreTrainedModel with a specific answer
_INSTEAD = {
    "push_to_hub": "call model.save_pretrained(directory) on every tp rank, then upload the directory from one "
                   "process with huggingface_hub.upload_folder(repo_id=..., folder_path=directory)",
    "prepare_inputs_for_generation": "model.generate(...) runs the decoding loop; for a loop of your own call "
                                     "model(input_ids=..., attention_mask=..., position_ids=..., "
                                     "past_key_values=model.new_cache(length)) (see forward's docstring)",
    "get_decoder": "the decoder layers run inside the captured graphs, not as a transformers submodule; run the "
                   "whole model",
    "base_model": "the decoder runs inside the captured graphs, not as a transformers submodule; run the whole model "
                  "(for TRL's fused LM head, apply trl.trainer.utils.add_fused_lm_head to the parallel model itself, "
                  "as SFTTrainer does: the model then answers fused_lm_head=True across the vocabulary shards)",
    "set_input_embeddings": "resize or replace the embeddings on the Hugging Face model, save_pretrained it, and "
                            "parallelize the saved directory",
    "set_output_embeddings": "resize or replace the head on the Hugging Face model, save_pretrained it, and "
                             "parallelize the saved directory",
}


class HuggingFaceMethods:
    """transformers' PreTrainedModel methods on ``ParallelCausalLM``: see the module docstring."""

    main_input_name = "input_ids"

    def __setattr__(self, name: str, value) -> None:
        if name == "forward" and fused_head.adopt(self, value):
            return  # TRL's fused LM head: the model answers fused_lm_head=True itself (fused_head.py)
        super().__setattr__(name, value)

    # ---- attributes ----------------------------------------------------------------------------------
    @property
    def device(self) -> torch.device:
        return self.device_

    @property
    def dtype(self) -> torch.dtype:
        return self.dtype_

    @property
    def name_or_path(self) -> str:
        return getattr(self.config, "_name_or_path", "") or ""

    def can_generate(self) -> bool:
        return True

    @property
    def tp_size(self) -> int:
        """transformers' tensor-parallel degree. Trainer and accelerate read it to learn that the model was sharded
        before they saw it (they then leave it unwrapped and give every tp rank the same batch); from the first
        read on, ``parameters()`` are DTensor views of the shards, so that their gradient clipping is exact
        (``dtensor_parameters.py``)."""
        from .runtime.fsdp import is_data_parallel

        size = self.tp_group.size
        # (at tp 1 under fxparallel's FSDP: Trainer's FSDP2 model; with cp ranks: trainer_context_parallel.py)
        if size > 1 or is_data_parallel(self) or self.cp_size > 1:
            use_dtensor_parameters(self)  # once; it also sets config.distributed_config
        return size

    def no_sync(self):
        """DDP's context for the micro-batches of gradient accumulation, which accelerate enters: under Trainer
        with data parallelism around the tp group, the backwards inside it leave the gradient average over the
        dp ranks to the next one outside (``trainer_data_parallel.py``), and under fxparallel's FSDP its reduction
        (``trainer_fsdp.py``); otherwise nothing to skip."""
        return no_gradient_sync(self)

    @property
    def is_distributed_loading_by_transformers(self) -> bool:
        """transformers' flag of a model sharded at load time, on once the model is in Trainer's hands (after
        ``tp_size``): Trainer then leaves placement and gradient reduction to it, and saves it on every rank with
        ``save_pretrained``, which gathers the shards (Trainer refuses to checkpoint optimizer states of such
        models: ``save_only_model=True`` or ``save_strategy="no"``)."""
        return dtensor_views(self) is not None

    def local_named_parameters(self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True):
        """The registered parameters (this rank's plain shards, or FSDP's DTensors), whatever ``named_parameters``
        answers (``dtensor_parameters.py``)."""
        return nn.Module.named_parameters(self, prefix, recurse, remove_duplicate)

    def named_parameters(self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True):
        """The DTensor views in their mode (``dtensor_parameters.py``), else the plain shards; iterated by torch's
        ``clip_grad_norm_`` at tp > 1 (``clip_grad_norm_(model.parameters(), ...)`` in a loop of one's own), the
        mode begins first, so that the norm is the whole model's."""
        views = dtensor_views(self)
        if views is None and self.tp_group.size > 1 and functions_on_stack(CLIPPING, limit=4):
            views = views_for_clipping(self)
        views = fsdp_clip_views(self) or views  # fxparallel's FSDP under Trainer, while it clips (trainer_fsdp.py)
        for name, param in nn.Module.named_parameters(self, prefix, recurse, remove_duplicate):
            yield name, (views.get(id(param), param) if views else param)

    input_modalities = "text"  # transformers' (pipelines print it)
    _keys_to_ignore_on_save = None  # transformers' default (Trainer reads it after loading a checkpoint)

    def add_model_tags(self, tags) -> None:
        """Tags for the model card (TRL's trainers add theirs), as transformers keeps them."""
        tags = [tags] if isinstance(tags, str) else list(tags)
        kept = self.__dict__.setdefault("model_tags", [])
        kept.extend(t for t in tags if t not in kept)

    def _get_name(self) -> str:
        """The Hugging Face model's class name (LlamaForCausalLM), as nn.Module answers for transformers' model:
        Trainer's label smoothing shifts the labels only for the class names of causal LMs it knows (with another
        name, ``label_smoothing_factor`` scored each token against itself, silently: loss 5.53 where one device
        gives 4.93)."""
        return self.hf_class_name or nn.Module._get_name(self)

    @property
    def loss_type(self) -> Optional[str]:
        """transformers' name of the loss (``LOSS_MAPPING``), the Hugging Face model's own: Trainer reads it to count
        the label tokens of ``num_items_in_batch``, shifted for "ForCausalLM" (the loss shifts the labels itself),
        all of them for a model whose class name transformers does not map (None: GPT-2's ``GPT2LMHeadModel``),
        so Trainer normalizes the loss as it does for the Hugging Face model."""
        return self.hf_loss_type

    def num_parameters(self, only_trainable: bool = False, exclude_embeddings: bool = False,
                       local: bool = False) -> int:
        """The whole model's parameter count, as transformers counts it (tied weights once; without the
        ``nn.Embedding`` tables if ``exclude_embeddings``); ``local``: the elements this rank holds. Asked by
        ``Trainer.floating_point_ops``: this rank's share of the count (trainer_counts.py)."""
        excluded = set(self.embedding_weights) if exclude_embeddings else set()
        if local:
            return sum(p.numel() for name, p in self.local_named_parameters()
                       if (p.requires_grad or not only_trainable) and name not in excluded)
        total = 0
        for p in self.plan.params:
            if excluded.intersection(p.names):
                continue
            count = 1
            for size in p.shape:
                count *= size
            total += count
        return flops_share(total, self.tp_group.rank, self.tp_group.size)

    def get_memory_footprint(self, return_buffers: bool = True) -> int:
        """Bytes this rank holds: its parameter shards (and buffers, unless ``return_buffers=False``)."""
        def nbytes(t):
            t = getattr(t, "_local_tensor", t)  # an FSDP DTensor: this rank's piece
            return t.nelement() * t.element_size()

        total = sum(nbytes(p) for _, p in self.local_named_parameters())
        if return_buffers:
            total += sum(nbytes(b) for b in self.buffers())
        return total

    def tie_weights(self, *args, **kwargs) -> None:
        """Nothing to do: tied parameters are one parameter object under every name (``plan.params[i].aliases``)."""

    def enable_input_require_grads(self) -> None:
        """Nothing to do: activation checkpointing on the parallel model is non-reentrant, which needs no
        input that requires grad (transformers' reason for this method)."""

    def disable_input_require_grads(self) -> None:
        """Nothing to do (see ``enable_input_require_grads``)."""

    def prepare_inputs_for_generation(self, *args, **kwargs):
        raise NotImplementedError(f"prepare_inputs_for_generation is not supported on the parallel model: "
                                  f"{_INSTEAD['prepare_inputs_for_generation']}")

    # ---- embeddings ----------------------------------------------------------------------------------
    def _embedding_view(self, kind: str):
        from .embeddings import ShardedEmbedding, ShardedLMHead

        found = getattr(self, "embedding_modules", {}).get(kind)
        if found is None:
            raise NotImplementedError(f"get_{kind}_embeddings: the model has no {kind} embedding module with a 2-D "
                                      f"weight (transformers' get_{kind}_embeddings found none)")
        cls = ShardedEmbedding if kind == "input" else ShardedLMHead
        return cls(self, *found)

    def get_input_embeddings(self):
        """A view over this rank's shard of the input embedding table (``embeddings.ShardedEmbedding``):
        ``.weight`` (this rank's rows ``.vocab_range``), full sizes; calling it looks ids up (collective)."""
        return self._embedding_view("input")

    def get_output_embeddings(self):
        """A view over this rank's shard of the output head (``embeddings.ShardedLMHead``): ``.weight``
        (this rank's vocabulary rows ``.vocab_range``); calling it gives complete logits (collective)."""
        return self._embedding_view("output")

    def resize_token_embeddings(self, *args, **kwargs):
        raise NotImplementedError("resize_token_embeddings is not supported on a sharded model: resize the Hugging "
                                  "Face model first, save_pretrained it, and parallelize the saved directory")

    # ---- saving --------------------------------------------------------------------------------------
    def save_pretrained(self, save_directory, is_main_process: bool = True, state_dict: Optional[dict] = None,
                        push_to_hub: bool = False, max_shard_size="50GB", variant: Optional[str] = None,
                        token=None, save_peft_format: bool = True, save_original_format: bool = True,
                        distributed_checkpoint: bool = False, safe_serialization: bool = True, *,
                        dtype: Optional[torch.dtype] = None, mesh=None, **kwargs) -> None:
        """Write a consolidated transformers checkpoint to ``save_directory`` (collective: every tp rank
        calls it; every rank of the job under ``apply_data_parallel`` or with ``mesh``). Rank 0 of the
        tp group (global rank 0 under data parallelism or with ``mesh``) writes; its failure is raised
        on every rank. ``AutoModelForCausalLM.from_pretrained(save_directory)`` then loads the model."""
        from .runtime.export import ExportScope, write_pretrained

        refused = {
            "state_dict": (state_dict is not None, "the parallel model gathers its own complete tensors; to save "
                           "other tensors, load them into the transformers model and save that"),
            "push_to_hub": (bool(push_to_hub), _INSTEAD["push_to_hub"]),
            "distributed_checkpoint": (bool(distributed_checkpoint), "for checkpoints that load into any "
                                       "(dp, tp, cp) layout use fxparallel.runtime.save_checkpoint(root, model, "
                                       "optimizer, mesh, step)"),
            "safe_serialization": (not safe_serialization, "only safetensors is written (as transformers 5 does)"),
        }
        # a refusal is raised on every rank after the writer's first exchange (runtime/export.py), so a rank
        # given an argument alone does not leave the others waiting in a gather
        refusal = next((ArgumentError(f"save_pretrained({name}=...) is not supported on the parallel model: {instead}")
                        for name, (given, instead) in refused.items() if given), None)
        if refusal is None and kwargs:
            refusal = ArgumentError(f"save_pretrained: unsupported arguments {sorted(kwargs)} (the parallel model "
                                    "takes is_main_process, max_shard_size, variant, save_original_format, "
                                    "safe_serialization=True, dtype and mesh)")
        del token, save_peft_format  # only for pushing, and for adapters: neither applies here
        scope = (ExportScope.of_mesh(mesh, is_main_process) if mesh is not None
                 else ExportScope.of_model(self, is_main_process))
        write_pretrained(self, str(save_directory), scope, dtype=dtype, max_shard_size=max_shard_size,
                         variant=variant, save_original_format=save_original_format, refusal=refusal)

    # ---- dtype and device ------------------------------------------------------------------------------
    def _apply(self, fn, recurse=True):
        """``model.to(dtype)``, ``.half()``, ``.float()``, ...: cast the shards and re-capture the graphs
        in that dtype (``_cast``). ``.cuda()``, ``.to(device)``: the graphs and the process group are
        bound to one device, so a device change is refused, saying what to do."""
        where = f"{_dtype_name(self.dtype_)} on {self.device_}"
        try:
            probe = fn(torch.empty(0, dtype=self.dtype_, device=self.device_))
        except Exception as err:  # noqa: BLE001 - e.g. .cuda() where torch has no CUDA
            raise ShardingError(f"this parallel model was captured and loaded in {where}; moving it to another "
                                f"device is not supported ({type(err).__name__}: {err}): pass device= to "
                                "fxparallel.parallelize instead") from err
        if not isinstance(probe, torch.Tensor) or (probe.dtype == self.dtype_ and probe.device == self.device_):
            out = super()._apply(fn, recurse)
            refresh_views(self)
            return out
        if probe.device != self.device_:
            raise ShardingError(
                f"this parallel model was captured and loaded in {where}; moving it to "
                f"{_dtype_name(probe.dtype)} on {probe.device} is not supported: pass device= to "
                f"fxparallel.parallelize instead")
        out = self._cast(fn, probe.dtype, recurse)
        refresh_views(self)
        return out

    def _cast(self, fn, dtype: torch.dtype, recurse: bool):
        """Cast every shard to ``dtype`` and re-capture the graphs in it: the captured code bakes its dtype
        in (casts, constants, buffers such as rotary frequencies, which stay float32 where the model keeps
        them so), so the graphs are dropped and the training graph captured again from a meta model built
        in ``dtype``, with every parameter's placement kept."""
        from .runtime.fsdp import is_data_parallel

        if not dtype.is_floating_point:
            raise ShardingError(f"cannot cast the parallel model to {_dtype_name(dtype)}: not a floating point dtype")
        if is_data_parallel(self):
            raise ShardingError(
                f"cannot cast the parallel model to {_dtype_name(dtype)} under apply_data_parallel (FSDP holds its "
                "own copies): pass dtype= to fxparallel.parallelize before apply_data_parallel, or use its "
                "mixed_precision= argument")
        in_dtype = getattr(self._graph_set.factory, "in_dtype", None)
        if in_dtype is None:
            raise ShardingError(f"cannot cast the parallel model to {_dtype_name(dtype)}: its graph factory cannot "
                                "capture another dtype; pass dtype= to fxparallel.parallelize instead")
        factory = in_dtype(dtype)  # the meta model and the training graph first: a failure changes nothing
        planned = factory.training_graph()
        super()._apply(fn, recurse)  # parameters (in place: optimizers keep them), gradients, buffers
        self.set_buffers(factory.meta.fxparallel_buffers)  # as the model's __init__ makes them in ``dtype``
        self.dtype_ = dtype
        self._replace_graphs(factory, planned, keep_plan=True)  # also a compiled generate's kept cache
        self.plan = dataclasses.replace(self.plan, dtype=planned.plan.dtype, collectives=planned.plan.collectives)
        return self

    # ---- display and missing attributes ------------------------------------------------------------------
    def __repr__(self) -> str:
        from .summary import sharding_summary

        return sharding_summary(self)

    def extra_repr(self) -> str:
        cp = f", cp={self.cp_group.size}" if self.cp_group is not None else ""
        return f"tp={self.tp_group.size}, rank={self.tp_group.rank}{cp}, model_type={self.plan.model_type}"

    def __getattr__(self, name: str):
        try:
            return super().__getattr__(name)  # nn.Module's: parameters, buffers, submodules
        except AttributeError:
            if not _pretrained_model_attribute(name) and name not in _INSTEAD:
                raise
        if called_from_peft():
            raise MissingHuggingFaceMethod(_PEFT_WRAP) from None
        raise _missing(type(self).__name__, name) from None


_PEFT_WRAP = ("peft.get_peft_model / PeftModel(...) cannot wrap the parallel model: its layers are shards run by "
              "captured graphs, not modules PEFT can replace. Attach LoRA on the parallel model itself: "
              "model.add_adapter(LoraConfig(...)) or model.load_adapter(path), or parallelize the adapter's directory "
              "or a PeftModel. With TRL, call model.add_adapter(peft_config) and pass the model to the trainer without "
              "peft_config (docs/training.md, \"LoRA adapters\")")


def called_from_peft() -> bool:
    """Whether PEFT's code is on the stack (its tuners read transformers attributes while injecting layers)."""
    return bool(functions_on_stack("peft."))


def _missing(cls_name: str, name: str) -> MissingHuggingFaceMethod:
    instead = _INSTEAD.get(name, "see docs/reference.md, \"Hugging Face methods\", for what the parallel model has")
    return MissingHuggingFaceMethod(
        f"{cls_name} (fxparallel's parallel model, a PreTrainedModel in name only: its weights are shards and "
        f"it runs captured graphs) does not implement PreTrainedModel.{name}: {instead}")


class _Refused:
    """A PreTrainedModel attribute the parallel model does not have: reading it on an instance raises
    ``MissingHuggingFaceMethod`` (so ``hasattr`` is False); an instance may still set it."""

    def __init__(self, name: str):
        self.name = name

    def __get__(self, instance, owner=None):
        if instance is None:
            return self
        raise _missing(type(instance).__name__, self.name)


def refuse_inherited(cls) -> type:
    """``cls`` subclasses PreTrainedModel so that the tools that take one (Trainer saves it with
    ``save_pretrained``, pipelines, TRL) take it; none of PreTrainedModel's single-device code may run on
    it. Every attribute of PreTrainedModel (and of its mixins) that ``cls`` does not define itself is
    refused, or, where PreTrainedModel overrides one of nn.Module's / GenerationMixin's, is theirs again."""
    from transformers import PreTrainedModel
    from transformers.generation import GenerationMixin

    own = set()
    for klass in cls.__mro__:
        if klass is PreTrainedModel:
            break
        own.update(vars(klass))
    for name in dir(PreTrainedModel):
        if name.startswith("__") or name in own or name == "config_class":
            continue
        base = next((k for k in (nn.Module, GenerationMixin) if name in dir(k)), None)
        if base is not None:
            setattr(cls, name, inspect.getattr_static(base, name))
        else:
            setattr(cls, name, _Refused(name))
    return cls
