"""``get_input_embeddings()`` / ``get_output_embeddings()`` of the parallel model: views over this
rank's shard of the embedding table and of the output head.

The graphs never call an embedding module (they read the weights), so there is no Hugging Face
module to return. A view holds the model's own parameter (the same object: an in-place edit of
``view.weight`` edits the model) with what a caller needs to use it on a shard:

* ``weight``: this rank's shard; ``full_shape`` / ``local_shape``; ``placement`` (``S(0)``: rows
  of the vocabulary, ``S(1)``: columns of the hidden size, ``R``: whole on every rank);
* ``vocab_range``: the [start, stop) rows of the vocabulary this rank holds (all of them unless
  the placement is ``S(0)``); ``tp_rank`` / ``tp_size``;
* ``num_embeddings`` / ``embedding_dim`` (input) and ``out_features`` / ``in_features``
  (output): the full model's sizes, as the Hugging Face module reports them.

Calling a view computes what the Hugging Face module computes, complete on every rank (a
collective: every tp rank must call it with the same input; autograd reaches the shard): the
input view looks up token ids (this rank's rows, then an all-reduce), the output view gives
complete logits (this rank's vocabulary slice, then an all-gather). Only plain ``nn.Embedding``
/ ``nn.Linear`` modules can be called this way; a subclass that computes more (Gemma's scaled
embedding) says so.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .ops import collectives
from .uncalled_modules import RefusesHooks


class ShardView(RefusesHooks, nn.Module):
    """This rank's shard of an embedding table or output head (see the module docstring). Hooks on it are refused:
    the model's forward never calls it (``uncalled_modules.py``)."""

    getter = ""  # the model's method that hands it out

    def __init__(self, model, path: str, class_name: str, has_bias: bool):
        super().__init__()
        self.path, self.class_name = path, class_name
        self.hook_target = f"model.{self.getter} (the view of {path!r})"
        self.weight = model.get_parameter(f"{path}.weight")
        self.bias = model.get_parameter(f"{path}.bias") if has_bias else None
        self.plan = model.plan.param(f"{path}.weight")
        self.placement = self.plan.placement
        self.tp_rank, self.tp_size, self._handle = model.tp_group.rank, model.tp_group.size, model.tp_group.handle
        self.full_shape = tuple(self.plan.shape)
        self.local_shape = tuple(self.weight.shape)
        rows = self.vocab_dim()
        start, stop = 0, self.full_shape[rows]
        if self.placement.is_shard and self.placement.dim == rows and not self.placement.segments:
            piece = self.plan.pieces(self.tp_rank, self.tp_size)[0][0][rows]
            start, stop = piece.start, piece.stop
        self.vocab_range = (start, stop)

    def vocab_dim(self) -> int:
        return 0  # nn.Embedding and nn.Linear both keep the vocabulary on rows

    def _sizes(self, dim: int):
        """Per-rank sizes along ``dim`` when they differ (an uneven split), for the collectives."""
        sizes = [self.plan.local_shape(self.tp_size, r)[dim] for r in range(self.tp_size)]
        return (tuple(sizes),) if len(set(sizes)) > 1 else None

    def _check_callable(self, plain: type) -> None:
        if self.class_name != plain.__name__:
            raise NotImplementedError(
                f"{self.path} is a {self.class_name}, which may compute more than {plain.__name__} (a scale, ...): "
                f"calling this view of it is not supported; run the model (model(input_ids=...)), or use "
                f".weight (this rank's rows {self.vocab_range[0]}:{self.vocab_range[1]} of {self.full_shape})")
        if self.placement.segments or self.placement.block is not None:
            raise NotImplementedError(f"{self.path} has placement {self.placement}: calling this view is supported "
                                      "for R, S(0) and S(1) only")

    def extra_repr(self) -> str:
        shape = "x".join(map(str, self.full_shape))
        local = "x".join(map(str, self.local_shape))
        return (f"{self.path} ({self.class_name}), {shape} -> {local} {self.placement} ({self.plan.reason}), "
                f"vocab rows {self.vocab_range[0]}:{self.vocab_range[1]}, tp rank {self.tp_rank} of {self.tp_size}")


class ShardedEmbedding(ShardView):
    """``model.get_input_embeddings()``: ``view(input_ids)`` equals the Hugging Face embedding's output."""

    getter = "get_input_embeddings()"

    @property
    def num_embeddings(self) -> int:
        return self.full_shape[0]

    @property
    def embedding_dim(self) -> int:
        return self.full_shape[1]

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        self._check_callable(nn.Embedding)
        p = self.placement
        if not p.is_shard:
            return F.embedding(input_ids, self.weight)
        if p.dim == 1:  # columns of the hidden size: look up, then gather the columns
            return collectives.all_gather(F.embedding(input_ids, self.weight), -1, self._handle, None, self._sizes(1))
        start, stop = self.vocab_range  # rows of the vocabulary: ids of other ranks give zeros here, then sum
        outside = (input_ids < start) | (input_ids >= stop)
        local = F.embedding(torch.where(outside, 0, input_ids - start), self.weight)
        return collectives.all_reduce(local.masked_fill(outside.unsqueeze(-1), 0), self._handle)


class ShardedLMHead(ShardView):
    """``model.get_output_embeddings()``: ``view(hidden_states)`` equals the Hugging Face head's logits."""

    getter = "get_output_embeddings()"

    @property
    def out_features(self) -> int:
        return self.full_shape[0]

    @property
    def in_features(self) -> int:
        return self.full_shape[1]

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        self._check_callable(nn.Linear)
        p = self.placement
        if not p.is_shard:
            return F.linear(hidden_states, self.weight, self.bias)
        if p.dim == 0:  # vocabulary rows: this rank's logits, then gather them (the bias is split alike)
            local = F.linear(collectives.copy_to_tp(hidden_states, self._handle), self.weight, self.bias)
            return collectives.all_gather(local, -1, self._handle, None, self._sizes(0))
        x = collectives.local_chunk(hidden_states, -1, self._handle, None, self._sizes(1))
        out = collectives.all_reduce(F.linear(x, self.weight), self._handle)  # hidden columns: partial sums
        return out if self.bias is None else out + self.bias
