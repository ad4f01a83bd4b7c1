"""A rank's piece of a parameter, seen as one DTensor of the FULL model tensor.

Composition order is TP then FSDP: ``parallelize`` gives each rank its tensor-parallel
shard (placement ``param._fxparallel.placement``, R or S(d)), then ``fully_shard``
splits that shard over the dp x cp ranks along dim 0 (torch.chunk sizes, like
DTensor's Shard). On the 2-D mesh ("tp", "dp_cp") that is exactly the DTensor with
placements ``(tp placement, Shard(0))``: DTensor applies placements in mesh-dimension
order, tp first, so Shard(0) on both takes the tp block first and then the dp chunk
inside it. (On a ("dp", "tp") mesh the same layout would need a strided shard.) Under HSDP the dp x cp dim
is split into ("dp_replicate", "dp_shard"), placements ``(tp placement, Replicate(), Shard(0))`` (``view_mesh``).

The view shares storage with the local tensor, so DCP loads into it in place.
"""
from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor, Replicate, Shard

from ..load.expert_runs import pieces_in_rows, tp_shard_of_runs
from ..plan.layout import chunked
from ..ops.collectives import gather_full, gather_parts


def tp_placement(plan_param):
    p = plan_param.placement
    if p.segments:
        # a fused weight's shard is one chunk of each of its parts: no single DTensor placement says
        # that; callers go through ``segment_views`` / ``full_tensor`` instead
        raise NotImplementedError(f"{plan_param.name} is a segmented shard {plan_param.placement}")
    refuse_uneven(plan_param)
    return Shard(p.dim) if p.is_shard else Replicate()


def refuse_uneven(plan_param) -> None:
    """DTensor's Shard gives rank r torch.chunk's r-th piece: an uneven split of other sizes (whole heads,
    the first ranks one column more) has no DTensor placement."""
    if getattr(plan_param, "split", ()) and not is_chunk_split(plan_param):
        raise NotImplementedError(
            f"{plan_param.name} is an uneven shard {plan_param.placement} {plan_param.split_text()} (tp does not "
            "divide it); distributed checkpoints and export need even shards or torch.chunk sizes (DTensor's "
            "Shard): choose a tp size that divides the heads, MLP width and vocabulary"
        )


def is_chunk_split(plan_param) -> bool:
    """An uneven plain shard whose per-rank sizes are torch.chunk's (learned position tables)."""
    p = plan_param.placement
    split = getattr(plan_param, "split", ())
    return (len(split) == 1 and not p.segments and p.is_shard
            and tuple(split[0]) == chunked(plan_param.shape[p.dim], len(split[0])))


def segments_of(plan_param):
    """The segment sizes of a fused weight's shard (q, k, v / gate, up), or None."""
    return plan_param.placement.segments


def dp_placement(tensor):
    """How FSDP laid ``tensor`` out over dp x cp: Shard(0), or Replicate (no FSDP, replicate mode)."""
    return Replicate() if fsdp_mesh_dim(tensor) is None else Shard(0)


def view_mesh(tensor, mesh) -> tuple:
    """(mesh, placements after the tp one) on which ``tensor`` (this rank's TP shard, maybe an FSDP DTensor) is
    described as a DTensor of the full model shape: ("tp", "dp_cp") with ``dp_placement``; under HSDP (FSDP's
    mesh 2-D, several replicas of each shard group: ``DP_SHARD_SIZE``) ("tp", "dp_replicate", "dp_shard") with
    (Replicate, Shard(0))."""
    if isinstance(tensor, DTensor) and tensor.device_mesh.ndim == 2 and fsdp_mesh_dim(tensor) is not None:
        return mesh.unflattened("tp_dp", tensor.device_mesh.size(0)), (Replicate(), Shard(0))
    return mesh.tp_dp_mesh, (dp_placement(tensor),)


def first_replica(tensor, mesh) -> bool:
    """Whether this rank holds the first copy of its piece of ``tensor`` over dp x cp (the one a sum over the ranks
    counts): every rank for FSDP's shards, the first of each shard's replicas under HSDP, dp x cp rank 0 where the
    piece is the same on every dp x cp rank (replicate mode, or no FSDP)."""
    if not isinstance(tensor, DTensor):
        return mesh.dp_cp_rank == 0
    return all(tensor.device_mesh.get_local_rank(dim) == 0
               for dim, (size, placement) in enumerate(zip(tensor.device_mesh.shape, tensor.placements))
               if size > 1 and not isinstance(placement, Shard))


