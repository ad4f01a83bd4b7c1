"""transformers' private generation helpers, in one place: the only module of ``generation/`` that calls one.

``generate`` (``loop.py``) runs its own decoding loop, but builds what transformers' ``generate`` would
around it with transformers' own code, so that a checkpoint's ``generation_config.json``, the keyword
arguments, special tokens, logits processors and stopping criteria mean what they mean on one device.
transformers exposes that code only as private ``GenerationMixin`` methods. Checked against transformers
5.24.0 (the signatures below and what each reads and writes); a transformers upgrade that renames or
changes one breaks here, not across the loop.

Each is called through the model (``model._x(...)``, not ``GenerationMixin._x(model, ...)``): the parallel
model inherits them from ``GenerationMixin`` (``hf_methods.refuse_inherited``), and a method set on the
instance (tests/test_sampling.py records the processors that way) is the one used, as before.
"""
from __future__ import annotations


def prepare_generation_config(model, generation_config, kwargs: dict):
    """(config, model_kwargs): ``GenerationMixin._prepare_generation_config``: a copy of ``generation_config``
    (or of a default one) filled from ``model.generation_config`` (the checkpoint's) and transformers' defaults,
    then overridden by the keyword arguments it knows; those it does not know come back as ``model_kwargs``.
    Used so that the arguments and the checkpoint's defaults take precedence exactly as in transformers."""
    return model._prepare_generation_config(generation_config, **kwargs)


def prepare_special_tokens(model, config, has_attention_mask: bool, device) -> None:
    """``GenerationMixin._prepare_special_tokens``: writes the bos / eos / pad / decoder-start ids as tensors on
    ``device`` into the config's private fields (``config._eos_token_tensor``, ...), logging transformers'
    warnings about a missing attention mask. Needed before ``logits_processors`` and ``stopping_criteria``:
    transformers' processors (min length, ...) and its EOS stopping criterion read those fields."""
    model._prepare_special_tokens(config, has_attention_mask, device=device)


def pad_token(config):
    """The token transformers appends to rows that have stopped: ``config._pad_token_tensor`` as
    ``prepare_special_tokens`` left it (the pad id, else the first EOS id, with transformers' warning), a tensor
    on the model's device; None with neither (transformers then replaces no token: no row stops by EOS)."""
    return getattr(config, "_pad_token_tensor", None)


def logits_processors(model, config, prompt_length: int, device, given):
    """``GenerationMixin._get_logits_processor``: transformers' logits processors and warpers for ``config``
    (temperature, top-k, top-p, repetition penalty, min length, ...) merged with the caller's ``given``
    (a ``LogitsProcessorList``), in transformers' order. No ``model_kwargs``: the parallel model takes none
    that a processor reads."""
    return model._get_logits_processor(config, input_ids_seq_length=prompt_length, device=device,
                                       logits_processor=given, model_kwargs={})


def stopping_criteria(model, config, given, tokenizer):
    """``GenerationMixin._get_stopping_criteria``: transformers' stopping criteria for ``config`` (max length,
    max time, stop strings, which need ``tokenizer``, EOS) merged with the caller's ``given`` (a
    ``StoppingCriteriaList``); raises transformers' ValueError for stop strings without a tokenizer."""
    return model._get_stopping_criteria(config, given, tokenizer=tokenizer)
