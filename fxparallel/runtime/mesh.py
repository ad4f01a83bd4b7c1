"""The ("dp", "tp", "cp") device mesh of a training job, and the sub-meshes the runtime uses.

Sizes come from arguments, else from the ``TP_SIZE``, ``DP_SIZE`` and ``CP_SIZE``
environment variables (``TP_SIZE`` and ``CP_SIZE`` default to 1, ``DP_SIZE`` to
whatever fills the world). Rank ``r`` sits at mesh coordinate
``(r // (tp*cp), (r // cp) % tp, r % cp)``: the ranks of one context-parallel group are
adjacent, and those of one tensor-parallel group sit cp apart (adjacent when cp == 1, then on
one node when tp <= GPUs per node; with cp > 1, one node must hold tp * cp GPUs for that).

Sub-meshes:

* ``tp_mesh`` (1-D): give it to ``fxparallel.parallelize``.
* ``cp_mesh`` (1-D): its ``cp_group`` (context parallelism; the ranks of one dp group
  and tp position that share the sequences).
* ``dp_cp_mesh`` (1-D, dp x cp flattened): gradients are reduced over it and FSDP
  shards over it. Context-parallel ranks hold the same parameters and see
  different tokens of the same sequences, so for gradients they are data
  parallel; with ``cp == 1`` it is the dp mesh.
* ``tp_dp_mesh`` (2-D, ("tp", "dp_cp")): the mesh on which checkpoints and exports
  describe a parameter as one DTensor of the full model's shape (tp first, because
  FSDP shards the tensor-parallel shard; see ``runtime/dtensor.py``).
* ``dp_shard`` (``DP_SHARD_SIZE``, default dp): FSDP shards over that many dp ranks (times cp) and replicates
  over ``dp // dp_shard`` of them: HSDP, as accelerate's ``dp_shard_size`` / ``dp_replicate_size``. The ranks of
  one shard group are adjacent dp indices (dp index ``d`` is replica ``d // dp_shard``, shard ``d % dp_shard``),
  so a node holds whole shard groups when it holds ``dp_shard * tp * cp`` GPUs.
* ``ep_mesh`` (1-D, with ``ep`` > 1, ``EP_SIZE``): experts over data-parallel ranks, carved from dp as
  torchtitan carves it: dp index ``d`` is ``(d // ep, d % ep)``, and the ``ep`` ranks of one dp block and tp
  position each hold a run of the experts and exchange rows (give it to ``parallelize(..., ep_group=)``).
  ``expert_dp_mesh`` (1-D): the ranks holding the same run (the other dp blocks, and the cp ranks, which see other
  chunks of the same sequences): the experts' gradients are summed over it.
"""
from __future__ import annotations

import datetime
import os
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist

from ..errors import GroupError
from ..group import device_type_of, process_group_backends, rank_cuda_device

DIM_NAMES = ("dp", "tp", "cp")


def world_size_error(world: int, tp: int, dp: int, cp: int) -> Optional[str]:
    """The error message when ``world != tp * dp * cp`` (None when it is right)."""
    if world == tp * dp * cp:
        return None
    return f"World size ({world}) must equal TP size ({tp}) * DP size ({dp}) * CP size ({cp})"


def _env_size(name: str, given: Optional[int]) -> Optional[int]:
    if given is not None:
        value, where = given, f"argument {name.rsplit('_', 1)[0].lower()}"
    elif os.environ.get(name, "").strip():
        raw = os.environ[name].strip()
        try:
            value = int(raw)
        except ValueError:
            raise GroupError(f"environment variable {name}={raw!r} is not an integer") from None
        where = f"environment variable {name}"
    else:
        return None
    if value < 1:
        raise GroupError(f"{where} must be >= 1, got {value}")
    return value