def fsdp_mesh_dim(tensor):
    """The dim of its device mesh over which FSDP splits ``tensor``'s dim 0, or None (not split)."""
    if isinstance(tensor, DTensor):
        for dim, (size, placement) in enumerate(zip(tensor.device_mesh.shape, tensor.placements)):
            if isinstance(placement, Shard) and size > 1:
                if placement.dim != 0:
                    raise NotImplementedError(f"FSDP sharding on dim {placement.dim}; only dim 0 is supported")
                return dim
    return None


def local_part(tensor) -> torch.Tensor:
    return tensor._local_tensor if isinstance(tensor, DTensor) else tensor


def global_view(tensor, plan_param, mesh) -> DTensor:
    """``tensor`` (this rank's TP shard, maybe an FSDP DTensor over dp x cp) as a DTensor of
    the full model shape ``plan_param.shape`` on ``mesh.tp_dp_mesh`` (``view_mesh``)."""
    full = tuple(plan_param.shape)
    tp = tp_placement(plan_param)  # refuses what DTensor cannot describe (fused, uneven) first
    tp_shard = tuple(plan_param.local_shape(mesh.tp, mesh.tp_rank))
    if tuple(tensor.shape) != tp_shard:  # a DTensor's shape is its shape over dp x cp: the TP shard
        raise ValueError(f"{plan_param.name}: tensor of shape {tuple(tensor.shape)} is not its tp={mesh.tp} "
                         f"shard {tp_shard}")
    on, dp = view_mesh(tensor, mesh)
    return DTensor.from_local(local_part(tensor), on, (tp, *dp), run_check=False,
                              shape=torch.Size(full), stride=contiguous_stride(full))


