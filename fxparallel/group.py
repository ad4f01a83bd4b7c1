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


def _refuse_fake(group: TPGroup) -> None:
    """A fake group (``fake_group``: no ProcessGroup behind it) plans only; refuse it where ranks would run."""
    if group.process_group is not None:
        return
    world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    if world > 1:
        raise GroupError(
            f"tp_group is fxparallel.fake_group({group.size}), but this process is rank {dist.get_rank()} of a "
            f"{world}-process job: a fake group plans only (its collectives would run on the default group and "
            "every rank would load rank "
            f"{group.rank}'s shards); pass the real ProcessGroup or 1-D DeviceMesh (e.g. dist.group.WORLD, "
            "mesh['tp'])"
        )
    if group.size > 1:
        raise GroupError(
            f"tp_group is fxparallel.fake_group({group.size}) and torch.distributed is not initialized: a fake group "
            f"plans only, it cannot run {group.size} ranks or load their shards in one process. For a plan use "
            f"fxparallel.plan_model(model, {group.size}); to run, start {group.size} processes (torchrun) and pass "
            "the real ProcessGroup or 1-D DeviceMesh"
        )


def _not_a_member(group, name: str, error=GroupError) -> GroupError:
    """The error for a group this process is not in (``dist.new_group`` returns a placeholder on such ranks)."""
    me = dist.get_rank()
    try:
        ranks = list(dist.get_process_group_ranks(group))
    except Exception:  # noqa: BLE001 - only used to word the error
        ranks = None
    listed = f" (ranks {ranks})" if ranks else ""
    placeholder = group is dist.GroupMember.NON_GROUP_MEMBER
    return error(
        f"rank {me} is not a member of {name}{listed}"
        + (": dist.new_group(ranks=...) returns a placeholder (GroupMember.NON_GROUP_MEMBER), not a ProcessGroup, "
           "on ranks it leaves out" if placeholder else "")
        + (f". Call parallelize only on ranks {ranks}" if ranks else ". Call parallelize only on the group's ranks")
        + f", and give each rank the group it belongs to (dist.new_subgroups(), or mesh['{name[:2]}'] of a DeviceMesh)"
    )


def resolve_group(group, name: str, error=GroupError) -> TPGroup:
    """A ProcessGroup or 1-D DeviceMesh passed as the argument ``name`` (``tp_group``, ``cp_group``), checked
    and registered; ``error``: the exception type to raise."""
    try:
        from torch.distributed.device_mesh import DeviceMesh
    except ImportError:  # pragma: no cover
        DeviceMesh = ()
    sub = name.split("_")[0]
    if DeviceMesh and isinstance(group, DeviceMesh):
        if group.ndim != 1:
            raise error(f"{name} is a {group.ndim}-D DeviceMesh {tuple(group.mesh_dim_names or ())}; pass the 1-D "
                        f"sub-mesh, e.g. mesh['{sub}']")
        group = group.get_group()
    if not dist.is_available() or not dist.is_initialized():
        raise error(f"{name} was given but torch.distributed is not initialized: call dist.init_process_group(...) "
                    "(torchrun does this through the environment) before parallelize")
    if group is dist.GroupMember.NON_GROUP_MEMBER:
        raise _not_a_member(group, name, error)
    if not isinstance(group, dist.ProcessGroup):
        raise error(f"{name} must be a ProcessGroup or a 1-D DeviceMesh, got {type(group).__name__}")
    try:
        rank = dist.get_rank(group)
    except (ValueError, RuntimeError):  # torch raises for a group that does not hold this rank
        rank = -1
    if rank < 0:
        raise _not_a_member(group, name, error)
    return _register(group, rank, dist.get_world_size(group))


def resolve_tp_group(tp_group, planning: bool = False) -> TPGroup:
    """Accept a ProcessGroup, a 1-D DeviceMesh, or a TPGroup; check it is usable.

    ``planning``: a ``fake_group`` (no ProcessGroup: plans only) is accepted only when set; otherwise it
    is refused inside a multi-process job, and outside any when its size exceeds 1 (it cannot load
    rank shards)."""
    if isinstance(tp_group, TPGroup):
        if not planning:
            _refuse_fake(tp_group)
        return tp_group
    if tp_group is None:
        raise GroupError(
            "tp_group is None: pass a torch.distributed ProcessGroup or a 1-D DeviceMesh "
            "(for one process: dist.init_process_group('gloo', world_size=1, rank=0) then dist.group.WORLD)"
        )
    return resolve_group(tp_group, "tp_group")


def fake_group(size: int, rank: int = 0) -> TPGroup:
    """A group that only plans (no collectives run): for plan reports without processes.

    ``parallelize`` refuses it (see ``resolve_tp_group``): pass a real ProcessGroup or DeviceMesh to run."""
    return _register(None, rank, size)
