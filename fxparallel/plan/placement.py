"""How one tensor is laid out over the tensor-parallel group.

Three layouts are enough for tensor parallelism:

* ``R``: every rank holds the whole tensor (replicated).
* ``S(d)``: every rank holds one contiguous chunk of dimension ``d`` (sharded).
* ``P``: every rank holds a full-shape tensor and the true value is their sum
  (partial, as after a row-parallel matmul).

Expert parallelism adds a fourth:

* ``E(n)``: expert rows. Every rank holds a full-shape tensor whose leading ``n`` dims
  are the routed (token, expert) pairs of a mixture of experts; a row is right only on
  the rank that holds its expert, elsewhere it was computed with a stand-in expert.
  Row-wise ops keep it (``rules/expert_rows.py``); summing the rows, or making it
  replicated, first zeroes the rows of other ranks' experts, which makes it a partial sum.

A shard may be *segmented*: dimension ``d`` is the concatenation of segments
(q, k and v of a fused projection, gate and up) and each segment is split on its
own, so that each rank holds its chunk of every segment, in segment order. That
is how a fused weight is split by head without any gather. A segment may be held
*whole* by every rank (``S(0)[64,8R,8R]``): the single key and value head of
multi-query attention (GPT-BigCode), which every rank's query heads need. Its
value is replicated; its gradient is partial (each rank's query heads contribute
their part), summed where it meets a weight (``ops/collectives.py``).

A shard may be *blocked*: dimension ``d`` merges a replicated outer factor with a
sharded inner one of ``block`` elements, as when batch and heads are flattened
into one dimension (``q.reshape(batch * heads, seq, head_dim)``, Bloom's
attention). Each rank holds its part of every block: its heads of every
sequence. Only rules that know this layout accept it (``rules.base.Rule.handles_blocks``).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional


@dataclass(frozen=True, order=True)
class Placement:
    kind: str  # "R", "S", "P" or "E"
    dim: Optional[int] = None
    segments: Optional[tuple] = None  # sizes of the segments of a segmented shard
    block: Optional[int] = None  # a blocked shard: the size of the sharded inner factor of ``dim``
    whole: tuple = ()  # indices of the segments every rank holds whole

    def __post_init__(self):
        if self.kind not in ("R", "S", "P", "E"):
            raise ValueError(f"unknown placement kind {self.kind!r}")
        if (self.kind in ("S", "E")) != (self.dim is not None):
            raise ValueError("only a shard or expert-rows placement has a dimension")
        if self.block is not None and self.segments:
            raise ValueError("a shard is either segmented or blocked, not both")
        if self.whole and not (self.segments and all(0 <= i < len(self.segments) for i in self.whole)):
            raise ValueError(f"whole segments {self.whole} of a shard with segments {self.segments}")

    @property
    def is_replicate(self) -> bool:
        return self.kind == "R"

    @property
    def is_shard(self) -> bool:
        return self.kind == "S"

    @property
    def is_plain_shard(self) -> bool:
        """A shard of one whole dimension: neither segmented nor blocked."""
        return self.kind == "S" and not self.segments and self.block is None

    @property
    def is_partial(self) -> bool:
        return self.kind == "P"

    @property
    def is_expert_rows(self) -> bool:
        return self.kind == "E"

    def __repr__(self) -> str:
        if self.kind == "E":
            return f"E({self.dim})"
        if self.kind != "S":
            return self.kind
        if self.segments:
            sizes = (f"{seg}R" if i in self.whole else str(seg) for i, seg in enumerate(self.segments))
            return f"S({self.dim})[{','.join(sizes)}]"
        if self.block is not None:
            return f"S({self.dim})[*{self.block}]"
        return f"S({self.dim})"

    def parts(self, size) -> tuple:
        """The sizes split on their own along the sharded dim (of ``size`` elements): the segments,
        the block, or the whole dim."""
        return self.segments or ((self.block,) if self.block is not None else (size,))

    def local_parts(self, local_size) -> list:
        """This rank's size of each segment: ``local_size(segment)``, or the segment for a whole one."""
        return [seg if i in self.whole else local_size(seg) for i, seg in enumerate(self.segments)]

    def whole_ranges(self, local_size) -> list:
        """[start, stop) of each whole segment in this rank's shard."""
        ranges, offset = [], 0
        for i, n in enumerate(self.local_parts(local_size)):
            if i in self.whole:
                ranges.append((offset, offset + n))
            offset += n
        return ranges

    def with_dim(self, dim: int) -> "Placement":
        """The same shard (segments or block included) on another dimension."""
        return Placement("S", dim, self.segments, self.block, self.whole)

    __str__ = __repr__

    @staticmethod
    def parse(text: str) -> "Placement":
        text = text.strip()
        if text in ("R", "P"):
            return Placement(text)
        if text.startswith("E(") and text.endswith(")"):
            return Placement("E", int(text[2:-1]))
        if text.startswith("S(") and text.endswith("]") and ")[*" in text:
            head, block = text[:-1].split(")[*")
            return Placement("S", int(head[2:]), block=int(block))
        if text.startswith("S(") and text.endswith("]") and ")[" in text:
            head, segs = text[:-1].split(")[")
            segs = segs.split(",")
            return Placement("S", int(head[2:]), tuple(int(x.rstrip("R")) for x in segs),
                             whole=tuple(i for i, x in enumerate(segs) if x.endswith("R")))
        if text.startswith("S(") and text.endswith(")"):
            return Placement("S", int(text[2:-1]))
        raise ValueError(f"cannot parse placement {text!r}")


R = Placement("R")
P = Placement("P")


def E(rows: int) -> Placement:
    """Expert rows over the leading ``rows`` dims."""
    return Placement("E", rows)


def S(dim: int, segments: Optional[tuple] = None, block: Optional[int] = None, whole: tuple = ()) -> Placement:
    return Placement("S", dim, tuple(segments) if segments else None, block, tuple(whole))


def shard_pieces(size: int, rank: int, tp: int, segments: Optional[tuple] = None, split: Optional[tuple] = None,
                 whole: tuple = ()) -> list:
    """[(start, stop) in the full dimension] that rank holds, in local order.

    ``split``: per segment (one for a plain shard), the per-rank sizes of an uneven split
    (``layout.ShardLayout``); without it every rank holds ``segment // tp``. A ``whole``
    segment (by index) is held entire by every rank."""
    pieces, offset = [], 0
    for i, seg in enumerate(segments or (size,)):
        if i in whole:
            pieces.append((offset, offset + seg))
        else:
            sizes = split[i] if split else (seg // tp,) * tp
            start = offset + sum(sizes[:rank])
            pieces.append((start, start + sizes[rank]))
        offset += seg
    return pieces


def is_sharded(placement) -> bool:
    """Is any part of a (possibly tuple) placement not replicated?"""
    if placement is None:
        return False
    if isinstance(placement, tuple):
        return any(is_sharded(p) for p in placement)
    return not placement.is_replicate
