"""Expert parallelism at run time: a rank's gather of its own experts, and the mask of other ranks' rows.

A rank holds experts [start, start + count) of a MoE layer (``plan/rules/expert_rows.py``). The
experts kernel picks each routed pair's weights by expert id; ids of other ranks' experts read a
stand-in (this rank's first expert) so that every row is computed with the same shapes and no
data-dependent size reaches the graph. Those rows are zeroed before they are summed or made
whole, and their gradient with them."""
from __future__ import annotations

import torch


def gather_local_experts(weight: torch.Tensor, ids: torch.Tensor, start: int, count: int) -> torch.Tensor:
    """``full_weight[ids]`` for ids of this rank's experts; this rank's first expert for the others."""
    local = ids - start
    return weight[torch.where((local >= 0) & (local < count), local, torch.zeros_like(local))]


def mask_foreign_rows(x: torch.Tensor, ids: torch.Tensor, start: int, count: int, lead: int) -> torch.Tensor:
    """``x`` with the rows (its leading ``lead`` dims, in the order of ``ids``) of other ranks' experts zeroed."""
    mine = (ids >= start) & (ids < start + count)
    mine = mine.reshape(tuple(x.shape[:lead]) + (1,) * (x.dim() - lead))
    return torch.where(mine, x, torch.zeros((), dtype=x.dtype, device=x.device))
