"""``generate``: transformers' decoding loop for greedy search and sampling, run on the parallel
model with a static cache sharded by heads.

What is transformers' own: the GenerationConfig (the checkpoint's ``generation_config.json`` by
default, overridden by keyword arguments), special tokens, logits processors, stopping criteria,
streamers, the output class and ``compile_config`` (the decode steps run ``torch.compile``d with it;
unlike transformers, never by default on a GPU; ``mode="reduce-overhead"`` gives CUDA graphs, measured
in docs/gpu.md). What tensor parallelism
changes: the next token is chosen from vocab-sharded logits (``select.py``), every rank returns the
same tokens (the arguments are checked equal on every rank first, sampling draws from a generator
seeded alike on every rank), and two graphs (prefill, decode) are captured per cache length, not
per token or prompt length.
"""
from __future__ import annotations

import hashlib

import torch
import torch.distributed as dist

from ..errors import InputError
from ..inputs import ranks_named
from .cache import ParallelCache, cache_length
from .select import full_scores, top_k_candidates, vocab_parallel_argmax

SUPPORTED_MODES = ("greedy_search", "sample")


def _same_on_every_rank(model, what: str, text: str, refused=None) -> None:
    """Refuse arguments that differ between the tp ranks (they would desynchronize the loop and hang), and
    raise on every rank an error one rank's own checks raised (``refused``): that rank raises its own, the others
    one naming it. Every rank takes part in the exchange before anything is raised, so an argument given to one
    rank only never leaves the others waiting in a collective."""
    group = model.tp_group
    if group.process_group is None or group.size == 1:
        if refused is not None:
            raise refused
        return
    # on the model's device: an NCCL group takes CUDA tensors only; the first number flags a refusal
    digest = torch.tensor([int(refused is not None)] + list(hashlib.sha256(text.encode()).digest()[:8]),
                          dtype=torch.int64, device=model.device_)
    rows = [torch.empty_like(digest) for _ in range(group.size)]
    dist.all_gather(rows, digest, group=group.process_group)
    if refused is not None:
        raise refused
    failed = [r for r, row in enumerate(rows) if int(row[0])]
    if failed:
        where = "that rank" if len(failed) == 1 else "those ranks"
        raise InputError(f"generate: the arguments of {ranks_named(failed)} were refused (see the error on {where}); "
                         f"every tp rank must call generate with the same prompts and generation arguments")
    differ = [r for r, row in enumerate(rows) if not torch.equal(row, rows[0])]
    if differ:
        raise InputError(f"generate: the tp ranks were given different {what} (rank 0 vs ranks {differ}); every tp "
                         f"rank must call generate with the same prompts and generation arguments")


def _cache_field(output_class) -> str:
    """The field of a transformers output class that holds the KV cache: ``cache`` from transformers 5.24 on
    (the old name then logs a deprecation warning), ``past_key_values`` before."""
    return "cache" if "cache" in output_class.__dataclass_fields__ else "past_key_values"


def _described(config) -> str:
    """The generation config as text that is the same on every rank for the same arguments (a function in it,
    e.g. a compile backend, by its name: its address differs between processes)."""
    import json

    return json.dumps(config.to_dict(), sort_keys=True, default=lambda o: getattr(o, "__qualname__", type(o).__name__))


def _vocab_parallel_top_k(processors, sample: bool, config):
    """k when sampling needs only each rank's top k: the processors are a top-k warper with, at most,
    temperature and top-p (transformers' sampling defaults); None otherwise (the row is gathered)."""
    from transformers.generation.logits_process import (TemperatureLogitsWarper, TopKLogitsWarper,
                                                        TopPLogitsWarper)

    if not sample or config.output_scores:
        return None
    kinds = [type(p) for p in processors]
    if TopKLogitsWarper not in kinds or any(k not in (TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper)
                                            for k in kinds):
        return None
    if TopPLogitsWarper in kinds and kinds.index(TopPLogitsWarper) < kinds.index(TopKLogitsWarper):
        return None  # top-p over the whole row first: it needs the whole row
    return next(p.top_k for p in processors if isinstance(p, TopKLogitsWarper))


