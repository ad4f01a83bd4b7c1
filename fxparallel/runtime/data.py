"""Training data: a token stream packed into fixed-length rows, and one batch per step per dp rank.

Label convention (the Hugging Face one, used throughout the runtime): a batch is
``input_ids`` of shape [b, seq_len] and ``labels == input_ids``; the model's loss
shifts labels by one internally (position t predicts token t+1), so nothing is
shifted here. Each packed row therefore trains seq_len - 1 predictions. Rows are
cut from the concatenated documents (separated by EOS) without regard to document
boundaries, and attention is causal over the whole row (plain packing).

Distribution: the global batch of a step is ``global_batch`` rows chosen by a seeded
per-epoch permutation; dp rank ``d`` takes rows ``[d*b, (d+1)*b)`` of it
(``b = global_batch / dp``). The choice depends only on the step and the dp rank, so
the tensor-parallel ranks of a dp group and its context-parallel ranks (which each
keep their chunks of the sequence dimension in ``train_step``) get the same rows, and
resuming at step s needs no iteration state.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch


def synthetic_token_stream(vocab_size: int, n_tokens: int, *, seed: int = 0, eos_id: Optional[int] = None,
                           mean_doc_len: int = 48) -> torch.Tensor:
    """A learnable token stream made locally: documents that count up from a random start with
    a random stride (mod the vocabulary), separated by ``eos_id`` (default: the last id)."""
    if vocab_size < 4:
        raise ValueError(f"vocab_size must be >= 4, got {vocab_size}")
    eos = vocab_size - 1 if eos_id is None else eos_id
    g = torch.Generator().manual_seed(seed)
    pieces, total = [], 0
    span = vocab_size - 1  # ids other than eos (when eos is the last id)
    while total < n_tokens:
        length = int(torch.randint(mean_doc_len // 2, mean_doc_len * 3 // 2 + 1, (1,), generator=g))
        start = int(torch.randint(0, span, (1,), generator=g))
        stride = int(torch.randint(1, 4, (1,), generator=g))
        doc = (start + stride * torch.arange(length)) % span
        if eos_id is not None:
            doc = torch.where(doc == eos, (doc + 1) % vocab_size, doc)
        pieces.append(torch.cat([doc, torch.tensor([eos])]))
        total += length + 1
    return torch.cat(pieces)[:n_tokens].long()


def pack_tokens(stream: torch.Tensor, seq_len: int) -> torch.Tensor:
    """[N, seq_len] rows of a 1-D token stream (the tail shorter than a row is dropped)."""
    if seq_len < 2:
        raise ValueError(f"seq_len must be >= 2 (a row of length L trains L-1 predictions), got {seq_len}")
    stream = torch.as_tensor(stream).long().flatten()
    rows = stream.numel() // seq_len
    if rows == 0:
        raise ValueError(f"the token stream has {stream.numel()} tokens, fewer than one row of {seq_len}")
    return stream[: rows * seq_len].view(rows, seq_len)


def dataset_token_stream(name: str, tokenizer, *, split: str = "train", config_name: Optional[str] = None,
                         text_field: str = "text", max_tokens: int = 1_000_000) -> torch.Tensor:
    """Tokenize a ``datasets`` dataset (only used when the user names one; ``datasets`` is imported
    here and is not a dependency) into one stream, documents separated by the tokenizer's EOS."""
    try:
        import datasets
    except ImportError as err:
        raise ImportError(f"--dataset {name} needs the 'datasets' package: pip install datasets") from err
    ds = datasets.load_dataset(name, config_name, split=split, streaming=True)
    eos = tokenizer.eos_token_id
    ids, total = [], 0
    for example in ds:
        if text_field not in example:
            raise KeyError(f"dataset {name} has no field {text_field!r} (fields: {sorted(example)})")
        tokens = tokenizer(example[text_field], add_special_tokens=False)["input_ids"]
        if eos is not None:
            tokens = tokens + [eos]
        ids.extend(tokens)
        total += len(tokens)
        if total >= max_tokens:
            break
    return torch.tensor(ids[:max_tokens], dtype=torch.long)


@dataclass
class StepBatches:
    """Deterministic batches by step for one dp rank (see the module docstring)."""

    rows: torch.Tensor  # [N, seq_len] packed tokens
    global_batch: int
    dp_rank: int
    dp_size: int
    seed: int = 0

    def __post_init__(self):
        if self.global_batch % self.dp_size:
            raise ValueError(f"global batch {self.global_batch} does not divide by the dp size {self.dp_size}")
        if self.global_batch > self.rows.shape[0]:
            raise ValueError(f"global batch {self.global_batch} is larger than the dataset ({self.rows.shape[0]} rows)")
        if not 0 <= self.dp_rank < self.dp_size:
            raise ValueError(f"dp rank {self.dp_rank} outside [0, {self.dp_size})")

    @property
    def local_batch(self) -> int:
        return self.global_batch // self.dp_size

    @property
    def steps_per_epoch(self) -> int:
        return self.rows.shape[0] // self.global_batch

    def global_indices(self, step: int) -> torch.Tensor:
        epoch, within = divmod(step, self.steps_per_epoch)
        order = torch.randperm(self.rows.shape[0], generator=torch.Generator().manual_seed(self.seed + epoch))
        return order[within * self.global_batch:(within + 1) * self.global_batch]

    def indices(self, step: int) -> torch.Tensor:
        b = self.local_batch
        return self.global_indices(step)[self.dp_rank * b:(self.dp_rank + 1) * b]

    def batch(self, step: int) -> dict:
        ids = self.rows[self.indices(step)]
        return {"input_ids": ids, "labels": ids.clone()}

    def global_batch_at(self, step: int) -> dict:
        """The whole global batch (for a single-process reference)."""
        ids = self.rows[self.global_indices(step)]
        return {"input_ids": ids, "labels": ids.clone()}
