"""Capture the whole forward (and loss) as one FX graph with torch.compile(fullgraph=True).

The model is on the meta device, so nothing is computed: our backend only keeps
the graph Dynamo hands it. Batch and sequence dimensions are marked dynamic, so
one graph serves every shape that satisfies the recorded shape guards.
"""
from __future__ import annotations

import contextlib
import logging
import re
import types

import sympy
import torch
import torch._dynamo

from ..errors import CacheNotCarried, CaptureError, PromptLengthFixed
from .generation_inputs import decodes_without_mask
from .static_cache import (argument_name, cache_argument, cache_tensors, keeps_states, meta_cache, set_fresh,
                           state_not_carried)
from .causal_mask import causal_without_mask
from .custom_forwards import inline_custom_forwards
from .dropout_sites import check_training_graph
from .expert_counts import Collector, install_counters
from .router_logits import install_output_recorders, takes_router_logits
from .adapters import hf_name
from .graph import CapturedGraph
from .spec import GraphSpec

log = logging.getLogger("fxparallel")

def _forward_fn(model, spec: GraphSpec, cache=None, unpadded: bool = False):
    output_names, logits_to_keep = spec.outputs, spec.logits_to_keep
    labels_shifted = spec.labels_shifted and "labels" in spec.arguments
    # asked for explicitly either way: a config with output_router_logits=True must not add the term unasked
    router = {"output_router_logits": spec.router_logits} if takes_router_logits(model) else {}
    # a fresh cache's forward (the prompt's) on a model with recurrent states: the mask given spans the cache,
    # the model's is the prompt's, as transformers' first forward gets it (its recurrent layers take the mask's
    # last positions as the tokens'); the slots after the prompt are not written yet, so attention loses nothing
    prompt_mask = cache is not None and spec.fresh_cache
    no_mask = cache is not None and not spec.fresh_cache and not spec.token_mask and spec.shape[1] == 1 and \
        decodes_without_mask(model, cache, spec.shape[0], spec.cache_length)

    def run(**kwargs):
        if spec.expert_counts:  # the experts modules' counting hooks append to it (capture/expert_counts.py)
            Collector.counts = []
        if unpadded:  # the mask is as long as the tokens (inputs.py), so the queries are all the keys
            torch._check(kwargs["attention_mask"].shape[-1] == kwargs["input_ids"].shape[-1])
        if logits_to_keep:  # the logits of the last positions only (the model slices before its head)
            kwargs["logits_to_keep"] = logits_to_keep
        if labels_shifted:  # context parallelism: the loss takes labels as given (transformers' shift_labels)
            kwargs["shift_labels"] = kwargs["labels"]
        if no_mask:  # read by no op: the graph takes no mask (ops/local_graph.py)
            kwargs.pop("attention_mask", None)
        if prompt_mask and "attention_mask" in kwargs:
            kwargs["attention_mask"] = kwargs["attention_mask"][:, :kwargs["input_ids"].shape[1]]
        if cache is not None:
            out = model(**kwargs, **cache_argument(model, cache), **router, use_cache=True, return_dict=True)
        else:
            out = model(**kwargs, **router, use_cache=False, return_dict=True)
        counts = None
        if spec.expert_counts:
            counts, Collector.counts = torch.stack(Collector.counts), None
        return tuple(counts if name == "tokens_per_expert" else _output(out, name) for name in output_names)

    # A fresh code object per capture: Dynamo caches by code object, so this capture
    # neither reuses nor evicts anything else (no torch._dynamo.reset() needed).
    return types.FunctionType(run.__code__.replace(), run.__globals__, "fxparallel_capture", None, run.__closure__)


def _output(out, name: str):
    if name == "router_logits":  # one tensor per MoE layer, all [tokens, experts]: one graph output
        return torch.stack(out.router_logits)
    return getattr(out, name)


def _logging_functions() -> set:
    """Logger methods Dynamo may treat as no-ops: models warn from inside forward (e.g. about
    ignored arguments); that must not break the graph."""
    names = ("debug", "info", "warning", "warn", "error", "warning_once", "info_once", "warning_advice")
    found = {getattr(logging.Logger, n) for n in names if hasattr(logging.Logger, n)}
    return set(torch._dynamo.config.ignore_logging_functions) | found


