"""Each rank of an expert-parallel group holds only its run of every stacked expert weight (dim 0, after the
tensor-parallel split: ``ops/expert_exchange.expert_runs``).

The parameters are made run-sized (``runs_of``, before anything is allocated) and the loader reads only the run's
pieces of the tensor-parallel shard (``pieces_in_run``): a rank reads and holds 1/ep of its tp shard's experts."""
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


def like_run_of(value: torch.Tensor, param) -> torch.Tensor:
    """``value`` (a state of ``param``, shaped as its run: an optimizer's moment) as a tensor that ``tp_shard_of_runs``
    and ``runtime.dtensor.full_tensor`` gather over ``param``'s ep group, as they gather ``param``."""
    value = value.detach()
    value._fxparallel_expert_run = param._fxparallel_expert_run
    value._fxparallel_expert_group = param._fxparallel_expert_group
    return value


def runs_of(plan, names: frozenset, tp_rank: int, tp: int, ep) -> dict:
    """{parameter: (first expert, count, of)}: the run of experts ``ep``'s rank holds of each stacked expert weight
    in ``names`` (the experts numbered within this tp rank's shard of dim 0), known before anything is allocated or
    read; refused where a tp shard holds fewer experts than there are ep ranks."""
    runs = {}
    for p in plan.params:
        if not names.intersection(p.names):
            continue
        count = int(p.local_shape(tp, tp_rank)[0])
        if count < ep.size:
            raise ShardingError(f"ep_group of size {ep.size}: {p.name} holds {count} experts on this tensor-parallel "
                                "rank, fewer than the expert-parallel ranks (whole experts per tp rank leave "
                                "E/tp each: use a smaller ep, or expert_parallel=False to split experts inside)")
        first, n = expert_runs(count, ep.size)[ep.rank]
        runs[p.name] = (first, n, count)
    return runs


def cut_to_run(shard: torch.Tensor, run: Optional[tuple]) -> torch.Tensor:
    """``shard`` (a tp shard, or a state shaped as one) cut to the experts of ``run`` (dim 0; None: no run, whole)."""
    return shard if run is None else shard[run[0]:run[0] + run[1]]


def pieces_in_run(pieces: list, run: tuple) -> list:
    """``pieces`` ([(index into the full tensor, index into the tp shard)], ``ParamPlan.pieces``) cut to the experts
    of ``run`` (dim 0): the indices into the run, and into the full tensor of only those experts."""
    return pieces_in_rows(pieces, run[0], run[0] + run[1])


def pieces_in_rows(pieces: list, start: int, stop: int) -> list:
    """``pieces`` cut to rows [start, stop) of dim 0 of the shard (a run of experts, FSDP's chunk): the indices into
    those rows, and into the full tensor of only them."""
    out = []
    for source, dest in pieces:
        first, last = max(dest[0].start, start), min(dest[0].stop, stop)
        if first < last:
            shift = source[0].start - dest[0].start
            out.append(((slice(first + shift, last + shift),) + tuple(source[1:]),
                        (slice(first - start, last - start),) + tuple(dest[1:])))
    return out

