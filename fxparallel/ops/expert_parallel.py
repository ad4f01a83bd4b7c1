"""Expert parallelism at run time: a rank computes its own experts' rows, and masks the others'.

A rank holds experts [start, start + count) of a MoE layer (``plan/rules/expert_rows.py``). Two kernels:

* batched_mm picks each routed pair's weights by expert id (``gather_local_experts``); ids of other
  ranks' experts read a stand-in (this rank's first expert), so every row keeps its shape and no
  data-dependent size reaches the graph: every rank computes every row, its own right.
* grouped_mm takes rows sorted by expert with per-expert offsets: this rank's experts' rows are one
  contiguous run, rolled to the front (``roll_to_local_rows``) so the kernel computes only them, with
  this rank's offsets, and rolled back (``unroll_local_rows``); the other rows are zero.

Rows of other ranks' experts are zeroed (``mask_foreign_rows``) before they are summed or made whole, and
their gradient with them."""
from __future__ import annotations

import torch


def gather_local_experts(weight: torch.Tensor, ids: torch.Tensor, start: int, count: int) -> torch.Tensor:
    """``full_weight[ids]`` for ids of this rank's experts; this rank's first expert for the others."""
    return weight[torch.where(rows_of_experts(ids, start, count), ids - start, torch.zeros_like(ids))]


def rows_of_experts(ids: torch.Tensor, start: int, count: int) -> torch.Tensor:
    """Which rows (one expert id each) belong to this rank's experts."""
    return (ids >= start) & (ids < start + count)


def roll_to_local_rows(x: torch.Tensor, offsets: torch.Tensor, start: int, count: int):
    """Rows sorted by expert (``offsets``: cumulative rows per expert of all experts) rolled so that this rank's
    experts' rows come first, the others zeroed. Returns (rolled rows, this rank's offsets from row 0, the index
    that rolls them back, which rolled rows are this rank's)."""
    rows = torch.arange(x.shape[0], device=x.device)
    first = offsets[start - 1] if start else offsets.new_zeros(())
    mine = rows < offsets[start + count - 1] - first
    rolled = torch.where(mine.unsqueeze(-1), x[(rows + first) % x.shape[0]], torch.zeros((), dtype=x.dtype))
    return rolled, offsets[start:start + count] - first, (rows - first) % x.shape[0], mine


def unroll_local_rows(y: torch.Tensor, mine: torch.Tensor, back: torch.Tensor) -> torch.Tensor:
    """The grouped product of rolled rows back in sorted order; rows the kernel did not compute are zero
    (it leaves them unwritten on CUDA)."""
    return torch.where(mine.unsqueeze(-1), y, torch.zeros((), dtype=y.dtype, device=y.device))[back]


def mask_foreign_rows(x: torch.Tensor, mine: torch.Tensor, lead: int) -> torch.Tensor:
    """``x`` with the rows (its leading ``lead`` dims, ``mine`` flat or shaped) of other ranks' experts zeroed."""
    mine = mine.reshape(tuple(x.shape[:lead]) + (1,) * (x.dim() - lead))
    return torch.where(mine, x, torch.zeros((), dtype=x.dtype, device=x.device))
