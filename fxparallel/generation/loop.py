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
per token or prompt length. Without a cache (``use_cache=False``, or a cache the graphs cannot carry), each
step recomputes the sequence (``recompute.py``).

The call in phases: validate (``_validated``: this rank's checks, the ranks' exchange, the lengths), prepare
(``_prepared``: transformers' processors and criteria, the sampling generator, the cache), then the loop
(``_decode``), one ``_step`` (a forward through the graphs, the cache written) and one ``_select`` (the next
token) per token. transformers' private helpers are called through ``transformers_private.py`` only.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Any, Optional

import torch
import torch.distributed as dist

from ..errors import CacheNotCarried, InputError
from ..group import uses_nccl
from ..inputs import ranks_named
from ..load.coordinate import exchange
from ..trl_grpo import refuse_batch_statistics
from . import forward_peers, recompute, transformers_private as hf_private
from .parallel_cache import ParallelCache, cache_length
from .select import full_scores, top_k_candidates, vocab_parallel_argmax

SUPPORTED_MODES = ("greedy_search", "sample")


@dataclass
class _Request:
    """One call's arguments, checked and agreed on by every rank (``_validated``)."""
    config: Any  # transformers' GenerationConfig: this call's copy, completed (special tokens, max / min length)
    input_ids: torch.Tensor  # [rows, prompt] on the model's device: a row per sequence returned
    mask: torch.Tensor  # the attention mask, long, shaped as input_ids
    logits_processor: Any  # the caller's (None: none given)
    stopping_criteria: Any  # the caller's (None: none given)
    tokenizer: Any  # for stop_strings


@dataclass
class _Decoding:
    """One generation's state (``_prepared``), as the loop advances it."""
    config: Any
    processors: Any  # transformers' LogitsProcessorList, the caller's merged in
    criteria: Any  # transformers' StoppingCriteriaList, the caller's merged in
    generator: Optional[torch.Generator]  # sampling: seeded alike on every rank; greedy: None
    compile_config: Any  # the decode steps' (None: eager)
    cache: Optional[ParallelCache]  # None: each step recomputes the sequence (recompute.py)
    full_mask: torch.Tensor  # [rows, cache (or padded) length]: the prompt's mask, then a 1 for each slot written
    positions: torch.Tensor  # the prompt's position ids
    pad: Optional[torch.Tensor]  # the token appended to the rows that have stopped (None: the chosen one)
    unfinished: torch.Tensor  # [rows] bool
    sequences: torch.Tensor  # [rows, tokens so far]: the prompt, then the chosen tokens
    streamer: Any  # the caller's on tp rank 0 (one rank streams), None elsewhere
    peers: Any  # the data-parallel group whose forwards pair up with this rank's (forward_peers.py), or None
    scores_seen: list = field(default_factory=list)  # output_scores: each step's processed scores


def generate(model, input_ids: torch.Tensor, attention_mask=None, generation_config=None, streamer=None,
             logits_processor=None, stopping_criteria=None, **kwargs):
    """transformers' generate, greedy search and sampling, on the parallel model (see the module docstring):
    validate, prepare, then decode."""
    tokenizer = kwargs.pop("tokenizer", None)  # transformers' argument for stop_strings (pipelines pass it)
    refused = decoding = None
    peers = forward_peers.peers_of(model)
    try:
        request = _validated(model, input_ids, attention_mask, generation_config, logits_processor,
                             stopping_criteria, tokenizer, kwargs)
        decoding = _prepared(model, request, streamer, peers)
    except Exception as err:  # noqa: BLE001 - raised by forward_peers.agree, once the data-parallel peers know
        refused = err
    forward_peers.agree(peers, refused)
    try:
        _decode(model, decoding)
    finally:
        forward_peers.reshard(model)
    return _result(decoding)


# ---- validate: refusals before the seed broadcast, the cache and any forward --------------------------------
def _validated(model, input_ids, attention_mask, generation_config, logits_processor, stopping_criteria, tokenizer,
               kwargs) -> _Request:
    """The call checked on this rank and agreed on by every rank (``_agreed``), its config completed for the
    prompt (special tokens, max / min length), and the lengths that do not fit refused."""
    config, input_ids, mask, user_max_length = _agreed(model, input_ids, attention_mask, generation_config,
                                                       logits_processor, stopping_criteria, kwargs)
    if (config.num_return_sequences or 1) > 1:  # sampling: each prompt's rows drawn independently, as in transformers
        input_ids = input_ids.repeat_interleave(config.num_return_sequences, dim=0)
        mask = mask.repeat_interleave(config.num_return_sequences, dim=0)
    prompt = input_ids.shape[1]
    hf_private.prepare_special_tokens(model, config, attention_mask is not None, model.device_)
    _set_lengths(config, prompt, user_max_length)
    _refuse_no_room(model, config.max_length, prompt)
    return _Request(config, input_ids, mask, logits_processor, stopping_criteria, tokenizer)


def _agreed(model, input_ids, attention_mask, generation_config, logits_processor, stopping_criteria, kwargs):
    """(config, input_ids, mask, the max_length the caller gave): ``_checked_arguments``, once every rank has
    compared its arguments. This rank's own checks raise only in the exchange (every rank raises then), so that
    an argument given to one rank only never leaves the others waiting."""
    refused, text = None, ""
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
    return config, input_ids, mask, user_max_length


def _checked_arguments(model, input_ids, attention_mask, generation_config, kwargs):
    """This rank's generate arguments, checked: (generation config, input_ids and attention mask on the model's
    device, the max_length the caller gave). Raises what is refused (a mode, an argument, a shape)."""
    if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2:
        got = (f"shape {tuple(input_ids.shape)}" if isinstance(input_ids, torch.Tensor) else
               type(input_ids).__name__)
        raise InputError(f"generate needs input_ids of shape [batch, prompt length], got {got}")
    if model.cp_group is not None:
        raise InputError("generate is not supported under context parallelism (cp_group): parallelize without it")
    refuse_batch_statistics(model.tp_group.size)  # TRL's GRPOTrainer (trl_grpo.py)
    user_max_length = kwargs.get("max_length")
    config, model_kwargs = hf_private.prepare_generation_config(model, generation_config, kwargs)
    mode = config.get_generation_mode()
    mode = str(mode.value if hasattr(mode, "value") else mode)
    if mode not in SUPPORTED_MODES:
        raise InputError(f"generate: {mode} is not supported on the parallel model (num_beams="
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


def _same_on_every_rank(model, what: str, text: str, refused=None) -> None:
    """Refuse arguments that differ between the tp ranks (they would desynchronize the loop and hang), and
    raise on every rank an error one rank's own checks raised (``refused``): that rank raises its own, the others
    one naming it. Every rank takes part in the exchange before anything is raised, so an argument given to one
    rank only never leaves the others waiting in a collective; the exchange runs through the store with a
    bounded wait (load/coordinate.py), so neither does a generate called on some ranks only."""
    group = model.tp_group
    if group.process_group is None or group.size == 1:
        if refused is not None:
            raise refused
        return
    rows = exchange(group.process_group, [refused is not None, hashlib.sha256(text.encode()).hexdigest()[:16]],
                    "generate", step="generate")
    if refused is not None:
        raise refused
    failed = [r for r, (bad, _) in enumerate(rows) if bad]
    if failed:
        where = "that rank" if len(failed) == 1 else "those ranks"
        raise InputError(f"generate: the arguments of {ranks_named(failed)} were refused (see the error on {where}); "
                         f"every tp rank must call generate with the same prompts and generation arguments")
    differ = [r for r, row in enumerate(rows) if row != rows[0]]
    if differ:
        raise InputError(f"generate: the tp ranks were given different {what} (rank 0 vs ranks {differ}); every tp "
                         f"rank must call generate with the same prompts and generation arguments")


def _described(config) -> str:
    """The generation config as text that is the same on every rank for the same arguments (a function in it,
    e.g. a compile backend, by its name: its address differs between processes)."""
    import json

    return json.dumps(config.to_dict(), sort_keys=True, default=lambda o: getattr(o, "__qualname__", type(o).__name__))


def _set_lengths(config, prompt: int, user_max_length) -> None:
    """max_length and min_length in tokens, prompt included, as transformers sets them (20 new tokens by
    default)."""
    if config.max_new_tokens is not None:
        config.max_length = prompt + config.max_new_tokens
    elif user_max_length is None and config.max_length is None:
        config.max_length = prompt + 20
    if config.min_new_tokens is not None:
        config.min_length = prompt + config.min_new_tokens


def _refuse_no_room(model, max_length: int, prompt: int) -> None:
    """Refuse a max_length with no room after the prompt, or past the model's learned positions."""
    if max_length <= prompt:
        raise InputError(f"generate: max_length {max_length} leaves no room after the prompt of {prompt} "
                         f"tokens: raise max_new_tokens / max_length")
    limit = model.position_limit
    if limit is not None and max_length > limit:
        if prompt >= limit:
            raise InputError(f"generate: the prompt alone fills the model's learned positions: {prompt} tokens, "
                             f"{limit} positions (max_position_embeddings), so not one token can be generated; "
                             f"shorten the prompt to at most {limit - 1} tokens (the model has no position for "
                             f"more, on one device either)")
        raise InputError(f"generate: the prompt ({prompt}) plus new tokens reach position {max_length - 1}, "
                         f"beyond the model's {limit} learned positions (max_position_embeddings): lower "
                         f"max_new_tokens to at most {limit - prompt}")


# ---- prepare ------------------------------------------------------------------------------------------------
def _prepared(model, request: _Request, streamer, peers) -> _Decoding:
    """transformers' logits processors and stopping criteria, the sampling generator, the cache and its mask."""
    from transformers.generation import LogitsProcessorList, StoppingCriteriaList

    config, input_ids, mask = request.config, request.input_ids, request.mask
    device = model.device_
    batch, prompt = input_ids.shape
    refused = cuda_graphs_refusal(None if config.disable_compile else config.compile_config, device.type,
                                  model.tp_group.size, uses_nccl(model.tp_group))
    if refused:
        raise InputError(refused)
    if peers is not None and config.compile_config is not None and not config.disable_compile:
        raise InputError("generate: compile_config under FSDP or with experts spread over data-parallel ranks is not "
                         "supported yet (a compiled step would trace FSDP's all-gathers or the experts' exchanges): "
                         "generate without it, or from a model without apply_data_parallel / ep_group")
    processors = hf_private.logits_processors(model, config, prompt, device,
                                              request.logits_processor or LogitsProcessorList())
    criteria = hf_private.stopping_criteria(model, config, request.stopping_criteria or StoppingCriteriaList(),
                                            request.tokenizer)
    generator = _shared_generator(model) if config.do_sample else None
    compile_config, cache = _steps_cache(model, config, batch)
    # the mask spans the cache: slots not written yet are masked, as transformers masks a static cache's
    # (a causal mask hides them anyway; an encoder used as a decoder, RoBERTa-style, would attend to them)
    length = cache.length if cache is not None else recompute.sequence_length(model, config.max_length)
    full_mask = torch.cat([mask, mask.new_zeros(batch, length - prompt)], dim=1)
    return _Decoding(config=config, processors=processors, criteria=criteria, generator=generator,
                     compile_config=compile_config, cache=cache, full_mask=full_mask, positions=_positions(mask),
                     pad=hf_private.pad_token(config),
                     unfinished=torch.ones(batch, dtype=torch.bool, device=device), sequences=input_ids,
                     streamer=streamer if model.tp_group.rank == 0 else None, peers=peers)


def _shared_generator(model) -> torch.Generator:
    """Sampling's generator, seeded alike on every rank (rank 0's seed, broadcast): the same draws everywhere,
    without the caller seeding anything."""
    device = model.device_
    seed = torch.randint(0, 2 ** 62, (1,), dtype=torch.int64, device=device)  # the group's device (NCCL: CUDA)
    if model.tp_group.process_group is not None and model.tp_group.size > 1:
        dist.broadcast(seed, src=dist.get_global_rank(model.tp_group.process_group, 0),
                       group=model.tp_group.process_group)
    # the tp ranks are one device: their global generators go on alike after a sampling generate (TRL's
    # GRPOTrainer, seeded per process, shuffles the completions it sampled with them before the model sees them)
    torch.manual_seed(int(seed) + 1)
    return torch.Generator(device=device).manual_seed(int(seed))


def cuda_graphs_refusal(compile_config, device_type: str, tp: int, nccl: bool) -> Optional[str]:
    """Why decode steps compiled with ``compile_config`` cannot run on this group, else None. CUDA graphs
    (inductor's modes "reduce-overhead" and "max-autotune", or its ``triton.cudagraphs`` option) record the
    step's collectives; NCCL's can be recorded, gloo's on CUDA tensors (``"cuda:gloo"``, staged through the
    host with waits) cannot: the capture fails inside the first compiled step. Pure."""
    if compile_config is None or device_type != "cuda" or tp == 1 or nccl:
        return None
    mode = getattr(compile_config, "mode", None)
    if mode not in ("reduce-overhead", "max-autotune") and not (getattr(compile_config, "options", None)
                                                                 or {}).get("triton.cudagraphs"):
        return None
    return (f"generate: compile_config (mode={mode!r}) records the decode steps as CUDA graphs, which cannot hold "
            f"the collectives of this tp group of {tp} ranks: its CUDA tensors go over gloo, not NCCL. Use an NCCL "
            f"group, or compile without CUDA graphs (mode='default')")


def _steps_cache(model, config, batch: int):
    """(the decode steps' compile_config, the generation's cache). The decode steps (one token per row: the same
    shapes every step) run compiled where the caller asks (``compile_config``), as transformers compiles its
    decode forward; the prefill stays eager. No cache where the caller asks for none (``use_cache=False``) or
    an earlier call found the graphs cannot carry it."""
    compile_config = None if config.disable_compile else config.compile_config
    if not config.use_cache:
        recompute.refuse_extra_inputs(model, "use_cache=False")
        return compile_config, None
    if model._graph_set.cache_refused is not None:  # found by an earlier generation (said then)
        recompute.without_cache(model, model._graph_set.cache_refused)
        return compile_config, None
    length = cache_length(config.max_length)
    cache = ParallelCache(length) if compile_config is None else _compiled_steps_cache(model, length, batch)
    return compile_config, cache


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


def _positions(mask: torch.Tensor) -> torch.Tensor:
    """transformers' position ids for left padding: the count of real tokens before each one."""
    positions = mask.long().cumsum(-1) - 1
    return positions.masked_fill(mask == 0, 1)


# ---- the loop: a step and a selection per token -------------------------------------------------------------
RUN_AHEAD_DEVICES = ("cuda",)  # where a step is queued before the host reads whether the last one stopped


def _decode(model, decoding: _Decoding) -> None:
    """The prompt's step (prefill), then one step per token, each followed by the selection of the next token,
    until the stopping criteria have stopped every row. Where ``_runs_ahead``, the host queues each decode step
    before it reads whether the previous one stopped every row (``_StopFlag``), so that on a GPU the host's work
    for a step overlaps the GPU's for the one before instead of waiting for it; a step queued after the last is
    dropped (nothing of it is kept or returned). Where a forward talks to data-parallel ranks (FSDP, experts
    spread over them), until every one of them has stopped (``forward_peers.py``)."""
    if decoding.streamer is not None:
        decoding.streamer.put(decoding.sequences.cpu())
    step_ids, step_positions = decoding.sequences, decoding.positions
    peers = decoding.peers
    ahead = peers is None and _runs_ahead(model, decoding)
    flag = _StopFlag(model.device_ if ahead else None)
    waiting = None
    with torch.no_grad():
        local, start = _step(model, decoding, step_ids, step_positions)  # the prefill
        chosen = _appended(decoding, _select(model, decoding, local, start))
        decoded = 0
        while True:
            # not ahead of the first decode step (its capture may find the cache cannot be carried), nor past
            # max_length (the stopping criteria always stop there: no room in the cache for another step)
            ahead_now = ahead and decoded > 0 and decoding.sequences.shape[1] < decoding.config.max_length
            flag.start(decoding.unfinished)
            going = ahead_now or flag.read()
            if not (going if peers is None else forward_peers.any_generating(peers, going, model.device_)):
                break
            if waiting is None:
                step_ids = chosen[:, None]
                # the slot the next step writes: the chosen token's
                decoding.full_mask[:, decoding.sequences.shape[1] - 1] = 1
                step_positions = step_positions[:, -1:] + 1
            if not going:  # stopped, while a data-parallel peer still generates: this step again, logits dropped
                waiting = waiting or forward_peers.Waiting(decoding.cache, decoding.config.return_dict_in_generate)
                waiting.rewind(decoding.cache)
                _step(model, decoding, step_ids, step_positions)
                continue
            local, start = _step(model, decoding, step_ids, step_positions)
            picked = _select(model, decoding, local, start)
            if ahead_now and not flag.read():  # every row had stopped: this step is the one after the last
                break
            chosen = _appended(decoding, picked)
            decoded += 1
    if waiting is not None:
        waiting.restore()
    if decoding.streamer is not None:
        decoding.streamer.end()


# transformers' processors and warpers that keep no state between calls (their scores a function of the
# sequences and the scores alone), so that calling them on a step that is dropped leaves no trace; the bias of
# SequenceBias / NoBadWords is prepared once, at the first call (the prompt's step, never a dropped one)
PURE_PROCESSORS = (
    "RepetitionPenaltyLogitsProcessor", "NoRepeatNGramLogitsProcessor", "MinLengthLogitsProcessor",
    "MinNewTokensLengthLogitsProcessor", "NoBadWordsLogitsProcessor", "SequenceBiasLogitsProcessor",
    "SuppressTokensLogitsProcessor", "SuppressTokensAtBeginLogitsProcessor", "ForcedBOSTokenLogitsProcessor",
    "ForcedEOSTokenLogitsProcessor", "InfNanRemoveLogitsProcessor", "ExponentialDecayLengthPenalty",
    "TemperatureLogitsWarper", "TopKLogitsWarper", "TopPLogitsWarper", "MinPLogitsWarper", "TypicalLogitsWarper",
    "EpsilonLogitsWarper", "EtaLogitsWarper")


def _runs_ahead(model, decoding: _Decoding) -> bool:
    """Whether a decode step may be queued before the host knows the previous one stopped every row: on a device
    that runs asynchronously, with a cache, where a step after the last leaves no trace: its processors are
    transformers' stateless ones (``PURE_PROCESSORS``; a sampling draw comes from this call's own generator,
    discarded at its end), and nothing of the steps is returned but the sequences (not the cache, which the
    dropped step writes past the end, nor scores). The same on every rank (the config is agreed, the processors
    made from it), so every rank runs the same collectives."""
    from transformers.generation import logits_process

    pure = tuple(getattr(logits_process, name) for name in PURE_PROCESSORS)
    return (model.device_.type in RUN_AHEAD_DEVICES and decoding.cache is not None
            and not decoding.config.return_dict_in_generate and all(type(p) in pure for p in decoding.processors))


class _StopFlag:
    """Whether any row is unfinished, read on the host: started after a step's selection, read at once or after
    the next step is queued. On CUDA the read waits for the step that computed it only (a non-blocking copy
    into pinned memory, and its event), not for the steps queued after it."""

    def __init__(self, device: Optional[torch.device]):
        cuda = device is not None and device.type == "cuda"
        self._host = torch.empty((), dtype=torch.bool, device="cpu", pin_memory=True) if cuda else None
        self._event = torch.cuda.Event() if cuda else None
        self._value = None

    def start(self, unfinished: torch.Tensor) -> None:
        self._value = unfinished.any()
        if self._host is not None:
            self._host.copy_(self._value, non_blocking=True)
            self._event.record()

    def read(self) -> bool:
        if self._host is None:
            return bool(self._value)
        self._event.synchronize()
        return bool(self._host)


def _step(model, decoding: _Decoding, step_ids: torch.Tensor, step_positions: torch.Tensor):
    """One forward through the captured graphs: (this rank's vocabulary slice of the last position's logits
    [rows, local vocab], float32, the first vocabulary id of the slice). With a cache, the new tokens' forward,
    writing it; without one (or once a step's capture finds it cannot be carried), the sequence's
    (``recompute.py``)."""
    first = decoding.sequences.shape[1] == step_ids.shape[1]
    if decoding.cache is not None:
        try:
            return _cached_step(model, decoding, step_ids, step_positions)
        except CacheNotCarried as refused:  # a step's capture: the sequence so far is all the next steps need
            recompute.fall_back(model, refused)
            decoding.cache = None
            decoding.full_mask = decoding.full_mask[:, :recompute.sequence_length(model, decoding.config.max_length)]
    return recompute.step_logits(model, decoding.sequences, decoding.full_mask, _positions,
                                 None if first else decoding.compile_config)


def _cached_step(model, decoding: _Decoding, step_ids: torch.Tensor, step_positions: torch.Tensor):
    """``_step`` with the cache: the forward of the new tokens, writing the cache."""
    # a model without position_ids (BART's decoder, BLOOM's ALiBi) counts positions in its cache, as in
    # transformers' generate
    given = {"position_ids": step_positions} if model.takes_position_ids else {}
    prefill = step_ids.shape[1] > 1
    if prefill and model.takes_logits_to_keep:  # the last position's logits only, as transformers' prefill
        given["logits_to_keep"] = 1
    if model.takes_router_logits:  # tokens need no router logits, whatever the config says
        given["output_router_logits"] = False
    # called, not .forward: FSDP's hooks gather the root's parameters, and hooks on the model run, as transformers
    # calls the model in its generate
    out = model(input_ids=step_ids, attention_mask=decoding.full_mask, past_key_values=decoding.cache,
                use_cache=True, gather_logits=False, check_inputs=False,
                compile_config=None if prefill else decoding.compile_config, **given)
    local = out.local_logits if out.local_logits is not None else out.logits
    # a copy: under CUDA graphs the logits are the graph's output buffer, which the next step overwrites
    # (and output_scores keeps them)
    local = local[:, -1, :].to(torch.float32, copy=True)
    start = out.vocab_range[0] if out.vocab_range is not None else 0
    return local, start


def _select(model, decoding: _Decoding, local: torch.Tensor, start: int) -> torch.Tensor:
    """Each row's next token ([rows] global ids) from the vocab-sharded logits: from each rank's top k where
    sampling needs no more, from the whole row where transformers' processors, sampling or output_scores need it
    (output_scores: the processed scores kept), else greedy without a gather."""
    processors, sequences, config = decoding.processors, decoding.sequences, decoding.config
    sample = config.do_sample
    top_k = _vocab_parallel_top_k(processors, sample, config)
    if top_k is not None:
        scores, ids = top_k_candidates(local, start, top_k, model.tp_group)
        probs = torch.softmax(processors(sequences, scores), dim=-1)
        return ids.gather(1, torch.multinomial(probs, 1, generator=decoding.generator)).squeeze(1)
    if len(processors) or sample or config.output_scores:
        sizes = model.output_sizes("logits")
        scores = processors(sequences, full_scores(local, sizes, model.tp_group))
        if config.output_scores:
            decoding.scores_seen.append(scores)
        if sample:
            probs = torch.softmax(scores, dim=-1)
            return torch.multinomial(probs, 1, generator=decoding.generator).squeeze(1)
        return scores.argmax(dim=-1)
    return vocab_parallel_argmax(local, start, model.tp_group)


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


def _appended(decoding: _Decoding, chosen: torch.Tensor) -> torch.Tensor:
    """The chosen tokens appended to the sequences (the pad token in rows that had stopped) and streamed, and
    the rows the stopping criteria stop now marked finished; returns the tokens appended."""
    if decoding.pad is not None:
        chosen = torch.where(decoding.unfinished, chosen, decoding.pad.to(chosen.dtype))
    decoding.sequences = torch.cat([decoding.sequences, chosen[:, None]], dim=1)
    if decoding.streamer is not None:
        decoding.streamer.put(chosen.cpu())
    decoding.unfinished &= ~decoding.criteria(decoding.sequences, None)
    return chosen


def _result(decoding: _Decoding):
    """The sequences, or transformers' output class (return_dict_in_generate) with the scores and the cache."""
    from transformers.generation import GenerateDecoderOnlyOutput

    config = decoding.config
    if config.return_dict_in_generate:
        return GenerateDecoderOnlyOutput(sequences=decoding.sequences, scores=tuple(decoding.scores_seen)
                                         if config.output_scores else None,
                                         **{_cache_field(GenerateDecoderOnlyOutput): decoding.cache})
    return decoding.sequences


def _cache_field(output_class) -> str:
    """The field of a transformers output class that holds the KV cache: ``cache`` from transformers 5.24 on
    (the old name then logs a deprecation warning), ``past_key_values`` before."""
    return "cache" if "cache" in output_class.__dataclass_fields__ else "past_key_values"
