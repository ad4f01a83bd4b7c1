"""The tensor-parallel group: validation, a handle the rewritten graph can name, and the device
its ranks run on.

Graph code cannot hold a ProcessGroup as a literal, so each group is registered
once and the graph refers to it by a small integer.

The device (``choose_device``): a group whose CUDA tensors go over NCCL ("nccl",
"cpu:gloo,cuda:nccl" as torchtitan and vLLM create it, or ``init_process_group()`` without a
backend on a GPU machine), or that takes CUDA tensors only ("cuda:gloo"), runs on CUDA; any other
(gloo) on the CPU. The CUDA device of a rank follows ``LOCAL_RANK`` (torchrun's; else an MPI or
Slurm launcher's local rank, else the global rank) modulo the visible devices, as torchtitan
chooses it, and is made the current device (``torch.cuda.set_device``) whatever was current before,
since NCCL's object collectives and barriers run on the current device. A device bound to the group
(``init_process_group(device_id=...)``) or passed as ``device=`` is kept.
"""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Mapping, Optional

import torch
import torch.distributed as dist

from .errors import GroupError

log = logging.getLogger("fxparallel")

_GROUPS: dict[int, "TPGroup"] = {}
_MESHES: dict[int, object] = {}  # handle -> the 1-D DeviceMesh a group was given as (its root names the other dims)


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
        mesh, group = group, group.get_group()
    else:
        mesh = None
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
    registered = _register(group, rank, dist.get_world_size(group))
    if mesh is not None:
        _MESHES.setdefault(registered.handle, mesh)
    return registered


def given_mesh(group: TPGroup):
    """The 1-D DeviceMesh ``group`` was given as (None for a ProcessGroup): its root mesh holds the job's other
    dimensions (the data-parallel dim of ``trainer_data_parallel.view_mesh``)."""
    return _MESHES.get(group.handle)


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


# ---- the device of a rank ------------------------------------------------------------------------

# the rank within the node as launchers give it, the first one set wins: torchrun, Open MPI, MPICH /
# Intel MPI, MVAPICH, Slurm's srun
LOCAL_RANK_VARIABLES = ("LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID", "MV2_COMM_WORLD_LOCAL_RANK",
                        "SLURM_LOCALID")
# torch's defaults where a description names no device (torch.distributed.Backend's tables, in case they move)
_DEFAULT_BACKEND = {"cpu": "gloo", "cuda": "nccl", "xpu": "xccl", "mps": "gloo"}
_CAPABILITY = {"gloo": ("cpu", "cuda"), "nccl": ("cuda",), "xccl": ("xpu",), "ucc": ("cpu", "cuda"),
               "mpi": ("cpu", "cuda")}


def device_backends(description, accelerator: Optional[str] = None) -> dict:
    """{device type: backend} of a process group from torch's description of it: ``dist.get_backend_config``'s
    "cpu:gloo,cuda:nccl" (also what ``init_process_group("cpu:gloo,cuda:nccl")`` was given), or one backend name
    ("nccl", "gloo": the device types torch gives it), or "undefined" / "" (``init_process_group()`` without a
    backend: torch's default backend for ``accelerator``, the machine's, e.g. "cuda"; None: the CPU). Pure."""
    text = str(description if description is not None else "").strip().lower()
    if ":" in text:
        found = {}
        for pair in text.split(","):
            device, _, backend = pair.strip().partition(":")
            if device.strip():
                found[device.strip()] = backend.strip()
        return found
    if text in ("", "undefined"):
        kind = accelerator or "cpu"
        default = getattr(dist, "Backend", None)
        table = getattr(default, "default_device_backend_map", None) or _DEFAULT_BACKEND
        return {kind: str(table.get(kind, _DEFAULT_BACKEND.get(kind, "gloo")))}
    capability = getattr(getattr(dist, "Backend", None), "backend_capability", None) or {}
    return dict.fromkeys(capability.get(text) or _CAPABILITY.get(text, ("cpu", "cuda")), text)


def device_type_of(backends: Mapping) -> tuple:
    """(device type, NCCL) for a group with ``backends`` ({device type: backend}, see ``device_backends``):
    ("cuda", True) where its CUDA tensors go over NCCL (a CPU backend beside it, as in "cpu:gloo,cuda:nccl",
    serves object collectives only), ("cuda", False) for a group that takes CUDA tensors only ("cuda:gloo":
    ranks may share a device), else ("cpu", False) (gloo, which takes both, stays on the CPU). Pure."""
    cuda = backends.get("cuda")
    if cuda == "nccl":
        return "cuda", True
    if cuda is not None and "cpu" not in backends:
        return "cuda", False
    return "cpu", False


def process_group_backends(pg) -> dict:
    """{device type: backend} of the ProcessGroup ``pg``, from torch's own record of it
    (``dist.get_backend_config``), else from the backends the group holds per device type."""
    try:
        found = device_backends(dist.get_backend_config(pg))
    except Exception:  # noqa: BLE001 - a group torch has no config for: ask the group itself
        found = {}
    if found:
        return found
    for device in getattr(pg, "_device_types", ()) or ():
        try:
            name = type(pg._get_backend(device)).__name__.lower()  # ProcessGroupNCCL, ProcessGroupGloo
        except Exception:  # noqa: BLE001 - no backend for that device
            continue
        found[device.type] = next((b for b in ("nccl", "gloo", "ucc", "mpi", "xccl") if b in name), name)
    if found:
        return found
    try:
        accelerator = torch._C._get_accelerator().type
    except Exception:  # noqa: BLE001 - older torch
        accelerator = "cuda" if torch.cuda.is_available() else None
    return device_backends(str(dist.get_backend(pg)), accelerator)