def _dynamo_message(err: Exception) -> str:
    text = str(err)
    lines = [ln for ln in text.splitlines() if ln.strip()]
    keep = []
    for ln in lines:
        if ln.startswith("  File ") or "Explanation" in ln or "Hint" in ln or not keep:
            keep.append(ln.strip())
        if len(keep) >= 8:
            break
    # the innermost user frame names the source line that broke the graph
    frames = re.findall(r'File "([^"]+)", line (\d+), in (\w+)', text)
    where = f" (at {frames[-1][0]}:{frames[-1][1]} in {frames[-1][2]})" if frames else ""
    return " | ".join(keep) + where


def capture(model, spec: GraphSpec, device: str = "meta") -> CapturedGraph:
    """Capture ``model(**inputs)`` for ``spec`` (``spec.py``: the arguments, example shape and options);
    returns the graph and its bindings.

    Dimensions of ``spec.shape`` larger than 1 are dynamic; a size of 1 is captured as such
    (Dynamo specializes sizes 0 and 1), so decoding with one token gets its own graph.
    ``labels_shifted``: the labels are already shifted by one (context parallelism), so
    they are passed to the model as ``shift_labels`` too and its loss does not shift them.
    ``cache_length``: capture with a static KV cache of that many tokens (``cache.py``): its
    tensors become arguments (``past_<layer>_<field>``), the attention mask spans the cache.
    ``logits_to_keep``: passed to the model (transformers' argument): logits of the last that many
    positions only (0: all), as ``generate``'s prefill needs. ``unpadded``: the attention mask given holds
    no padding (all ones, checked per call), so attention is plain causal as without one (``causal_mask.py``).
    """
    guards_log = logging.getLogger("torch._guards")
    level = guards_log.level
    # Dynamo logs a failed attempt's frames at error level: a retry below is what counts
    guards_log.setLevel(logging.CRITICAL)
    try:
        return _capture_reading_length(model, spec, device, (0, 1))
    except CaptureError as err:
        fixed = _fixed_dim(str(err), spec.shape, spec.cache_length)
        if fixed is None:
            raise
    finally:
        guards_log.setLevel(level)
    if fixed == 1 and spec.cache_length is not None and (
            keeps_states(model.config) or one_token_prompts(model, spec.shape[0], spec.cache_length)):
        raise PromptLengthFixed(f"{type(model).__name__}: its code fixes the number of tokens of a forward with a "
                                f"cache ({spec.shape[1]} here); such forwards run one token at a time")
    # the model's code fixes a size (a cache's batch; a loop over the tokens, RWKV / RecurrentGemma / CPM-Ant, or
    # Mamba's scan at some prompt lengths):
    # Dynamo cannot keep it symbolic, so that size gets a graph of its own
    log.info("%s: its code fixes the %s; capturing for %d", type(model).__name__, ("batch", "sequence length")[fixed],
             spec.shape[fixed])
    return _capture_reading_length(model, spec, device, tuple(d for d in (0, 1) if d != fixed))


def _capture_reading_length(model, spec: GraphSpec, device, dynamic_dims: tuple) -> CapturedGraph:
    """``_capture``, and where a cache's capture fails on a size Dynamo cannot know from data, again with the
    cache's length given as an int (``static_cache._length_read_as_int``: TrOCR, RoFormer and MVP build their
    positions as ``torch.arange(length, length + tokens)``); where that fails too, the first refusal stands."""
    try:
        return _capture(model, spec, device, dynamic_dims)
    except CacheNotCarried as err:
        if not _size_unknown_from_data(err):
            raise
        try:
            captured = _capture(model, spec, device, dynamic_dims, length_as_int=True)
        except CaptureError as again:
            if _fixed_dim(str(again), spec.shape, spec.cache_length) is not None:
                raise  # a size the model's code fixes: ``capture`` captures for it
            log.debug("%s: captured again with the cache's length as an int, which failed too: %s",
                      type(model).__name__, again)
            raise err from err.__cause__
        log.debug("%s: captured with the cache's length read as an int", type(model).__name__)
        return captured


