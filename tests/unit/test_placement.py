"""Placements as data: parsing, printing, and the pieces of a (segmented) shard."""
from __future__ import annotations

import pytest
import torch

from fxparallel.plan.placement import Placement, S, shard_pieces
from fxparallel.plan.plan import ParamPlan


@pytest.mark.parametrize("text", ["R", "P", "S(0)", "S(2)", "S(1)[64,32,32]", "S(0)[*8]", "S(0)[64,8R,8R]"])
def test_parse_and_print_round_trip(text):
    assert str(Placement.parse(text)) == text


def test_blocked_shard_keeps_its_block_and_is_not_segmented():
    # batch x heads merged into one dim, heads (blocks of 8) sharded: moving dims keeps the block
    p = S(0, block=8)
    assert p.with_dim(2) == Placement.parse("S(2)[*8]") and p != S(0)
    with pytest.raises(ValueError, match="either segmented or blocked"):
        S(0, (4, 4), block=8)


def test_segmented_shard_holds_its_chunk_of_every_part():
    # a fused q/k/v weight of 4 + 2 + 2 rows over 2 ranks: rank 1 holds q rows 2-3, k row 5, v row 7
    plan = ParamPlan("qkv.weight", (8, 3), S(0, (4, 2, 2)), "fused")
    full = torch.arange(24).view(8, 3)
    assert shard_pieces(8, 1, 2, (4, 2, 2)) == [(2, 4), (5, 6), (7, 8)]
    assert plan.shard_of(full, 1, 2).tolist() == full[[2, 3, 5, 7]].tolist()
    assert plan.local_shape(2) == (4, 3)
    with pytest.raises(ValueError, match="segmented shard"):
        plan.local_slices(1, 2)
    # every row is held by exactly one rank
    rows = torch.cat([plan.shard_of(full, r, 2) for r in range(2)])
    assert sorted(rows[:, 0].tolist()) == full[:, 0].tolist()


def test_whole_segments_are_held_entire_by_every_rank():
    # multi-query q/k/v: 4 query rows split over 2 ranks, the single k row and v row on both
    p = S(0, (4, 1, 1), whole=(1, 2))
    plan = ParamPlan("qkv.weight", (6, 3), p, "fused")
    full = torch.arange(18).view(6, 3)
    assert shard_pieces(6, 1, 2, (4, 1, 1), whole=(1, 2)) == [(2, 4), (4, 5), (5, 6)]
    assert plan.shard_of(full, 1, 2).tolist() == full[[2, 3, 4, 5]].tolist()
    assert plan.local_shape(2) == (4, 3)
    assert p.local_parts(lambda seg: seg // 2) == [2, 1, 1] and p.whole_ranges(lambda seg: seg // 2) == [(2, 3), (3, 4)]
    assert p.with_dim(2) == Placement.parse("S(2)[4,1R,1R]")
    with pytest.raises(ValueError, match="whole segments"):
        S(0, whole=(0,))


def test_plain_shard_is_one_piece():
    plan = ParamPlan("w", (4, 6), S(1), "column")
    assert plan.local_slices(1, 3) == (slice(0, 4), slice(2, 4))
    assert plan.pieces(1, 3) == [((slice(0, 4), slice(2, 4)), (slice(0, 4), slice(0, 2)))]