def resolve_sizes(world: int, tp: Optional[int] = None, dp: Optional[int] = None,
                  cp: Optional[int] = None) -> tuple:
    """(dp, tp, cp) from arguments, then environment, then defaults; checked against ``world``."""
    tp = _env_size("TP_SIZE", tp) or 1
    cp = _env_size("CP_SIZE", cp) or 1
    dp = _env_size("DP_SIZE", dp)
    if dp is None:
        dp = max(world // (tp * cp), 1)
    message = world_size_error(world, tp, dp, cp)
    if message:
        raise GroupError(message)
    return dp, tp, cp


def _init_process_group(backend: Optional[str], timeout: datetime.timedelta) -> str:
    """Initialize torch.distributed from the torchrun environment if it is not yet; returns the backend."""
    use_cuda = torch.cuda.is_available()
    if use_cuda and "LOCAL_RANK" in os.environ:
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    if not dist.is_initialized():
        missing = [v for v in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if v not in os.environ]
        if missing:
            raise GroupError(
                f"torch.distributed is not initialized and the environment lacks {', '.join(missing)}: launch with "
                "torchrun (e.g. TP_SIZE=2 DP_SIZE=2 torchrun --nproc_per_node=4 script.py) or call "
                "dist.init_process_group first"
            )
        dist.init_process_group(backend or ("nccl" if use_cuda else "gloo"), timeout=timeout)
    return dist.get_backend()


@dataclass
class ParallelMesh:
    """The job's mesh and its sub-meshes; see the module docstring."""

    mesh: object  # 3-D DeviceMesh ("dp", "tp", "cp")
    dp: int
    tp: int
    cp: int
    device: torch.device
    dp_cp_mesh: object  # 1-D DeviceMesh
    tp_dp_mesh: object  # 2-D DeviceMesh ("tp", "dp_cp")
    ep: int = 1
    ep_mesh: object = None  # 1-D DeviceMesh (ep > 1)
    expert_dp_mesh: object = None  # 1-D DeviceMesh (ep > 1)
    dp_shard: Optional[int] = None  # FSDP's shard group within dp (HSDP below dp; None: all of dp)

    def __post_init__(self):
        self.dp_shard = self.dp_shard or self.dp
        self._unflattened = {}

    @property
    def dp_replicate(self) -> int:
        """How many replicas FSDP keeps of each shard (1: plain FSDP; > 1: HSDP)."""
        return self.dp // self.dp_shard

    def unflattened(self, which: str, replicas: int):
        """``dp_cp_mesh`` ("dp_cp") or ``tp_dp_mesh`` ("tp_dp") with its dp x cp dim split into (``replicas``, the
        rest): FSDP's mesh for HSDP (or replication), and the mesh its DTensors are described on; made once."""
        key = (which, replicas)
        if key not in self._unflattened:
            base = self.dp_cp_mesh if which == "dp_cp" else self.tp_dp_mesh
            self._unflattened[key] = base._unflatten(base.ndim - 1, (replicas, self.dp_cp_size // replicas),
                                                     ("dp_replicate", "dp_shard"))
        return self._unflattened[key]

    @property
    def tp_mesh(self):
        return self.mesh["tp"]

    @property
    def cp_mesh(self):
        """1-D: give it to ``fxparallel.parallelize(..., cp_group=mesh.cp_mesh)``."""
        return self.mesh["cp"]

    @property
    def world_size(self) -> int:
        return self.dp * self.tp * self.cp

    @property
    def rank(self) -> int:
        return dist.get_rank()

    @property
    def dp_rank(self) -> int:
        return self.mesh.get_local_rank("dp")

    @property
    def tp_rank(self) -> int:
        return self.mesh.get_local_rank("tp")

    @property
    def cp_rank(self) -> int:
        return self.mesh.get_local_rank("cp")

    @property
    def dp_cp_rank(self) -> int:
        return self.dp_rank * self.cp + self.cp_rank

    @property
    def dp_cp_size(self) -> int:
        return self.dp * self.cp

    @property
    def dp_cp_group(self):
        return self.dp_cp_mesh.get_group()

    @property
    def ep_rank(self) -> int:
        """This rank's place in its expert-parallel group (0 without ep)."""
        return self.ep_mesh.get_local_rank() if self.ep_mesh is not None else 0

    @property
    def expert_dp_rank(self) -> int:
        """This rank's place among the ranks holding the same experts (0 without ep)."""
        return self.expert_dp_mesh.get_local_rank() if self.expert_dp_mesh is not None else self.dp_cp_rank

    @property
    def expert_dp_size(self) -> int:
        return self.dp_cp_size // self.ep

    def layout(self) -> dict:
        return {"dp": self.dp, "tp": self.tp, "cp": self.cp, **({"ep": self.ep} if self.ep > 1 else {}),
                **({"dp_shard": self.dp_shard} if self.dp_shard < self.dp else {})}

    def __repr__(self):
        ep = f", ep={self.ep}" if self.ep > 1 else ""
        shard = f", dp_shard={self.dp_shard}" if self.dp_shard < self.dp else ""
        return (f"ParallelMesh(dp={self.dp}{shard}{ep}, tp={self.tp}, cp={self.cp}, rank={self.rank}, "
                f"device={self.device})")


def init_mesh(tp: Optional[int] = None, dp: Optional[int] = None, cp: Optional[int] = None, *,
              ep: Optional[int] = None, dp_shard: Optional[int] = None, backend: Optional[str] = None,
              timeout: datetime.timedelta = datetime.timedelta(minutes=10)) -> ParallelMesh:
    """Build the ("dp", "tp", "cp") mesh over every rank (collective: every rank calls it).

    Initializes the process group if needed (NCCL on CUDA, gloo on CPU) and sets the
    CUDA device from ``LOCAL_RANK``. Raises GroupError naming the sizes when the world
    size is not ``tp * dp * cp``. ``ep`` (else ``EP_SIZE``, default 1): experts over that many of the dp
    ranks (it must divide dp; ``ep_mesh``). ``dp_shard`` (else ``DP_SHARD_SIZE``, default dp): FSDP shards over
    that many of the dp ranks and replicates over the rest (HSDP; it must divide dp).
    """
    from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

    ep = _env_size("EP_SIZE", ep) or 1
    dp_shard = _env_size("DP_SHARD_SIZE", dp_shard)
    if not dist.is_initialized() and "WORLD_SIZE" in os.environ:
        # check the sizes before starting anything, so a wrong launch fails at once on every rank
        _check_dp_parts(ep, dp_shard, resolve_sizes(int(os.environ["WORLD_SIZE"]), tp, dp, cp)[0])
    backend = _init_process_group(backend, timeout)
    world = dist.get_world_size()
    dp, tp, cp = resolve_sizes(world, tp, dp, cp)
    _check_dp_parts(ep, dp_shard, dp)
    device_type, _ = device_type_of(process_group_backends(dist.group.WORLD))
    device = rank_cuda_device(dist.group.WORLD, dist.get_rank(), "the job's process group") \
        if device_type == "cuda" else torch.device("cpu")
    mesh = init_device_mesh(device_type, (dp, tp, cp), mesh_dim_names=DIM_NAMES)
    dp_cp = mesh["dp", "cp"]._flatten("dp_cp")
    ranks = mesh.mesh.permute(1, 0, 2).reshape(tp, dp * cp)
    tp_dp = DeviceMesh(device_type, ranks, mesh_dim_names=("tp", "dp_cp"))
    ep_mesh = expert_dp = None
    if ep > 1:  # dp index d = (d // ep, d % ep): ep groups vary d % ep; the same run varies d // ep and cp
        blocks = mesh.mesh.reshape(dp // ep, ep, tp, cp)
        ep_mesh = DeviceMesh(device_type, blocks.permute(0, 2, 3, 1).reshape(-1, ep),
                             mesh_dim_names=("ep_rows", "ep"))["ep"]
        expert_dp = DeviceMesh(device_type, blocks.permute(1, 2, 0, 3).reshape(-1, dp // ep * cp),
                               mesh_dim_names=("expert_rows", "expert_dp"))["expert_dp"]
    return ParallelMesh(mesh=mesh, dp=dp, tp=tp, cp=cp, device=device, dp_cp_mesh=dp_cp, tp_dp_mesh=tp_dp,
                        ep=ep, ep_mesh=ep_mesh, expert_dp_mesh=expert_dp, dp_shard=dp_shard)


def _check_dp_parts(ep: int, dp_shard: Optional[int], dp: int) -> None:
    """Refuse experts over ``ep`` of the ``dp`` ranks, or FSDP shard groups of ``dp_shard`` of them, where that
    size does not divide ``dp``."""
    if ep > 1 and dp % ep:
        raise GroupError(f"EP size ({ep}) must divide DP size ({dp}): the expert-parallel ranks are carved from the "
                         "dp ranks")
    if dp_shard is not None and dp % dp_shard:
        raise GroupError(f"DP_SHARD size ({dp_shard}) must divide DP size ({dp}): FSDP shards over groups of that "
                         "many dp ranks and replicates over the groups (HSDP)")
