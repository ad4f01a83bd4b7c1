"""Models whose forward takes a cache class of their own (it refuses transformers' ``StaticCache``): the static
cache handed to them in that class, its layers transformers' static ones, so the generation graphs carry it like
any other (``static_cache.py``).

MiniMax: ``MiniMaxCache`` (a DynamicCache) keeps each lightning-attention layer's state (the decayed sum of
``K^T V``, [batch, heads, head_dim, head_dim]) beside the attention layers' keys and values, read with
``get_linear_cache`` (None: the prompt's forward, a blockwise scan that starts the state; else one token at a time
continuing it) and replaced with ``set_linear_cache``. Here the state is the linear layer's recurrent state,
written in place, and "None" is the layer's ``has_previous_state`` flag, which ``set_fresh`` sets per graph."""
from __future__ import annotations


def _minimax(cache):
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


_OWN = {"minimax": _minimax}  # model_type -> the static cache in the model's own class


def in_own_class(model, cache):
    """``cache`` (a StaticCache) as the class ``model``'s forward takes (itself for most models)."""
    wrap = _OWN.get(model.config.get_text_config(decoder=True).model_type)
    return cache if wrap is None else wrap(cache)
