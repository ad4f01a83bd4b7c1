"""``ParallelCache``: this rank's part of a static KV cache, as the graphs captured with a cache
(``capture/static_cache.py``) read and write it.

Each cache tensor of the captured model is placed by the solver like a parameter: split by kv
heads where attention is (each rank holds 1/TP of the cache, uneven head splits as in the
forward), replicated where the kv heads are (more ranks than kv heads). The tensors are
allocated on a call's first step for its batch and a length rounded up to ``LENGTH_STEP``, so
prompts of other lengths reuse the same graphs (a compiled ``generate`` keeps its cache for the
next call of its shape: ``generation/loop.py``).

Linear-attention and state-space layers (Mamba, gated delta nets) keep a convolution state and a recurrent
state per row instead of keys and values: fixed-size tensors (``past_<layer>_conv_states_<i>``,
``past_<layer>_recurrent_states_<i>``), split by the channels and heads each rank computes, as the forward
splits them. The model runs other code on a cache's first forward (the prompt's: the states start) than on the
next ones (one token at a time: the states continue), so those are two graphs (``GraphSpec.fresh_cache``)."""
from __future__ import annotations

from typing import Optional

import torch

LENGTH_STEP = 128  # cache lengths are multiples of this: graphs are captured per length


def cache_length(tokens: int) -> int:
    return -(-tokens // LENGTH_STEP) * LENGTH_STEP


class ParallelCache:
    """The cache tensors of one generation, keyed by their argument names (``past_<layer>_<field>``)."""

    def __init__(self, length: int):
        self.length = length
        self.layout: dict = {}  # argument name -> (full shape, this rank's shape, dtype); None: the batch dim
        self.tensors: dict = {}
        self.batch: Optional[int] = None
        self.started = False  # a forward has written it (the recurrent layers continue their states)

    def allocate(self, batch: int, device) -> None:
        self.batch = batch
        for name, (_, local, dtype) in self.layout.items():
            size = tuple(batch if s is None else s for s in local)
            self.tensors[name] = tensor = torch.zeros(size, dtype=dtype, device=device)
            if not torch.compiler.is_compiling():  # (under torch.compile(model) the call cannot be traced)
                # the decode graph writes these in place: a static address lets CUDA graphs (compile_config
                # mode="reduce-overhead") replay on them instead of copying them in, as transformers' StaticCache
                # does; unguarded: a new cache does not recompile, it records the CUDA graphs again
                torch._dynamo.mark_static_address(tensor, guard=False)

    def reset(self) -> None:
        """Empty again, in place (the same tensors: compiled decode steps replay on their addresses)."""
        for tensor in self.tensors.values():
            tensor.zero_()
        self.started = False

    @property
    def allocated(self) -> bool:
        return bool(self.tensors)

    def states(self) -> dict:
        """The linear-attention / state-space layers' tensors (convolution and recurrent states, not keys and
        values), by name, with the dim of their rows (the batch's; dim 0 where the layout fixes it)."""
        from ..capture.static_cache import STATE_FIELDS

        return {name: (tensor, next((d for d, s in enumerate(self.layout[name][1]) if s is None), 0))
                for name, tensor in self.tensors.items() if any(f"_{field}_" in name for field in STATE_FIELDS)}

    def get_seq_length(self) -> int:
        """Tokens written so far (transformers' Cache method of the same name)."""
        lengths = [t for n, t in self.tensors.items() if n.endswith("cumulative_length")]
        return int(lengths[0]) if lengths else 0

    def nbytes(self) -> int:
        """Bytes this rank holds (keys and values; convolution and recurrent states)."""
        return sum(t.numel() * t.element_size() for t in self.tensors.values())