def _positions(mask: torch.Tensor) -> torch.Tensor:
    """transformers' position ids for left padding: the count of real tokens before each one."""
    positions = mask.long().cumsum(-1) - 1
    return positions.masked_fill(mask == 0, 1)


def _compiled_steps_cache(model, length: int, batch: int) -> ParallelCache:
    """For compiled decode steps: the last compiled call's cache, emptied, where its length and batch fit; else
    a new one, kept for the next call. As transformers reuses its static cache: CUDA graphs replay on the
    cache's tensors (static addresses), and new tensors every call would record the graphs again and hold
    another pool of memory. A cache that an earlier compiled call returned (``return_dict_in_generate``) is
    therefore overwritten by the next one of its shape. Eager calls make their own cache and keep nothing.
    (Inference mode is part of the key: a cache made under it holds inference tensors, which cannot be
    written outside it. A cast of the model drops the kept cache: ``hf_methods.py``.)"""
    key = (length, batch, torch.is_inference_mode_enabled())
    graphs = model._graph_set
    if graphs.kept_cache is not None and graphs.kept_cache[0] == key:
        cache = graphs.kept_cache[1]
        cache.reset()
        return cache
    cache = ParallelCache(length)
    graphs.kept_cache = (key, cache)
    return cache


def _checked_arguments(model, input_ids, attention_mask, generation_config, kwargs):
    """This rank's generate arguments, checked: (generation config, input_ids and attention mask on the model's
    device, the max_length the caller gave). Raises what is refused (a mode, an argument, a shape)."""
    if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2:
        got = (f"shape {tuple(input_ids.shape)}" if isinstance(input_ids, torch.Tensor) else
               type(input_ids).__name__)
        raise InputError(f"generate needs input_ids of shape [batch, prompt length], got {got}")
    if model.cp_group is not None:
        raise InputError("generate is not supported under context parallelism (cp_group): parallelize without it")
    user_max_length = kwargs.get("max_length")
    config, model_kwargs = model._prepare_generation_config(generation_config, **kwargs)
    mode = config.get_generation_mode()
    if str(mode.value if hasattr(mode, "value") else mode) not in SUPPORTED_MODES:
        raise InputError(f"generate: {mode.value} is not supported on the parallel model (num_beams="
                         f"{config.num_beams}, num_beam_groups={getattr(config, 'num_beam_groups', 1)}, "
                         f"penalty_alpha={config.penalty_alpha}); greedy search and sampling are")
    unknown = sorted(k for k in model_kwargs if k not in ("use_cache",))
    if unknown:
        raise InputError(f"generate: unsupported arguments {unknown} (the parallel model takes input_ids, "
                         f"attention_mask and generation options)")
    if (config.num_return_sequences or 1) > 1 and not config.do_sample:
        raise InputError(f"generate: num_return_sequences={config.num_return_sequences} with greedy search, which "
                         f"returns one sequence per prompt (transformers refuses it too): pass do_sample=True to draw "
                         f"several")
    device = model.device_
    input_ids = input_ids.to(device)
    mask = (attention_mask if attention_mask is not None else torch.ones_like(input_ids)).to(device).long()
    if tuple(mask.shape) != tuple(input_ids.shape):
        raise InputError(f"attention_mask has shape {tuple(mask.shape)} but input_ids has {tuple(input_ids.shape)}")
    return config, input_ids, mask, user_max_length


