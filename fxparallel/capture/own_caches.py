"""Models whose cache transformers' ``StaticCache`` does not hold as it is: a forward that takes a cache class of
its own (MiniMax, xLSTM: the static cache handed to it in that class, its layers transformers' static ones), one
that adds layers to the cache as it runs (Dory: they are added before it is filled), and states kept as module
attributes (RecurrentGemma: read from and written to the cache's layers instead). The generation graphs then carry
their states like any other cache's (``static_cache.py``).

MiniMax: ``MiniMaxCache`` (a DynamicCache) keeps each lightning-attention layer's state (the decayed sum of
``K^T V``, [batch, heads, head_dim, head_dim]) beside the attention layers' keys and values, read with
``get_linear_cache`` (None: the prompt's forward, a blockwise scan that starts the state; else one token at a time
continuing it) and replaced with ``set_linear_cache``. Here the state is the linear layer's recurrent state,
written in place, and "None" is the layer's ``has_previous_state`` flag, which ``set_fresh`` sets per graph.

xLSTM: ``xLSTMCache`` keeps no keys or values, only each mLSTM layer's three recurrent states (the matrix memory
C [batch, heads, qk_head_dim, v_head_dim], the normalizer n [batch, heads, qk_head_dim] and the stabilizer m
[batch, heads, 1]), read as ``cache.rnn_state[layer]`` and copied into in place. Here they are a layer's
recurrent states 0, 1, 2 (allocated as transformers' own cache allocates them), and ``rnn_state`` reads them
from the layers, so the graph's inputs are the layers' tensors as for any other model. The model runs the same
code whether the states start or continue (they start at zero).

RecurrentGemma takes transformers' cache, whose recurrent layers are linear-attention ones (one state), but its
recurrent blocks keep their states as attributes of their modules (``conv1d_state``, ``rg_lru.recurrent_states``),
replaced at each forward, which a graph can neither read as an input nor write. On the meta model each such block
is a subclass (``states_in_cache``) whose forward puts the layer's states into those attributes first (None where
the layer's states start: the block then starts them at zero, as transformers' first forward does) and copies the
attributes into the layer's states in place after, as the other linear-attention layers are written."""
from __future__ import annotations

import functools
import re

from ..errors import CacheNotCarried


def _minimax(model, cache, batch: int):
    from transformers.models.minimax.modeling_minimax import MiniMaxCache

    class StaticMiniMaxCache(MiniMaxCache):
        """``cache``'s layers (a StaticCache's) behind MiniMaxCache's methods."""

        def __init__(self, static):  # (MiniMaxCache's own __init__ would make dynamic layers)
            self.__dict__.update(vars(static))

        def __len__(self) -> int:
            return len(self.layers)

        def get_linear_cache(self, layer_idx: int):
            layer = self.layers[layer_idx]
            return layer.recurrent_states[0] if layer.has_previous_state[0] else None

        def set_linear_cache(self, layer_idx: int, linear_cache) -> None:
            layer = self.layers[layer_idx]
            layer.update_recurrent_state(linear_cache)  # copied in place (allocated on the first write)
            layer.has_previous_state[0] = True

    return StaticMiniMaxCache(cache)


def _xlstm(model, cache, batch: int):
    from transformers.cache_utils import LinearAttentionLayer
    from transformers.models.xlstm.modeling_xlstm import xLSTMCache

    own = xLSTMCache(model.config, batch, dtype=model.dtype, device="meta")

    class StaticxLSTMCache(xLSTMCache):
        """``own``'s states as the recurrent states of one layer per mLSTM block."""

        def __init__(self):  # (xLSTMCache's own __init__ would allocate the states as attributes of its own)
            self.config, self.dtype = own.config, own.dtype
            self.seqlen_offset = 0  # a Python count: the model adds each forward's length, and never reads it
            self.layers = []
            for states in own.rnn_state.values():
                layer = LinearAttentionLayer(number_of_states=len(states))
                layer.recurrent_states.update(enumerate(states))
                layer.is_recurrent_states_initialized.update(dict.fromkeys(range(len(states)), True))
                self.layers.append(layer)

        @property
        def rnn_state(self) -> dict:
            return {i: tuple(layer.recurrent_states[j] for j in range(layer.number_of_states))
                    for i, layer in enumerate(self.layers)}

    return StaticxLSTMCache()


