"""Who downloads, who shows progress, and agreeing on failure, within the tensor-parallel group.

Every function that runs a collective is entered by all ranks of ``group`` (each rank
of the group calls ``parallelize``), so a rank that fails still reaches it with its
error, and all ranks raise instead of one waiting for a peer that left.
"""
from __future__ import annotations

import os
import socket

import torch.distributed as dist

from ..errors import CheckpointError


def default_group(group=None):
    """``group``, or the default group when torch.distributed runs, or None for one process."""
    if group is not None:
        return group
    return dist.group.WORLD if dist.is_available() and dist.is_initialized() else None


def _size(group) -> int:
    return dist.get_world_size(group) if group is not None else 1


def local_rank() -> int:
    """LOCAL_RANK as torchrun sets it; else the global rank (0 without torch.distributed)."""
    value = os.environ.get("LOCAL_RANK")
    if value is not None and value.strip().isdigit():
        return int(value)
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def first_on_node() -> bool:
    """The one process per node that shows progress bars."""
    return local_rank() == 0


def is_node_downloader(group) -> bool:
    """True on one member of ``group`` per host: the one with the lowest local rank.

    Other groups on the same host may have their own downloader; the hub cache's
    file locks make the later one find the file instead of fetching it again.
    """
    if _size(group) == 1:
        return True
    me = (socket.gethostname(), local_rank(), dist.get_rank())
    everyone = [None] * _size(group)
    dist.all_gather_object(everyone, me, group=group)
    return min(m for m in everyone if m[0] == me[0]) == me


def agree(group, error, what: str) -> None:
    """Raise on every rank if ``error`` is set on any rank of ``group`` (else return)."""
    mine = None if error is None else f"{type(error).__name__}: {error}"
    if _size(group) > 1:
        everyone = [None] * _size(group)
        dist.all_gather_object(everyone, mine, group=group)
    else:
        everyone = [mine]
    failed = [(r, m) for r, m in enumerate(everyone) if m is not None]
    if error is not None:
        raise error
    if failed:
        rank, message = failed[0]
        raise CheckpointError(f"{what} failed on rank {rank} of the tensor-parallel group: {message}")