def _size_unknown_from_data(err: Exception) -> bool:
    """Did the capture fail on a size computed from data Dynamo could not relate to the others, or on a branch
    on such a value (``PendingUnbackedSymbolNotFound``, ``GuardOnDataDependentSymNode``: in the exception's chain or
    named in its message)?"""
    from torch.fx.experimental.symbolic_shapes import GuardOnDataDependentSymNode, PendingUnbackedSymbolNotFound

    seen, steps = err, 0
    while seen is not None and steps < 16:
        if isinstance(seen, (PendingUnbackedSymbolNotFound, GuardOnDataDependentSymNode)) or any(
                text in str(seen) for text in ("Pending unbacked symbols", "Could not guard on data-dependent")):
            return True
        seen, steps = seen.__cause__ or seen.__context__, steps + 1
    return False


def one_token_prompts(model, batch: int = 2, cache_length: int = 16) -> bool:
    """Can a forward of several tokens with a cache run one token at a time, each given its own column of the
    attention mask (``GraphSpec.token_mask``)? Where the model's layers need no mask over the cache: its forward
    takes none (xLSTM), or transformers' generate leaves it out of a decode step (Mamba: the mask only zeroes
    padding tokens, its own)."""
    import inspect

    if "attention_mask" not in inspect.signature(type(model).forward).parameters:
        return True
    try:
        cache = meta_cache(model, batch, cache_length)
    except Exception:  # noqa: BLE001 - a cache it cannot have (CacheNotCarried, a layer type without one): no
        return False
    return decodes_without_mask(model, cache, batch, cache_length)


def _fixed_dim(message: str, shape, cache_length):
    """The argument dim Dynamo reports the model's code fixes ("Constraints violated (...size()[d])"): the
    sequence (a loop or scan over the tokens: that length gets a graph of its own), else the batch of a KV
    cache; None for any other failure."""
    if "Constraints violated" not in message:
        return None
    if shape[1] > 1 and "size()[1])" in message:  # a scan over the tokens (Mamba's, in some prompt lengths)
        return 1
    if cache_length is not None and shape[0] > 1:
        return 0
    return None