def describe_backends(backends: Mapping) -> str:
    return ",".join(f"{d}:{b}" for d, b in backends.items()) or "no backend"


def local_rank_from(env: Mapping) -> tuple:
    """(rank within the node, the variable it came from), or (None, None) where no launcher set one. Pure."""
    for name in LOCAL_RANK_VARIABLES:
        value = str(env.get(name, "")).strip()
        if value.isdigit():
            return int(value), name
    return None, None


def cuda_index(count: int, env: Mapping, rank: int, bound: Optional[int] = None) -> tuple:
    """(CUDA device index of this rank, why) among ``count`` visible devices: ``bound`` (the group's device,
    ``init_process_group(device_id=...)``) where given, else the local rank (``local_rank_from(env)``) modulo
    ``count`` (as torchtitan: a launcher that shows each process one device, CUDA_VISIBLE_DEVICES, gives
    index 0), else the global ``rank`` modulo ``count``. Pure."""
    if bound is not None:
        return int(bound), "the device bound to the process group (init_process_group(device_id=...))"
    if count < 1:
        raise GroupError("no CUDA device is visible to this process (torch.cuda.device_count() is 0)")
    local, name = local_rank_from(env)
    if local is not None:
        return local % count, f"{name}={local}" + (f" modulo {count} visible devices" if local >= count else "")
    return rank % count, f"global rank {rank} modulo {count} visible devices (no LOCAL_RANK)"


def _bound_device(pg) -> Optional[int]:
    """The CUDA device index bound to ``pg`` or the default group (``init_process_group(device_id=...)``)."""
    groups = [pg]
    try:
        groups.append(dist.group.WORLD)
    except Exception:  # noqa: BLE001
        pass
    for g in groups:
        device = getattr(g, "bound_device_id", None) if g is not None else None
        if isinstance(device, torch.device) and device.type == "cuda" and device.index is not None:
            return device.index
    return None


def _set_cuda_device(index: int, why: str) -> None:
    before = torch.cuda.current_device() if torch.cuda.is_initialized() else None
    torch.cuda.set_device(index)
    if before is not None and before != index:
        log.info("parallelize: using cuda:%d (%s) instead of the current device cuda:%d; pass device= to choose",
                 index, why, before)


def choose_device(group: TPGroup, requested=None) -> torch.device:
    """The device of this rank's shards and collectives: ``requested`` (``parallelize``'s ``device=``) where
    given ("cuda" without an index gets this rank's index), else from the group's backends (see the module's
    docstring). A CUDA device is made the current one (``torch.cuda.set_device``)."""
    pg = group.process_group
    kind, _ = ("cpu", False) if pg is None else device_type_of(process_group_backends(pg))
    if requested is not None:
        device = torch.device(requested)
        if device.type != "cuda":
            return device
        kind = "cuda"
        if device.index is not None:
            _set_cuda_device(device.index, "device= given to parallelize")
            return device
    if kind != "cuda":
        return torch.device("cpu")
    rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else group.rank
    return rank_cuda_device(pg, rank, "the tp group")


def rank_cuda_device(pg, rank: int, what: str) -> torch.device:
    """This rank's CUDA device for the process group ``pg`` (see ``cuda_index``), made the current one."""
    if not torch.cuda.is_available() or torch.cuda.device_count() < 1:
        raise GroupError(f"{what} runs CUDA tensors (backend {describe_backends(process_group_backends(pg))}) "
                         "but no CUDA device is visible to this process: use a gloo group on CPU, or check "
                         "CUDA_VISIBLE_DEVICES and the driver")
    index, why = cuda_index(torch.cuda.device_count(), os.environ, rank, _bound_device(pg))
    _set_cuda_device(index, why)
    return torch.device("cuda", index)


def uses_nccl(group: TPGroup) -> bool:
    """Whether the group's CUDA tensors go over NCCL (one CUDA device per rank)."""
    return group.process_group is not None and device_type_of(process_group_backends(group.process_group))[1]


def shared_devices(entries, global_ranks=None, name: str = "tp_group") -> Optional[str]:
    """The error where two ranks of one host are on one CUDA device, else None. ``entries``: [host, CUDA
    device index or None (not on CUDA)] of each rank of the group, in group-rank order (lists or tuples: the
    values ``exchange`` returns); ``global_ranks``: the group's global ranks, for the message. Pure."""
    on = {}
    for rank, entry in enumerate(entries):
        host, index = entry
        if index is not None:
            on.setdefault((str(host), int(index)), []).append(rank)
    clashes = [(host, index, ranks) for (host, index), ranks in on.items() if len(ranks) > 1]
    if not clashes:
        return None

    def who(ranks):
        names = [f"{r} (global rank {global_ranks[r]})" if global_ranks and global_ranks[r] != r else str(r)
                 for r in ranks]
        return ", ".join(names[:-1]) + " and " + names[-1]

    listing = "; ".join(f"ranks {who(ranks)} of {name} are all on cuda:{index} of host {host!r}"
                        for host, index, ranks in clashes)
    return (f"{listing}. The group's backend is NCCL, which needs one CUDA device per rank (ranks sharing one fail "
            "or hang in their first collective). parallelize puts each rank on LOCAL_RANK modulo the visible "
            "devices: start at most as many processes per host as it has GPUs (torchrun --nproc_per_node), do not "
            "narrow CUDA_VISIBLE_DEVICES to fewer devices than processes, or pass a distinct device= on each rank. "
            "To share one GPU between ranks on purpose (tests), create the group with the backend 'cuda:gloo'")