def segment_views(tensor, plan_param, mesh) -> dict:
    """A fused weight as one view per segment (each of its own full shape, split over tp like a plain
    shard), so any tp size loads it: {segment index: view}. Each is a view of this rank's own storage,
    so DCP writes and loads the parameter (or optimizer state) itself, nothing copied.

    Segments along a dim other than 0 (GPT-2's Conv1D, stacked experts' gate / up), or no FSDP: each
    segment's piece of the tensor (of FSDP's dim-0 chunk) is a DTensor, split over dp x cp by dim 0 as
    FSDP splits it. Segments along dim 0 under FSDP (Phi-3's qkv_proj), which FSDP's chunk of the TP
    shard can straddle: each segment's rows in the chunk, described to DCP piece by piece
    (``_row_pieces``)."""
    refuse_uneven(plan_param)
    p = plan_param.placement
    on, dp = view_mesh(tensor, mesh)
    tensor = tensor.detach()
    if p.dim == 0 and isinstance(dp[-1], Shard):
        return _row_pieces(tensor, plan_param, mesh)
    local = local_part(tensor)  # FSDP's chunk (split on dim 0, not across the segments), or the TP shard
    views, offset = {}, 0
    for i, size in enumerate(p.local_parts(lambda seg: seg // mesh.tp)):
        shape = list(plan_param.shape)
        shape[p.dim] = p.segments[i]
        piece = local.narrow(p.dim, offset, size)
        tp = Replicate() if i in p.whole else Shard(p.dim)  # a whole segment: the same on every tp rank
        views[i] = DTensor.from_local(piece, on, (tp, *dp), run_check=False,
                                      shape=torch.Size(shape), stride=contiguous_stride(tuple(shape)))
        offset += size
    return views


def _row_pieces(tensor: DTensor, plan_param, mesh) -> dict:
    """{segment index: its rows in this rank's FSDP chunk}, for segments split along dim 0, which that chunk
    of the TP shard can straddle: each a view of the chunk that tells DCP which rows of its segment it holds
    (``dcp_state.describe_pieces``; none where the chunk holds no row of it), so DCP writes and loads the
    chunk in place."""
    from ..dcp_state import describe_pieces

    local = local_part(tensor)
    start, stop = fsdp_rows(tensor, plan_param.local_shape(mesh.tp, mesh.tp_rank)[0])
    if local.shape[0] != stop - start:
        raise ValueError(f"{plan_param.name}: FSDP's chunk holds {local.shape[0]} rows where torch.chunk's rows "
                         f"[{start}, {stop}) of the tp shard were expected")
    views, segment_start = {}, 0
    pieces = plan_param.pieces(mesh.tp_rank, mesh.tp)  # one per segment, in order
    for i, (segment, piece) in enumerate(zip(plan_param.placement.segments, pieces)):
        shape = torch.Size([segment, *plan_param.shape[1:]])
        described, view = [], local[:0]
        for src, dst in pieces_in_rows([piece], start, stop):  # its rows in the chunk, at most one piece
            view = local[dst]
            offsets = torch.Size([src[0].start - segment_start] + [0] * (len(shape) - 1))
            described.append((offsets, torch.Size([src[0].stop - src[0].start, *shape[1:]]), view))
        describe_pieces(view, described, shape)
        views[i] = view
        segment_start += segment
    return views


def fsdp_rows(tensor, rows: int) -> tuple:
    """[start, stop) of the rows of the TP shard (``rows`` of them) in this rank's FSDP chunk (torch.chunk's)."""
    dim = fsdp_mesh_dim(tensor)
    if dim is None:
        return 0, rows
    mesh = tensor.device_mesh
    size = -(-rows // mesh.size(dim))
    start = min(mesh.get_local_rank(dim) * size, rows)
    return start, min(start + size, rows)


def fsdp_chunk(shard: torch.Tensor, like: DTensor) -> DTensor:
    """``shard`` (this rank's whole TP shard of a parameter) as FSDP holds it in ``like``: its chunk of the rows,
    a DTensor on ``like``'s mesh and placements (``nn.Module.load_state_dict`` copies it into ``like`` locally)."""
    start, stop = fsdp_rows(like, like.shape[0])
    local = shard[start:stop].to(device=like.to_local().device)
    return DTensor.from_local(local, like.device_mesh, like.placements, run_check=False, shape=like.shape,
                              stride=like.stride())


def tp_of(mesh) -> tuple:
    """(size, process group) of the tensor-parallel dimension of ``mesh``: a ParallelMesh, or a
    model's TPGroup (``model.tp_group``: a model without a training mesh)."""
    if hasattr(mesh, "tp_mesh"):
        return mesh.tp, (mesh.tp_mesh.get_group() if mesh.tp > 1 else None)
    return mesh.size, mesh.process_group


def full_tensor(tensor, plan_param, mesh) -> torch.Tensor:
    """The complete model tensor on every rank: all-gather over dp x cp (an FSDP DTensor, over its
    own mesh), then over tp (``mesh``: a ParallelMesh or the model's TPGroup, see ``tp_of``).

    Any tensor-parallel layout: plain and uneven shards, fused weights split by segment (each
    rank's piece of every segment put back in place), segments held whole by every rank. (Only
    DCP checkpoints need DTensor placements, which uneven shards lack: ``refuse_uneven``.) An expert-run parameter
    (experts over dp ranks) is first all-gathered over its ep group."""
    if getattr(tensor, "_fxparallel_expert_run", None):
        tensor = tp_shard_of_runs(tensor)
    tensor = tensor.detach()
    if isinstance(tensor, DTensor):
        tensor = tensor.full_tensor()  # this rank's whole TP shard
    tp, group = tp_of(mesh)
    p = plan_param.placement
    if not p.is_shard or tp == 1:
        return tensor
    sizes = [plan_param.local_shape(tp, r)[p.dim] for r in range(tp)]
    sizes = sizes if len(set(sizes)) > 1 else None
    if not p.segments:  # each rank's rows follow the previous rank's: the gathered buffer itself, where it can be
        return gather_full(tensor, p.dim, group, tp, sizes)
    parts = gather_parts(tensor, p.dim, group, tp, sizes)
    full = tensor.new_empty(tuple(plan_param.shape))
    for rank, part in enumerate(parts):
        for src, dst in plan_param.pieces(rank, tp):  # a whole segment: the same on every rank
            full[src] = part[dst]
    return full


def contiguous_stride(shape: tuple) -> tuple:
    """The strides of a contiguous tensor of ``shape``."""
    stride, acc = [], 1
    for s in reversed(shape):
        stride.append(acc)
        acc *= s
    return tuple(reversed(stride))