# with gradients on whatever the caller's mode: a graph planned under no_grad or inference_mode would hold no
# gradient reduction, and the same graph (cached too) serves calls that train
@torch.inference_mode(False)
@torch.enable_grad()
def _capture(model, spec: GraphSpec, device, dynamic_dims: tuple, length_as_int: bool = False) -> CapturedGraph:
    input_names, shape, cache_length = spec.arguments, spec.shape, spec.cache_length

    def dynamic(t, dim):
        if dim > 1 or dim in dynamic_dims:
            torch._dynamo.mark_dynamic(t, dim)

    example, state, cache = {}, {}, None
    if cache_length is not None:
        cache = meta_cache(model, shape[0], cache_length, length_as_int)
        set_fresh(cache, spec.fresh_cache)
        for name, t in cache_tensors(cache).items():
            if shape[0] > 1 and t.dim() > 0:
                dynamic(t, 0)
            example[name] = t
            state[name] = t
    for name in input_names:
        if name == "attention_mask" and cache is not None:  # the mask spans the whole cache (or is the token's)
            t = torch.ones(shape[0], 1 if spec.token_mask else cache_length, dtype=torch.long, device=device)
            if shape[0] > 1:
                dynamic(t, 0)
            example[name] = t
            continue
        if name == "attention_mask":
            t = torch.ones(*shape, dtype=torch.long, device=device)
        elif name == "position_ids":
            t = torch.arange(shape[1], device=device).expand(*shape).contiguous()
        else:
            t = torch.zeros(*shape, dtype=torch.long, device=device)
        for dim, size in enumerate(shape):
            if size > 1:
                dynamic(t, dim)
        example[name] = t

    seen = []

    def backend(gm, example_inputs):
        seen.append((gm, list(example_inputs)))

        def run_on_meta(*args):
            try:
                return gm.forward(*args)
            except Exception as err:  # noqa: BLE001 - see _RunOnMeta
                raise _RunOnMeta(str(err)) from err

        return run_on_meta

    unpadded = spec.unpadded and cache is None and "attention_mask" in input_names
    if spec.router_logits:
        install_output_recorders(model)
    if spec.expert_counts:
        install_counters(model)
    fn = _forward_fn(model, spec, cache, unpadded)
    compiled = torch.compile(fn, backend=backend, fullgraph=True, dynamic=False)
    # a model with dropout is captured in training mode (its dropout sites with their rates), except for
    # generation, which runs in eval semantics (capture/dropout_sites.py)
    training = cache is None and bool(getattr(model, "fxparallel_dropout", None))
    # Models build small constants with torch.tensor(..., device=x.device); on the meta device
    # those are meta tensors, which the fake-tensor mode must accept as inputs.
    from torch._subclasses.fake_tensor import fake_tensor_tls

    previous = fake_tensor_tls.allow_non_fake_inputs_override
    fake_tensor_tls.allow_non_fake_inputs_override = True
    try:
        model.train(training)
        plain = (causal_without_mask("position_ids" in input_names, unpadded)
                 if cache is None and (unpadded or "attention_mask" not in input_names) else contextlib.nullcontext())
        # fake_tensor_cache_enabled=False: with symbolic sizes, FakeTensorMode's op cache costs more than it saves
        # here (building an entry, and rebuilding outputs from one, re-derive their symbolic shapes): measured,
        # captures take 20-40 % less time without it, never more (docs/benchmarks.md, "Planning speed")
        with torch._dynamo.config.patch(ignore_logging_functions=_logging_functions(),
                                        fake_tensor_cache_enabled=False), plain:
            compiled(**{k: v for k, v in example.items() if k not in state})
    except _RunOnMeta as err:
        # captured whole; only running it on meta failed (data-dependent ops have no meta kernel)
        log.debug("%s: the captured graph could not run on meta (%s); it is used as captured", type(model).__name__, err)
    except Exception as err:  # Dynamo raises many exception types; all mean "not capturable whole"
        kind = type(model).__name__
        if cache is not None:  # the forward without a cache was captured before (parallelize): only generation fails
            raise CacheNotCarried(f"{kind} could not be captured as one graph with a KV cache "
                                  f"({_dynamo_message(err)})") from err
        mode = " in training mode" if training else ""
        raise CaptureError(f"{kind} could not be captured as one graph{mode}: {_dynamo_message(err)}") from err
    finally:
        fake_tensor_tls.allow_non_fake_inputs_override = previous
        model.eval()
    if len(seen) != 1:
        raise CaptureError(f"expected one captured graph, Dynamo produced {len(seen)}")
    gm, example_inputs = seen[0]
    if training:
        check_training_graph(gm, type(model).__name__)
    if cache is not None:  # a generation graph runs no backward: a custom autograd function is its forward body
        inline_custom_forwards(gm)
    return _bind(gm, example_inputs, model, example, spec.outputs, set(state))


class _RunOnMeta(Exception):
    """Dynamo runs the graph it captured on the example (meta) inputs. Data-dependent ops (``.item()``,
    ``.tolist()``, ``nonzero``: JetMoE's expert sizes, XLM's length check) are in the graph as unbacked
    sizes but have no meta kernel, so that run fails after the capture succeeded; nothing needs its
    result. (Python side effects Dynamo would apply after the run are then not applied to the meta model.)"""


def _finite(bound) -> bool:
    return bound is not None and isinstance(bound, sympy.Integer)


def _source_name(source) -> str:
    name = getattr(source, "name", "")
    return str(name() if callable(name) else name)


def _argument_of_source(source_name: str, example: dict):
    """The argument a Dynamo source reads: ``L['kwargs']['input_ids']`` -> input_ids; a cache tensor,
    ``L['cache'].layers[3].keys`` -> past_3_keys, ``...layers[3].conv_states[0]`` -> past_3_conv_states_0
    (capture/static_cache.py)."""
    found = re.search(r"\['(\w+)'\]$", source_name)
    if found and found.group(1) in example:
        return found.group(1)
    found = re.search(r"\.layers\[(\d+)\]\.(\w+)(?:\[(\d+)\])?$", source_name)  # [i]: a recurrent state i
    if found:
        field = found.group(2) if found.group(3) is None else f"{found.group(2)}_{found.group(3)}"
        name = argument_name(int(found.group(1)), field)
        return name if name in example else None
    return None


