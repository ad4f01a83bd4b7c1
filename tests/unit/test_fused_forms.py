"""A checkpoint's fused weight in the other form than the model's (fxparallel/runtime/fused_forms.py): the pieces
each rank describes to DCP, as views of its own storage. Ranks and DCP end to end:
tests/test_expert_parallel.py (whole experts <-> experts split inside, under FSDP, parameters and Adam moments)."""
import torch

from fxparallel.dcp_state import describe_pieces
from fxparallel.runtime.fused_forms import in_saved_form


def _held(rows: slice, local: torch.Tensor, full) -> torch.Tensor:
    """``local`` described as rows ``rows`` of a tensor of shape ``full`` (a rank's chunk)."""
    view = local[:]
    offsets = torch.Size([rows.start] + [0] * (len(full) - 1))
    describe_pieces(view, [(offsets, local.shape, local)], torch.Size(full))
    return view


def _pieces(value) -> list:
    from torch.distributed.checkpoint.metadata import MetadataIndex

    return [(tuple(c.offsets), tuple(c.sizes), value.__get_tensor_shard__(MetadataIndex("", c.offsets)))
            for c in value.__create_chunk_list__()]


def test_whole_model_tensor_reads_the_saved_parts_into_its_own_storage():
    local = torch.zeros(2, 6, 3)  # rows 2-3 of a [4, 6, 3] weight, whole along the fused dim 1
    state = {"w": _held(slice(2, 4), local, (4, 6, 3))}
    assert in_saved_form(state, {"w.segment0": torch.Size([4, 2, 3]), "w.segment1": torch.Size([4, 4, 3])}) == []
    assert set(state) == {"w.segment0", "w.segment1"}
    (o0, s0, v0), = _pieces(state["w.segment0"])
    (o1, s1, v1), = _pieces(state["w.segment1"])
    assert (o0, s0, o1, s1) == ((2, 0, 0), (2, 2, 3), (2, 0, 0), (2, 4, 3))
    assert tuple(state["w.segment1"].size()) == (4, 4, 3)
    v0.fill_(1.0)
    v1.fill_(2.0)  # DCP copies into these views: the model's storage
    assert torch.equal(local[:, :2], torch.ones(2, 2, 3)) and torch.equal(local[:, 2:], torch.full((2, 4, 3), 2.0))


def test_model_parts_read_their_slices_of_the_saved_whole_tensor():
    gate, up = torch.zeros(4, 1, 3), torch.zeros(4, 2, 3)  # a rank's half of each part (split on dim 1)
    state = {"w.segment0": _piece(gate, (4, 2, 3), 1), "w.segment1": _piece(up, (4, 4, 3), 2)}
    assert in_saved_form(state, {"w": torch.Size([4, 6, 3])}) == []
    assert set(state) == {"w"}
    pieces = _pieces(state["w"])
    assert [(o, s) for o, s, _ in pieces] == [((0, 1, 0), (4, 1, 3)), ((0, 4, 0), (4, 2, 3))]
    assert pieces[0][2].data_ptr() == gate.data_ptr() and pieces[1][2].data_ptr() == up.data_ptr()


def _piece(local, full, start) -> torch.Tensor:
    view = local[:]
    describe_pieces(view, [(torch.Size([0, start, 0]), local.shape, local)], torch.Size(full))
    return view


def test_parts_that_do_not_make_up_the_whole_are_named():
    state = {"w": _held(slice(0, 4), torch.zeros(4, 6, 3), (4, 6, 3))}
    assert in_saved_form(state, {"w.segment0": torch.Size([4, 2, 3]), "w.segment1": torch.Size([4, 2, 3])}) == ["w"]
