"""What one graph computes, as one frozen object: the capture's input, the graph cache's key and the
module's identity of its graphs. An option that changes the captured code is a field here, and only here."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Optional

# Example sizes at capture: small primes that no model dimension is likely to equal,
# so that Dynamo never confuses the batch or sequence with a weight dimension.
EXAMPLE_BATCH = 3
EXAMPLE_SEQ = 13


@dataclass(frozen=True)
class GraphSpec:
    """``arguments``: the forward's tensor arguments the graph takes (input_ids, attention_mask, ...).
    ``shape``: the example [batch, sequence] captured; sizes above 1 are dynamic (capture/dynamo.py).
    ``labels_shifted``: labels arrive shifted by one (context parallelism: the loss takes them as given).
    ``cache_length``: a generation graph with a static KV cache of that many tokens (capture/static_cache.py).
    ``logits_to_keep``: the logits of the last that many positions only (0: all; generate's prefill keeps 1).
    ``unpadded``: for calls whose attention mask holds no padding (capture/causal_mask.py).
    ``router_logits``: a mixture-of-experts model run with transformers' ``output_router_logits=True``: the
    loss holds the load-balancing term, and the graph also outputs it (``aux_loss``) and every MoE layer's
    router logits (``router_logits``, stacked: [layers, tokens, experts]).
    ``expert_counts``: also the tokens routed to each expert of every MoE layer (``tokens_per_expert``: [layers,
    experts], capture/expert_counts.py).
    ``fresh_cache``: a generation graph whose cache has linear-attention or state-space layers, run on the
    cache's first forward (the prompt's): those layers start their states (transformers' code for a first
    forward); without it they continue them (one token at a time).
    ``token_mask``: a one-token generation graph given the token's own column of the attention mask ([batch, 1],
    not the cache's span), which the model applies to it: a prompt taken one token at a time, padding included, by
    a model whose layers need no mask over the cache (Mamba: capture/dynamo.py, ``one_token_prompts``)."""

    arguments: tuple
    shape: tuple = (EXAMPLE_BATCH, EXAMPLE_SEQ)
    labels_shifted: bool = False
    cache_length: Optional[int] = None
    logits_to_keep: int = 0
    unpadded: bool = False
    router_logits: bool = False
    expert_counts: bool = False
    fresh_cache: bool = False
    token_mask: bool = False

    def __post_init__(self):
        object.__setattr__(self, "arguments", tuple(self.arguments))
        object.__setattr__(self, "shape", tuple(int(s) for s in self.shape))

    @property
    def outputs(self) -> tuple:
        plain = ("loss", "logits") if "labels" in self.arguments else ("logits",)
        return plain + ("aux_loss", "router_logits") * self.router_logits + ("tokens_per_expert",) * self.expert_counts

    @property
    def identity(self) -> tuple:
        """What tells two graphs apart apart from the shapes their guards take: a call is served by a graph
        of the same identity whose guards hold for its shapes."""
        return (tuple(sorted(self.arguments)), self.labels_shifted, self.cache_length, self.logits_to_keep,
                self.unpadded, self.router_logits, self.expert_counts, self.fresh_cache, self.token_mask)

    def at(self, shape) -> "GraphSpec":
        return dataclasses.replace(self, shape=tuple(shape))

    def without_labels(self) -> "GraphSpec":
        return dataclasses.replace(self, arguments=tuple(a for a in self.arguments if a != "labels"))

    def to_dict(self) -> dict:
        """Plain JSON data (the graph cache's key and entries)."""
        return {"arguments": list(self.arguments), "shape": list(self.shape), "labels_shifted": self.labels_shifted,
                "cache_length": self.cache_length, "logits_to_keep": self.logits_to_keep, "unpadded": self.unpadded,
                "router_logits": self.router_logits, "expert_counts": self.expert_counts,
                "fresh_cache": self.fresh_cache, "token_mask": self.token_mask}

    @classmethod
    def from_dict(cls, d: dict) -> "GraphSpec":
        return cls(**d)
