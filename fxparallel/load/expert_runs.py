"""Each rank of an expert-parallel group keeps its run of every stacked expert weight (dim 0, after the
tensor-parallel split: ``ops/expert_exchange.expert_runs``), and drops the rest.

The weights are read as the tensor-parallel plan places them, then cut: loading holds the tp shard of
every expert for a moment, the model afterwards 1/ep of it."""
from __future__ import annotations

from typing import Optional

import torch

from ..errors import ShardingError
from ..ops.expert_exchange import expert_runs
from ..plan.layout import balanced


def run_sizes(param) -> Optional[tuple]:
    """The experts each rank of ``param``'s ep group holds, as the gathers along dim 0 take them (None: all equal)."""
    sizes = balanced(param._fxparallel_expert_run[2], param._fxparallel_expert_group.size)
    return sizes if len(set(sizes)) > 1 else None


def tp_shard_of_runs(param) -> torch.Tensor:
    """The tp shard whose runs of experts the ranks of ``param``'s ep group hold (``param``: an expert-run
    parameter), all-gathered along dim 0 (collective over that group)."""
    from ..ops.collectives import gather_full

    group = param._fxparallel_expert_group
    return gather_full(param.detach(), 0, group.process_group, group.size, run_sizes(param))


def keep_expert_runs(module, names: frozenset, ep) -> dict:
    """Cut each parameter of ``names`` to ``ep``'s rank's run; returns {name: (first expert, count, of)} (the
    experts are numbered within this tp rank's shard of dim 0)."""
    params = dict(module.local_named_parameters())
    kept = {}
    for name in sorted(names):
        param = params[name]
        count = int(param.shape[0])
        if count < ep.size:
            raise ShardingError(f"ep_group of size {ep.size}: {name} holds {count} experts on this tensor-parallel "
                                "rank, fewer than the expert-parallel ranks (whole experts per tp rank leave "
                                "E/tp each: use a smaller ep, or expert_parallel=False to split experts inside)")
        first, n = expert_runs(count, ep.size)[ep.rank]
        with torch.no_grad():
            param.data = param.data[first:first + n].clone()
        param._fxparallel_expert_run = (first, n, count)
        param._fxparallel_expert_group = ep  # (full tensors gather the runs over it: runtime/dtensor.py, export.py)
        kept[name] = (first, n, count)
    return kept


def refuse_expert_runs(model, what: str) -> None:
    """``what`` cannot yet describe or fill experts spread over data-parallel ranks: refused before anything is
    written, as a full-shape description of a run of experts would be silently wrong."""
    model = getattr(model, "_orig_mod", model)
    runs = getattr(model, "expert_runs", None)
    if runs:
        first, n, count = next(iter(runs.values()))
        raise NotImplementedError(
            f"{what}: this model's experts are spread over data-parallel ranks (ep_group of size "
            f"{model.ep_group.size}: this rank holds experts {first}..{first + n - 1} of the {count} of its tensor-"
            "parallel shard), which state dicts and generate do not handle yet: save with "
            "fxparallel.runtime.save_checkpoint or export_pretrained, or parallelize without ep_group")
