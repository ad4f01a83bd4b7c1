"""``model.state_dict()`` handed to torch.distributed.checkpoint, as users do by habit.

``state_dict()`` holds this rank's shards under the full Hugging Face names (nn.Module's contract,
kept). Handed to ``dcp.save`` as they are, DCP would take every rank's shard for the whole tensor
and keep one (a checkpoint that "loads" with wrong weights). So each sharded value carries DCP's
own checkpointable protocol, the one DTensor implements (``__create_write_items__``,
``__create_chunk_list__``, ``__get_tensor_shard__``, and ``size()``, which answers the full size as a
DTensor's does, while ``.shape`` stays the shard's): it describes the pieces of the full tensor
the shard holds (``ParamPlan.pieces``: one slice, or one per part of a fused weight, uneven splits
included). DCP then saves full-shape tensors, each rank its pieces, and ``dcp.load`` into the
``state_dict()`` of a model parallelized at any tp size (or a transformers model) reads exactly
the pieces each rank holds, in place. ``torch.save`` of the state dict (a file per rank) still pickles each
value as the plain shard it is. ``dcp_optimizer.py`` does the same for a torch optimizer's state. With experts spread
over data-parallel ranks (``ep_group``) a rank holds a run of its tp shard's experts: the pieces of that run
(``load/expert_runs.pieces_in_run``), at any tp, tp = 1 included.

Under FSDP (``runtime.apply_data_parallel``) a value is FSDP's DTensor over the data-parallel ranks of
this rank's tensor-parallel shard, whose own protocol would describe the shard as the whole tensor: it is
described instead as the pieces of the full tensor that its chunk (rows of the shard) holds. accelerate's calls, which write one
process's state dict for the whole model, take complete tensors or are refused (``accelerate_state.py``), and so do
torch's state-dict helpers asked for the full state dict (``dcp_full_state.py``)."""
from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor

from .accelerate_state import complete_for_accelerate
from .dcp_full_state import complete_state_dict, full_state_dict_requested
from .errors import CheckpointError
from .load.expert_runs import pieces_in_rows, pieces_in_run


def _pieces(tensor: torch.Tensor, plan, rank: int, tp: int, run=None, rows=None) -> list:
    """[(offsets in the full tensor, sizes, view of ``tensor``)] of this rank's pieces (of its run of experts, where
    ``run`` says it holds one: ``load/expert_runs.py``; of rows [start, stop) of its shard, where ``rows`` says
    ``tensor`` holds only those: FSDP's chunk, ``runtime/dtensor.fsdp_rows``)."""
    out = []
    pieces = plan.pieces(rank, tp)
    if run is not None:
        pieces = pieces_in_run(pieces, run)
    if rows is not None:
        pieces = pieces_in_rows(pieces, *rows)
    local = tensor.to_local() if isinstance(tensor, DTensor) else tensor  # FSDP's DTensor: its chunk's storage
    for src, dst in pieces:
        offsets = torch.Size(s.start for s in src)
        sizes = torch.Size(s.stop - s.start for s in src)
        out.append((offsets, sizes, local[dst]))
    return out


def describe(tensor: torch.Tensor, plan, rank: int, tp: int, run=None, rows=None) -> None:
    """Give ``tensor`` (this rank's shard of ``plan``'s parameter, or its run of experts, or FSDP's ``rows`` of
    the shard) DCP's checkpointable protocol."""
    describe_pieces(tensor, _pieces(tensor, plan, rank, tp, run, rows), torch.Size(plan.shape))


def describe_pieces(tensor: torch.Tensor, pieces: list, full: torch.Size) -> None:
    """Give ``tensor`` DCP's checkpointable protocol: it holds ``pieces`` ([(offsets, sizes, view of tensor)],
    maybe none) of a tensor of shape ``full``."""
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
    from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

    def create_write_items(fqn, _obj):
        return [WriteItem(index=MetadataIndex(fqn, offsets, i), type=WriteItemType.SHARD,
                          tensor_data=TensorWriteData(chunk=ChunkStorageMetadata(offsets=offsets, sizes=sizes),
                                                      properties=TensorProperties.create_from_tensor(tensor), size=full))
                for i, (offsets, sizes, _) in enumerate(pieces)]

    def create_chunk_list():
        return [ChunkStorageMetadata(offsets=offsets, sizes=sizes) for offsets, sizes, _ in pieces]

    def get_tensor_shard(index):
        for offsets, _, view in pieces:
            if index.offset == offsets:
                return view
        raise ValueError(f"{index.fqn}: this rank holds no piece at offset {tuple(index.offset or ())} "
                         f"(its pieces start at {[tuple(o) for o, _, _ in pieces]})")

    def size(dim=None):  # the full tensor's, as a DTensor answers (DCP's load compares it with the saved size)
        return full if dim is None else full[dim]

    tensor.__create_write_items__ = create_write_items
    tensor.__create_chunk_list__ = create_chunk_list
    tensor.__get_tensor_shard__ = get_tensor_shard
    tensor.size = size
    tensor.__reduce_ex__ = tensor.detach().__reduce_ex__  # torch.save (a file per rank) pickles the plain shard


def describe_state_dict(model, state_dict: dict, prefix: str, _local_metadata) -> None:
    """``state_dict`` post-hook of the parallel model (see the module docstring). With experts spread over
    data-parallel ranks, a run of experts is described as the pieces of the full tensor it holds, at any tp."""
    tp, rank = model.tp_group.size, model.tp_group.rank
    runs = getattr(model, "expert_runs", None) or {}
    if tp == 1 and not runs:
        return
    by_name = {n: p for p in model.plan.params for n in p.names}
    if complete_for_accelerate(model, state_dict, prefix, by_name):  # accelerate's calls: accelerate_state.py
        return
    if full_state_dict_requested("model"):  # torch's get_model_state_dict(full_state_dict=True): dcp_full_state.py
        complete_state_dict(model, state_dict, prefix, by_name, to_rank0_only=False)
        return
    for key, value in state_dict.items():
        plan = by_name.get(key[len(prefix):]) if key.startswith(prefix) else None
        run = runs.get(plan.name) if plan is not None else None
        if plan is None or not (run or plan.placement.is_shard and tp > 1) or not isinstance(value, torch.Tensor):
            continue
        describe(value, plan, rank, tp, run, fsdp_rows_of(value))


def fsdp_rows_of(value):
    """[start, stop) of the rows of the tp shard FSDP's DTensor ``value`` holds (``runtime/dtensor.fsdp_rows``), or
    None for a plain tensor (the whole shard)."""
    if not isinstance(value, DTensor):
        return None
    from .runtime.dtensor import fsdp_rows

    return fsdp_rows(value, value.shape[0])
