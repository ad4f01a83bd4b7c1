"""Loading a checkpoint that holds a fused weight in the other form than the model's.

A fused weight split by its parts over the tp ranks (stacked experts' gate / up with every expert split inside) is
checkpointed as one full-shape tensor per part, ``<key>.segment<i>`` (``dtensor.segment_views``); held whole per
rank (whole experts: ``expert_parallel=True``, or the planner's choice with grouped_mm) it is one tensor,
``<key>``. The numbers are the same: part i is the slice [start_i, start_i + size_i) of the whole along the fused
dim. So each rank tells DCP which pieces of the *saved* tensors its own storage holds
(``dcp_state.describe_pieces``): its chunks of the model's views, moved into the whole tensor's coordinates, and
cut at the part boundaries where the checkpoint holds parts. DCP then reads exactly those pieces into the
parameters (and optimizer states) in place, as for any other layout; nothing is gathered."""
from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor

SEGMENT = ".segment"  # a fused weight's part i is saved as "<name>.segment<i>" (dtensor.segment_views)


def without_segment(key: str) -> str:
    head, dot, tail = key.rpartition(SEGMENT)
    return head if dot and tail.isdigit() else key


def fused_elsewhere(key: str, saved) -> bool:
    """Is ``key`` a fused weight saved in the other form: whole where the model wants parts, or parts where
    it wants it whole?"""
    whole = without_segment(key)
    return (whole != key and whole in saved) or (whole == key and f"{key}{SEGMENT}0" in saved)


def _chunks(view) -> list:
    """[(offsets, sizes, tensor)] of the pieces of ``view``'s full tensor this rank holds: a DTensor's local
    chunk, or the pieces a described view lists (``dcp_state.describe_pieces``); empty ones left out."""
    if isinstance(view, DTensor):
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

        sizes, offsets = compute_local_shape_and_global_offset(view.size(), view.device_mesh, view.placements)
        found = [(torch.Size(offsets), torch.Size(sizes), view.to_local())]
    else:
        from torch.distributed.checkpoint.metadata import MetadataIndex

        found = [(c.offsets, c.sizes, view.__get_tensor_shard__(MetadataIndex("", c.offsets)))
                 for c in view.__create_chunk_list__()]
    return [(o, s, t) for o, s, t in found if all(n > 0 for n in s)]


def _fused_dim(whole: tuple, parts: list):
    """The dim along which ``parts`` (their full shapes, in order) make up ``whole``, or None."""
    for dim in range(len(whole)):
        if all(len(p) == len(whole) and all(p[d] == whole[d] for d in range(len(whole)) if d != dim) for p in parts) \
                and sum(p[dim] for p in parts) == whole[dim]:
            return dim
    return None


def described(pieces: list, full, like: torch.Tensor) -> torch.Tensor:
    """An empty tensor (of ``like``'s dtype and device) that tells DCP it holds ``pieces`` ([(offsets, sizes,
    view)]) of a tensor of shape ``full``: DCP writes and loads those views."""
    from ..dcp_state import describe_pieces

    carrier = like.new_empty(0)
    describe_pieces(carrier, pieces, torch.Size(full))
    return carrier


def _parts(key: str, shapes) -> list:
    """The part keys of ``key`` in order, while ``shapes`` (a mapping key -> full shape) has them."""
    found = []
    while f"{key}{SEGMENT}{len(found)}" in shapes:
        found.append(f"{key}{SEGMENT}{len(found)}")
    return found


def in_saved_form(state: dict, saved_sizes: dict) -> list:
    """Replace, in ``state`` (DCP's {key: view} of the model), each fused weight the checkpoint holds in the other
    form by the saved form's keys, described by the pieces this rank holds. ``saved_sizes``: the checkpoint's
    {key: full size}. Returns the keys it could not convert (parts that do not make up the whole)."""
    groups: dict = {}
    for key in [k for k in state if k not in saved_sizes and fused_elsewhere(k, saved_sizes)]:
        groups.setdefault(without_segment(key), []).append(key)
    failed = []
    for whole, keys in groups.items():
        if whole in keys:  # the model holds it whole, the checkpoint in parts
            model_parts, saved_parts = [whole], _parts(whole, saved_sizes)
            part_shapes = [tuple(saved_sizes[k]) for k in saved_parts]
            full = tuple(state[whole].size())
        else:  # the model holds parts, the checkpoint the whole
            model_parts, saved_parts = _parts(whole, state), [whole]
            part_shapes = [tuple(state[k].size()) for k in model_parts]
            full = tuple(saved_sizes[whole])
        dim = _fused_dim(full, part_shapes)
        if dim is None or len(model_parts) != len(keys):
            failed.append(keys[0])
            continue
        starts = [sum(p[dim] for p in part_shapes[:i]) for i in range(len(part_shapes))]
        views = [state.pop(k) for k in model_parts]
        like = views[0].to_local() if isinstance(views[0], DTensor) else views[0]
        if whole in keys:
            pieces = _chunks(views[0])
            for key, shape, start in zip(saved_parts, part_shapes, starts):
                state[key] = described(_cut(pieces, dim, start, shape[dim]), shape, like)
        else:
            pieces = [(_moved(o, dim, start), s, t) for view, start in zip(views, starts) for o, s, t in _chunks(view)]
            state[whole] = described(pieces, full, like)
    return failed


def _moved(offsets, dim: int, by: int) -> torch.Size:
    return torch.Size(o + by if d == dim else o for d, o in enumerate(offsets))


def _cut(pieces: list, dim: int, start: int, size: int) -> list:
    """The parts of ``pieces`` (whole-tensor coordinates) inside [start, start + size) along ``dim``, in the
    coordinates of that part."""
    out = []
    for offsets, sizes, tensor in pieces:
        first, last = max(offsets[dim], start), min(offsets[dim] + sizes[dim], start + size)
        if first < last:
            out.append((torch.Size(first - start if d == dim else o for d, o in enumerate(offsets)),
                        torch.Size(last - first if d == dim else s for d, s in enumerate(sizes)),
                        tensor.narrow(dim, first - offsets[dim], last - first)))
    return out
