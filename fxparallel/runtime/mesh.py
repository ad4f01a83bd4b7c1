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
        value, where = given, f"argument {name.split('_')[0].lower()}"
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

    def layout(self) -> dict:
        return {"dp": self.dp, "tp": self.tp, "cp": self.cp}

    def __repr__(self):
        return f"ParallelMesh(dp={self.dp}, tp={self.tp}, cp={self.cp}, rank={self.rank}, device={self.device})"


def init_mesh(tp: Optional[int] = None, dp: Optional[int] = None, cp: Optional[int] = None, *,
              backend: Optional[str] = None, timeout: datetime.timedelta = datetime.timedelta(minutes=10)
              ) -> ParallelMesh:
    """Build the ("dp", "tp", "cp") mesh over every rank (collective: every rank calls it).

    Initializes the process group if needed (NCCL on CUDA, gloo on CPU) and sets the
    CUDA device from ``LOCAL_RANK``. Raises GroupError naming the sizes when the world
    size is not ``tp * dp * cp``.
    """
    from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

    if not dist.is_initialized() and "WORLD_SIZE" in os.environ:
        # check the sizes before starting anything, so a wrong launch fails at once on every rank
        resolve_sizes(int(os.environ["WORLD_SIZE"]), tp, dp, cp)
    backend = _init_process_group(backend, timeout)
    world = dist.get_world_size()
    dp, tp, cp = resolve_sizes(world, tp, dp, cp)
    device_type, _ = device_type_of(process_group_backends(dist.group.WORLD))
    device = rank_cuda_device(dist.group.WORLD, dist.get_rank(), "the job's process group") \
        if device_type == "cuda" else torch.device("cpu")
    mesh = init_device_mesh(device_type, (dp, tp, cp), mesh_dim_names=DIM_NAMES)
    dp_cp = mesh["dp", "cp"]._flatten("dp_cp")
    ranks = mesh.mesh.permute(1, 0, 2).reshape(tp, dp * cp)
    tp_dp = DeviceMesh(device_type, ranks, mesh_dim_names=("tp", "dp_cp"))
    return ParallelMesh(mesh=mesh, dp=dp, tp=tp, cp=cp, device=device, dp_cp_mesh=dp_cp, tp_dp_mesh=tp_dp)