def _add_replaced_symbols(env, example, symbol_sources) -> None:
    """Sizes Dynamo replaced by an equal one (position_ids' [b, s] by input_ids', a KV cache's batch by
    input_ids') no longer appear in any fake shape, but the guards still name them: bind them to their
    own argument's size, found from the symbol's source (the argument it was read from)."""
    for sym, sources in env.var_to_sources.items():
        if sym in symbol_sources:
            continue
        for source in sources:
            base, idx = getattr(source, "base", None), getattr(source, "idx", None)
            name = getattr(base, "name", "")
            argument = _argument_of_source(str(name() if callable(name) else name), example)
            if argument is not None and isinstance(idx, int):
                symbol_sources[sym] = (argument, idx)
                break


def _bind(gm, example_inputs, model, example, output_names, state_names=frozenset()) -> CapturedGraph:
    param_names: dict[int, str] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        param_names.setdefault(id(p), hf_name(name))  # an adapter's base layer: the base model's name
    buffer_names = {id(b): hf_name(name) for name, b in model.named_buffers(remove_duplicate=False)}
    input_ids = {id(t): name for name, t in example.items()}

    params, buffers, inputs, sym_placeholders = {}, {}, {}, {}
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    for node, value in zip(placeholders, example_inputs):
        if isinstance(value, torch.Tensor) and id(value) in param_names:
            params[node.name] = param_names[id(value)]
        elif isinstance(value, torch.Tensor) and id(value) in buffer_names:
            buffers[node.name] = buffer_names[id(value)]
        elif isinstance(value, torch.Tensor) and id(value) in input_ids:
            inputs[node.name] = input_ids[id(value)]
        elif isinstance(value, (int, torch.SymInt)):
            sym_placeholders[node.name] = node
        elif re.match(r"l_cache_layers_\d+_", node.name):  # a cache field beyond keys, values and lengths
            raise state_not_carried(model, f"the graph reads {node.name}")
        else:
            raise CaptureError(
                f"graph input {node.name} ({type(value).__name__}) is neither a parameter, a buffer nor an "
                "argument; fxparallel cannot bind it"
            )

    # Which argument dimension each size symbol comes from; the sizes captured as constants
    # (Dynamo specializes 0 and 1) are valid only as they are.
    symbol_sources, static_sizes = {}, {}
    for node in placeholders:
        if node.name in inputs:
            fake = node.meta["example_value"]
            static_sizes[(inputs[node.name], "ndim")] = fake.dim()
            for dim, size in enumerate(fake.shape):
                if isinstance(size, torch.SymInt) and isinstance(size.node.expr, sympy.Symbol):
                    symbol_sources.setdefault(size.node.expr, (inputs[node.name], dim))
                elif isinstance(size, int):
                    static_sizes[(inputs[node.name], dim)] = size
    symbols = {}
    for name, node in sym_placeholders.items():
        expr = node.meta["example_value"].node.expr
        if expr not in symbol_sources:
            raise CaptureError(f"size {expr} of the graph is not a dimension of any argument")
        symbols[name] = symbol_sources[expr]

    fake_mode = torch._guards.detect_fake_mode(
        [n.meta["example_value"] for n in placeholders if "example_value" in n.meta]
    )
    guards = []
    if fake_mode is not None and fake_mode.shape_env is not None:
        env = fake_mode.shape_env
        guards = [g.expr for g in env.guards]
        _add_replaced_symbols(env, example, symbol_sources)
        for sym in symbol_sources:
            vr = env.var_to_range.get(sym)
            if vr is not None:
                if _finite(vr.lower):
                    guards.append(sympy.Ge(sym, int(vr.lower)))
                if _finite(vr.upper):
                    guards.append(sympy.Le(sym, int(vr.upper)))
    state = {node: arg for node, arg in inputs.items() if arg in state_names}
    return CapturedGraph(
        gm=gm,
        state=state,
        params=params,
        buffers=buffers,
        inputs=inputs,
        symbols=symbols,
        outputs=output_names,
        guards=guards,
        symbol_sources=symbol_sources,
        static_sizes=static_sizes,
    )