def generate(model, input_ids: torch.Tensor, attention_mask=None, generation_config=None, streamer=None,
             logits_processor=None, stopping_criteria=None, **kwargs):
    from transformers.generation import GenerateDecoderOnlyOutput, LogitsProcessorList, StoppingCriteriaList

    # this rank's own checks: an error is raised only after the ranks have compared their arguments (every rank
    # raises then), so that an argument given to one rank only never leaves the others waiting
    refused, text = None, ""
    tokenizer = kwargs.pop("tokenizer", None)  # transformers' argument for stop_strings (pipelines pass it)
    try:
        config, input_ids, mask, user_max_length = _checked_arguments(model, input_ids, attention_mask,
                                                                      generation_config, kwargs)
        # the processors and criteria given are compared by class (their own reprs hold addresses)
        given = [type(p).__qualname__ for p in (logits_processor or [])] + ["|"] + [
            type(c).__qualname__ for c in (stopping_criteria or [])]
        text = _described(config) + str(given) + str(input_ids.tolist()) + str(mask.tolist())
    except Exception as err:  # noqa: BLE001 - raised in the exchange, after the other ranks have heard of it
        refused = err
    _same_on_every_rank(model, "prompts or generation arguments", text, refused)
    device = model.device_
    if (config.num_return_sequences or 1) > 1:  # sampling: each prompt's rows drawn independently, as in transformers
        input_ids = input_ids.repeat_interleave(config.num_return_sequences, dim=0)
        mask = mask.repeat_interleave(config.num_return_sequences, dim=0)
    batch, prompt = input_ids.shape
    model._prepare_special_tokens(config, attention_mask is not None, device=device)
    if config.max_new_tokens is not None:
        config.max_length = prompt + config.max_new_tokens
    elif user_max_length is None and config.max_length is None:
        config.max_length = prompt + 20
    if config.min_new_tokens is not None:
        config.min_length = prompt + config.min_new_tokens
    if config.max_length <= prompt:
        raise InputError(f"generate: max_length {config.max_length} leaves no room after the prompt of {prompt} "
                         f"tokens: raise max_new_tokens / max_length")
    window = model.sliding_window
    if window is not None and config.max_length > window:
        if prompt >= window:  # no max_new_tokens helps: the prompt must be shorter
            raise InputError(f"generate: the prompt alone fills the model's sliding attention window: {prompt} "
                             f"tokens, window {window} tokens, beyond which its cache rolls, and the parallel model's "
                             f"graphs do not roll it yet, so not one token can be generated; shorten the prompt to "
                             f"at most {window - 1} tokens (room for {window} tokens in all, prompt included), or "
                             f"generate with the single-device transformers model, whose cache rolls")
        raise InputError(f"generate: the prompt ({prompt}) plus new tokens ({config.max_length} in all) exceed the "
                         f"model's sliding attention window of {window} tokens, beyond which its cache rolls; the "
                         f"parallel model's graphs do not roll it yet: lower max_new_tokens to at most "
                         f"{window - prompt}")
    limit = model.position_limit
    if limit is not None and config.max_length > limit:
        if prompt >= limit:
            raise InputError(f"generate: the prompt alone fills the model's learned positions: {prompt} tokens, "
                             f"{limit} positions (max_position_embeddings), so not one token can be generated; "
                             f"shorten the prompt to at most {limit - 1} tokens (the model has no position for "
                             f"more, on one device either)")
        raise InputError(f"generate: the prompt ({prompt}) plus new tokens reach position {config.max_length - 1}, "
                         f"beyond the model's {limit} learned positions (max_position_embeddings): lower "
                         f"max_new_tokens to at most {limit - prompt}")

    processors = model._get_logits_processor(config, input_ids_seq_length=prompt, device=device,
                                             logits_processor=logits_processor or LogitsProcessorList(),
                                             model_kwargs={})
    criteria = model._get_stopping_criteria(config, stopping_criteria or StoppingCriteriaList(), tokenizer=tokenizer)
    sample = config.do_sample
    generator = None
    if sample:  # one seed for every rank: the same draws everywhere
        seed = torch.randint(0, 2 ** 62, (1,), dtype=torch.int64, device=device)  # the group's device (NCCL: CUDA)
        if model.tp_group.process_group is not None and model.tp_group.size > 1:
            dist.broadcast(seed, src=dist.get_global_rank(model.tp_group.process_group, 0),
                           group=model.tp_group.process_group)
        generator = torch.Generator(device=device).manual_seed(int(seed))

    # decode steps (one token per row: the same shapes every step) run compiled where the caller asks
    # (``compile_config``), as transformers compiles its decode forward; the prefill stays eager
    compile_config = None if config.disable_compile else config.compile_config
    length = cache_length(config.max_length)
    cache = ParallelCache(length) if compile_config is None else _compiled_steps_cache(model, length, batch)
    # the mask spans the cache: slots not written yet are masked, as transformers masks a static cache's
    # (a causal mask hides them anyway; an encoder used as a decoder, RoBERTa-style, would attend to them)
    full_mask = torch.cat([mask, mask.new_zeros(batch, cache.length - prompt)], dim=1)
    positions = _positions(mask)
    pad = config.pad_token_id if config.pad_token_id is not None else 0
    unfinished = torch.ones(batch, dtype=torch.bool, device=device)
    sequences, scores_seen = input_ids, []
    first_rank = model.tp_group.rank == 0
    if streamer is not None and first_rank:
        streamer.put(input_ids.cpu())
    step_ids, step_positions = input_ids, positions
    with torch.no_grad():
        while True:
            # a model without position_ids (BART's decoder, BLOOM's ALiBi) counts positions in its cache, as in
            # transformers' generate
            given = {"position_ids": step_positions} if model.takes_position_ids else {}
            prefill = step_ids.shape[1] > 1
            if prefill and model.takes_logits_to_keep:  # the last position's logits only, as transformers' prefill
                given["logits_to_keep"] = 1
            out = model.forward(input_ids=step_ids, attention_mask=full_mask, past_key_values=cache, use_cache=True,
                                gather_logits=False, check_inputs=False,
                                compile_config=None if prefill else compile_config, **given)
            local = out.local_logits if out.local_logits is not None else out.logits
            # a copy: under CUDA graphs the logits are the graph's output buffer, which the next step overwrites
            # (and output_scores keeps them)
            local = local[:, -1, :].to(torch.float32, copy=True)
            start = out.vocab_range[0] if out.vocab_range is not None else 0
            top_k = _vocab_parallel_top_k(processors, sample, config)
            if top_k is not None:
                scores, ids = top_k_candidates(local, start, top_k, model.tp_group)
                probs = torch.softmax(processors(sequences, scores), dim=-1)
                chosen = ids.gather(1, torch.multinomial(probs, 1, generator=generator)).squeeze(1)
            elif len(processors) or sample or config.output_scores:
                sizes = model.output_sizes("logits")
                scores = processors(sequences, full_scores(local, sizes, model.tp_group))
                if config.output_scores:
                    scores_seen.append(scores)
                if sample:
                    probs = torch.softmax(scores, dim=-1)
                    chosen = torch.multinomial(probs, 1, generator=generator).squeeze(1)
                else:
                    chosen = scores.argmax(dim=-1)
            else:
                chosen = vocab_parallel_argmax(local, start, model.tp_group)
            chosen = torch.where(unfinished, chosen, torch.full_like(chosen, pad))
            sequences = torch.cat([sequences, chosen[:, None]], dim=1)
            if streamer is not None and first_rank:
                streamer.put(chosen.cpu())
            unfinished &= ~criteria(sequences, None)
            if not bool(unfinished.any()):
                break
            step_ids = chosen[:, None]
            full_mask[:, sequences.shape[1] - 1] = 1  # the slot the next step writes: the chosen token's
            step_positions = step_positions[:, -1:] + 1
    if streamer is not None and first_rank:
        streamer.end()
    if config.return_dict_in_generate:
        return GenerateDecoderOnlyOutput(sequences=sequences, scores=tuple(scores_seen) if config.output_scores
                                         else None, **{_cache_field(GenerateDecoderOnlyOutput): cache})
    return sequences
