"""Models whose forward takes a cache class of their own (it refuses transformers' ``StaticCache``): the static
cache handed to them in that class, its layers transformers' static ones, so the generation graphs carry it like
any other (``static_cache.py``).

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
code whether the states start or continue (they start at zero)."""
from __future__ import annotations


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


_OWN = {"minimax": _minimax, "xlstm": _xlstm}  # model_type -> the static cache in the model's own class


def in_own_class(model, cache, batch: int):
    """``cache`` (a StaticCache for ``batch`` rows) as the class ``model``'s forward takes (itself for most
    models)."""
    wrap = _OWN.get(model.config.get_text_config(decoder=True).model_type)
    return cache if wrap is None else wrap(model, cache, batch)
