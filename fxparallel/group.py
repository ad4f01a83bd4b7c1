"""The tensor-parallel group: validation and a handle the rewritten graph can name.

Graph code cannot hold a ProcessGroup as a literal, so each group is registered
once and the graph refers to it by a small integer.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist

from .errors import GroupError

_GROUPS: dict[int, "TPGroup"] = {}


@dataclass(frozen=True, eq=False)
class TPGroup:
    """A tensor-parallel group as the rewritten graph sees it."""

    process_group: object  # dist.ProcessGroup, or None for a single-process run without dist
    rank: int
    size: int
    handle: int

    def __repr__(self):
        return f"TPGroup(rank={self.rank}, size={self.size})"


def _register(pg, rank: int, size: int) -> TPGroup:
    for g in _GROUPS.values():
        if g.process_group is pg and g.rank == rank and g.size == size:
            return g
    handle = len(_GROUPS)
    group = TPGroup(pg, rank, size, handle)
    _GROUPS[handle] = group
    return group


def group_by_handle(handle: int) -> TPGroup:
    return _GROUPS[handle]


def resolve_tp_group(tp_group) -> TPGroup:
    """Accept a ProcessGroup, a 1-D DeviceMesh, or a TPGroup; check it is usable."""
    if isinstance(tp_group, TPGroup):
        return tp_group
    if tp_group is None:
        raise GroupError(
            "tp_group is None: pass a torch.distributed ProcessGroup or a 1-D DeviceMesh "
            "(for one process: dist.init_process_group('gloo', world_size=1, rank=0) then dist.group.WORLD)"
        )
    try:
        from torch.distributed.device_mesh import DeviceMesh
    except ImportError:  # pragma: no cover
        DeviceMesh = ()
    if DeviceMesh and isinstance(tp_group, DeviceMesh):
        if tp_group.ndim != 1:
            raise GroupError(
                f"tp_group is a {tp_group.ndim}-D DeviceMesh {tuple(tp_group.mesh_dim_names or ())}; "
                "pass the 1-D tensor-parallel sub-mesh, e.g. mesh['tp']"
            )
        tp_group = tp_group.get_group()
    if not dist.is_available() or not dist.is_initialized():
        raise GroupError(
            "tp_group was given but torch.distributed is not initialized: call "
            "dist.init_process_group(...) (torchrun does this through the environment) before parallelize"
        )
    if not isinstance(tp_group, dist.ProcessGroup):
        raise GroupError(f"tp_group must be a ProcessGroup or a 1-D DeviceMesh, got {type(tp_group).__name__}")
    rank = dist.get_rank(tp_group)
    if rank < 0:
        raise GroupError("this process is not a member of tp_group")
    return _register(tp_group, rank, dist.get_world_size(tp_group))


def fake_group(size: int, rank: int = 0) -> TPGroup:
    """A group that only plans (no collectives run): for plan reports without processes."""
    return _register(None, rank, size)
