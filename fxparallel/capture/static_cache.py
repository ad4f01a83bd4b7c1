"""The KV cache a generation graph is captured with: transformers' own ``StaticCache`` on the meta
device, sized for ``length`` tokens.

Its tensors (per layer: keys, values, and the count of tokens written) become graph inputs;
the model's own code writes them in place (``index_copy_``, ``add_``), so the rewritten graph
updates this rank's shard of the cache where the model updates the whole. The cache is first
filled once eagerly on meta (free: nothing is computed), so each layer allocates its tensors
with the shapes its own code asks for (any number of kv heads, head size). Sliding-window layers keep the
whole length too: their window is the attention mask's. Linear-attention and state-space layers keep a
convolution and a recurrent state per row (``STATE_FIELDS``), written whole (``copy_``) by the model; which
code the model runs (a first forward that starts them, or one that continues them) follows a Python flag of
the layer, set per graph (``set_fresh``)."""
from __future__ import annotations

import contextlib
import functools
import inspect

import torch
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.fx.experimental.symbolic_shapes import ShapeEnv

from ..errors import CacheNotCarried
from .own_caches import in_own_class

# argument names of the cache tensors in the generated code: past_<layer>_<field>
FIELDS = ("keys", "values", "cumulative_length", "indexer_keys", "indexer_cumulative_length")  # the last two: DSA indexers
# linear-attention and state-space layers: per state index i, past_<layer>_<field>_<i>
STATE_FIELDS = ("conv_states", "recurrent_states")


def argument_name(layer: int, field: str) -> str:
    return f"past_{layer}_{field}"


def _cache_keyword(model):
    """The keyword the model's forward takes its KV cache by: ``cache`` (transformers 5.24 on), else
    ``past_key_values``; None for a forward without one."""
    parameters = inspect.signature(model.forward).parameters
    return next((name for name in ("cache", "past_key_values") if name in parameters), None)


def cache_argument(model, cache) -> dict:
    """``cache`` as the keyword the model's forward takes. (5.24 maps the old name on for most models, not
    all: Dory's forward would build a cache of its own, and the graph would never read the one given.)"""
    return {_cache_keyword(model) or "past_key_values": cache}


def state_not_carried(model, what: str) -> CacheNotCarried:
    """The refusal of a model whose cache keeps a state beyond keys, values and lengths."""
    carried = ", ".join(FIELDS + STATE_FIELDS)
    return CacheNotCarried(f"{type(model).__name__}: its cache keeps a state the parallel model's generation "
                           f"graphs do not carry ({what}; carried: {carried})")


@contextlib.contextmanager
def _plain_experts(model):
    """MoE experts run with transformers' batched_mm kernel while the cache is filled: the fill only allocates
    the cache, and the meta grouped_mm kernel takes bfloat16 only (a float32 model could not fill it)."""
    configs = [c for c in {id(m.config): m.config for m in model.modules() if hasattr(m, "config")}.values()
               if getattr(c, "_experts_implementation", None) in (None, "grouped_mm")]
    before = [c._experts_implementation for c in configs]
    try:
        for c in configs:
            c._experts_implementation = "batched_mm"
        yield
    finally:
        for c, value in zip(configs, before):
            c._experts_implementation = value


def meta_cache(model, batch: int, length: int, length_as_int: bool = False):
    """A StaticCache for ``model`` (on meta) whose layers hold their tensors, for ``batch`` rows; with
    ``length_as_int``, its layers give their length as an int (``_length_read_as_int``)."""
    from transformers import StaticCache
    from transformers.cache_utils import STATIC_LAYER_TYPE_MAPPING, get_layer_types_and_kwargs

    if _cache_keyword(model) is None:  # GPT-1; RWKV's state, XLNet's mems
        parameters = inspect.signature(model.forward).parameters
        own = [name for name in ("state", "mems", "cache_params") if name in parameters]
        carries = "; it carries " + ", ".join(f"`{n}`" for n in own) + " instead" if own else ""
        raise CacheNotCarried(f"{type(model).__name__}'s forward takes no KV cache (no `cache` or "
                              f"`past_key_values` argument{carries})")
    layer_types, _ = get_layer_types_and_kwargs(model.config.get_text_config(decoder=True))
    missing = sorted(set(layer_types) - set(STATIC_LAYER_TYPE_MAPPING))
    if missing:  # (e.g. DeepSeek-V4's compressed attention: transformers generates with a dynamic cache)
        raise CacheNotCarried(f"{type(model).__name__} has layers of type {missing}, for which transformers has no "
                              "static cache layer")
    cache = in_own_class(model, StaticCache(config=model.config, max_cache_len=length), batch)  # (own_caches.py)
    if length_as_int:  # (before the fill: MPT reads the count as it fills)
        for layer in cache.layers:
            if hasattr(layer, "cumulative_length"):
                layer.__class__ = _length_read_as_int(type(layer))
    # a sliding-window (or chunked) layer keeps every token, as a full-attention layer does: the window is
    # the mask's (transformers builds it from the config for that layer type, over the positions of the whole
    # cache), so the keys a query attends are those of transformers' rolling cache, and no graph depends on
    # how far generation has gone past the window (the rolling layer chooses its code by a Python count)
    cache.layers = [_keeping_every_token(layer, length) for layer in cache.layers]
    layers = len(cache.layers)
    # under a fake mode, transformers sees a trace (is_tracing) and skips its checks of data meta lacks: padding
    # in the ids, a mask it could leave out; with a shape env, data-dependent sizes (JetMoE's expert counts,
    # X-MOD's nonzero) are symbols. The tensors the layers allocate come out fake: made meta again
    try:
        with torch.no_grad(), _plain_experts(model), \
                FakeTensorMode(allow_non_fake_inputs=True, shape_env=ShapeEnv()):
            ids = torch.zeros(batch, 1, dtype=torch.long, device="meta")
            model(input_ids=ids, use_cache=True, **cache_argument(model, cache))
    except Exception as err:  # noqa: BLE001 - e.g. a deep copy of cache layers (Dory), data read on meta
        raise CacheNotCarried(f"{type(model).__name__} cannot fill a static cache on the meta device "
                              f"({type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''})") from err
    if len(cache.layers) != layers:  # a graph captured once cannot replay that: it holds the layers it saw
        raise CacheNotCarried(f"{type(model).__name__} adds layers to its cache as it runs ({layers} -> "
                              f"{len(cache.layers)}, e.g. Dory's recurrent loops)")
    for layer in cache.layers:
        for name, value in list(vars(layer).items()):
            setattr(layer, name, _on_meta(value))
        for name in STATE_FIELDS:
            states = getattr(layer, name, None)
            if isinstance(states, dict):
                for i, value in states.items():
                    states[i] = _on_meta(value)
    for layer in cache.layers:  # back to empty: the graph is captured for a cache that is being filled
        length_so_far = getattr(layer, "cumulative_length", None)
        if isinstance(length_so_far, torch.Tensor):
            layer.cumulative_length = torch.zeros((), dtype=length_so_far.dtype, device="meta")
    return cache


