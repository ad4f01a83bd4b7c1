"""``generate`` where a forward talks to data-parallel ranks: FSDP's all-gathers (``runtime.apply_data_parallel``
in its shard mode) and the experts' exchanges (``parallelize(..., ep_group=...)``: the rows routed to other ranks'
experts travel there and back, ``ops/expert_exchange.py``).

Each data-parallel rank generates its own prompts and may stop at another step (its own max_new_tokens, EOS or
stopping criteria), yet a forward on one needs a forward on each of its peers. As transformers' ``synced_gpus``
does for ZeRO-3 / FSDP, the ranks step together until every one has stopped: each step they agree whether any
still generates (an all-reduce of one flag), and a rank whose rows have all stopped runs its next step again and
again (``Waiting``), its logits dropped. Every peer must call ``generate`` together; a call refused on one (an
argument, a length) is raised on all of them before the first forward (``agree``)."""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from ..errors import InputError
from ..load.coordinate import exchange


def peers_of(model):
    """The process group whose ranks' forwards pair up (FSDP's data-parallel group, which holds the ep group, or
    the ep group alone), or None where a forward talks to no rank outside the tensor-parallel group."""
    data_parallel = getattr(model, "_fxparallel_data_parallel", None)
    group = data_parallel.forward_group if data_parallel is not None else None
    if group is None and getattr(model, "expert_runs", None):
        group = model.ep_group.process_group
    return group if group is not None and dist.get_world_size(group) > 1 else None


def agree(group, refused: Optional[BaseException]) -> None:
    """Every peer has called generate and none refused it: raise ``refused`` on its own rank and an error naming
    that rank on the others, before any forward. The exchange waits a bounded time (a peer that never calls
    generate is named: ``load/coordinate.py``). ``group``: ``peers_of(model)``."""
    if group is None:
        if refused is not None:
            raise refused
        return
    rows = exchange(group, refused is not None, "generate over the data-parallel ranks", step="generate peers")
    if refused is not None:
        raise refused
    failed = [r for r, bad in enumerate(rows) if bad]
    if failed:
        named = f"rank {failed[0]}" if len(failed) == 1 else f"ranks {', '.join(map(str, failed))}"
        raise InputError(f"generate: the call was refused on data-parallel {named} (see the error there); its "
                         "forwards pair up with this rank's (FSDP's all-gathers, or the experts' exchanges), so "
                         "every data-parallel rank generates together and it is refused here too")


def reshard(model) -> None:
    """Under FSDP, free the parameters the steps gathered: the root keeps its own after a forward until a backward
    frees them, and the optimizer, checkpoints and ``parameters()`` must find the shards again."""
    from ..runtime.fsdp import is_data_parallel, reshard as reshard_units

    if is_data_parallel(model):
        reshard_units(model)


def any_generating(group, mine: bool, device) -> bool:
    """Whether any rank of ``group`` has rows still generating (``mine``: this rank's)."""
    flag = torch.tensor([int(mine)], dtype=torch.int32, device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
    return bool(flag.item())


class Waiting:
    """This rank's rows have all stopped while a peer still generates: its next step is run again and again, its
    logits dropped. Before each of these steps the cache's counts of tokens written (``cumulative_length``) are put
    back, so that each writes the same slot with the same keys and values (the next slot would run past the end of
    this rank's cache, sized for its own max_length, while a peer generates longer). A cache the call returns
    (``return_dict_in_generate``) is kept as it was before the first of these steps (recurrent states move on):
    copied now and put back by ``restore``."""

    def __init__(self, cache, returned: bool):
        self._cache = cache
        tensors = cache.tensors if cache is not None else {}
        self._counts = {name: t.clone() for name, t in tensors.items() if name.endswith("cumulative_length")}
        self._kept = ({name: t.clone() for name, t in tensors.items()}, cache.started) if returned and tensors else None

    def rewind(self, cache) -> None:
        """Before a repeated step: the counts back (``cache``: the generation's now; None once it recomputes)."""
        if cache is self._cache and cache is not None:
            for name, count in self._counts.items():
                cache.tensors[name].copy_(count)

    def restore(self) -> None:
        if self._kept is None:
            return
        tensors, started = self._kept
        for name, t in tensors.items():
            self._cache.tensors[name].copy_(t)
        self._cache.started = started