def padding_runs_through_states(model_type: str) -> bool:
    """Whether the prompt's forward of ``model_type`` runs padding tokens through its recurrent states as it runs
    any token: RecurrentGemma's does (its convolution state takes them, and its scan restarts at each row's first
    token, position 0), where the other recurrent models' forwards zero them first. Run one token at a time
    (``module._tokens_one_at_a_time``), a padding token's step is then run as any other's."""
    return model_type == "recurrent_gemma"


def states_in_cache(model) -> None:
    """The meta ``model``'s blocks that keep their states as module attributes read and write them in the cache's
    layers instead (RecurrentGemma; see the module docstring). Called once, as the meta model is built."""
    if model.config.get_text_config(decoder=True).model_type != "recurrent_gemma":
        return
    from transformers.models.recurrent_gemma.modeling_recurrent_gemma import RecurrentGemmaRecurrentBlock

    for name, module in model.named_modules():
        index = re.search(r"layers\.(\d+)\.", name)  # (its __init__ takes its layer's index, keeps none)
        if type(module) is RecurrentGemmaRecurrentBlock and index is not None:  # (else: generated recomputing)
            module.__class__ = _recurrent_block_states_in_cache()
            module.layer_idx = int(index.group(1))


@functools.lru_cache(maxsize=None)
def _recurrent_block_states_in_cache() -> type:
    from transformers.cache_utils import LinearAttentionCacheLayerMixin
    from transformers.models.recurrent_gemma.modeling_recurrent_gemma import RecurrentGemmaRecurrentBlock

    class RecurrentBlockStatesInCache(RecurrentGemmaRecurrentBlock):
        def forward(self, input_states, position_ids, attention_mask, use_cache=True, cache=None, **kwargs):
            layer = cache.layers[self.layer_idx] if use_cache and cache is not None else None
            if not isinstance(layer, LinearAttentionCacheLayerMixin):
                return super().forward(input_states, position_ids, attention_mask, use_cache=use_cache, cache=cache,
                                       **kwargs)
            continuing = layer.has_previous_state[0]
            self.conv1d_state = layer.conv_states[0] if continuing else None
            self.rg_lru.recurrent_states = layer.recurrent_states[0] if continuing else None
            out = super().forward(input_states, position_ids, attention_mask, use_cache=use_cache, cache=cache,
                                  **kwargs)
            if not layer.is_conv_states_initialized[0]:  # the fill on meta: allocated as the block's states are
                layer.lazy_initialization(conv_states=self.conv1d_state, recurrent_states=self.rg_lru.recurrent_states)
            layer.conv_states[0].copy_(self.conv1d_state)
            layer.recurrent_states[0].copy_(self.rg_lru.recurrent_states)
            layer.has_previous_state[0] = True
            self.conv1d_state = self.rg_lru.recurrent_states = None
            return out

    return RecurrentBlockStatesInCache


def _dory(model, cache, batch: int):
    """Dory runs its recurrent layers in several loops. With ``recurrent_kv_cache_mode="per_loop"`` (its default)
    each loop past the first writes a copy of those layers' cache, which its forward appends to the cache (deep
    copies) on the call that finds only the model's own layers there: cache code a graph captured once cannot
    replay. Here the copies are made before the cache is filled, so the forward finds them. ``"last_loop"``: the
    earlier loops read the keys and values the last loop wrote so far, a length a static cache does not keep apart
    from its empty slots: refused (generation then recomputes)."""
    import copy

    config = model.config.get_text_config(decoder=True)
    mode = config.recurrent_kv_cache_mode
    if mode != "per_loop":
        raise CacheNotCarried(f"{type(model).__name__} with recurrent_kv_cache_mode={mode!r}: its earlier loops "
                              "read the keys and values the last loop wrote so far, which a static cache does not keep "
                              "apart from its empty slots")
    start, count = config.n_input_layers, config.n_recurrent_layers
    copies = cache.layers[start:start + count] * (config.n_recurrent_loops - 1)
    cache.layers += [copy.deepcopy(layer) for layer in copies]
    return cache


_OWN = {"minimax": _minimax, "xlstm": _xlstm, "dory": _dory}  # model_type -> the static cache in the model's own class


def in_own_class(model, cache, batch: int):
    """``cache`` (a StaticCache for ``batch`` rows) as the class ``model``'s forward takes (itself for most
    models)."""
    wrap = _OWN.get(model.config.get_text_config(decoder=True).model_type)
    return cache if wrap is None else wrap(model, cache, batch)