@functools.lru_cache(maxsize=None)
def _length_read_as_int(layer_class: type) -> type:
    """``layer_class`` whose ``get_seq_length()`` is its count of tokens as a Python int (read from the tensor
    that holds it: in the graph, a data-dependent int; when the graph runs, one host read) instead of that
    tensor. For models whose code builds positions from it (TrOCR, RoFormer, MVP:
    ``torch.arange(length, length + tokens)``): with a tensor, both ends are data-dependent and the number of
    positions is unknown to Dynamo; with an int, it is ``tokens``; MPT's ``max(0, 1 - (tokens + length))`` needs
    only to know that the count is not negative, which the int says. Only where the tensor fails (``dynamo.py``):
    elsewhere a host read per forward would be wasted."""

    def get_seq_length(self) -> int:
        if not self.is_initialized:
            return 0
        count = self.cumulative_length.item()  # (an int; traced, a symbol: int() would ask for its value)
        torch._check(count >= 0)
        return count

    return type(f"{layer_class.__name__}LengthAsInt", (layer_class,), {"get_seq_length": get_seq_length})


def _keeping_every_token(layer, length: int):
    """A sliding-window layer as its full-attention form (beside its recurrent states, if it keeps some:
    Inkling's sliding layers); any other layer as it is."""
    from transformers import cache_utils

    if type(layer) is cache_utils.StaticSlidingWindowLayer:
        return cache_utils.StaticLayer(max_cache_len=length)
    both = getattr(cache_utils, "LinearAttentionAndStaticSlidingWindowAttentionLayer", None)
    if both is not None and type(layer) is both:
        return cache_utils.LinearAttentionAndStaticFullAttentionLayer(max_cache_len=length,
                                                                      number_of_states=layer.number_of_states)
    return layer


def keeps_states(config) -> bool:
    """Does transformers' cache for ``config`` hold linear-attention or state-space layers' states (a convolution
    and a recurrent state per row) beside or instead of keys and values?"""
    from transformers import cache_utils

    mixin = getattr(cache_utils, "LinearAttentionCacheLayerMixin", None)
    try:
        layer_types, _ = cache_utils.get_layer_types_and_kwargs(config.get_text_config(decoder=True))
    except Exception:  # noqa: BLE001 - a config transformers builds no cache for: generation refuses it later
        return False
    mapping = cache_utils.STATIC_LAYER_TYPE_MAPPING
    return mixin is not None and any(t in mapping and issubclass(mapping[t], mixin) for t in set(layer_types))


def set_fresh(cache, fresh: bool) -> None:
    """Mark the linear-attention / state-space layers' states as not yet written (``fresh``: the graph starts
    them, as transformers' first forward with a cache does) or written (the graph continues them). The models
    choose their code by this Python flag (a chunked scan, or a recurrent step), so each is a graph of its own."""
    for layer in cache.layers:
        flags = getattr(layer, "has_previous_state", None)
        if isinstance(flags, dict):
            for i in flags:
                flags[i] = not fresh


def _on_meta(value):
    """``value`` with each fake tensor in it (alone, or in a list / tuple) a meta tensor of its layout."""
    if isinstance(value, FakeTensor):
        return torch.empty_strided(value.shape, value.stride(), dtype=value.dtype, device="meta")
    if isinstance(value, (list, tuple)):
        return type(value)(_on_meta(v) for v in value)
    return value


def cache_tensors(cache) -> dict:
    """argument name -> the cache tensor it stands for."""
    found = {}
    for i, layer in enumerate(cache.layers):
        for field in FIELDS:
            value = getattr(layer, field, None)
            if isinstance(value, torch.Tensor):
                found[argument_name(i, field)] = value
        for field in STATE_FIELDS:
            for index, value in (getattr(layer, field, None) or {}).items():
                if isinstance(value, torch.Tensor):
                    found[argument_name(i, f"{field}_{index}")] = value
    return found
