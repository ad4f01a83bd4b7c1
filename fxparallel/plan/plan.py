"""The sharding plan as data: what each parameter's placement is and why, and every
collective the rewritten graph runs. It prints as a table, compares with ``==``,
and saves to / loads from JSON. Applying it is someone else's job (rewrite, load)."""
from __future__ import annotations

import json
from collections import OrderedDict
from dataclasses import asdict, dataclass, field
from typing import Optional

import torch

from .placement import Placement, shard_pieces
from .solver import layer_pattern


UNUSED = "not used by the forward: replicated"  # the reason of a parameter the graph never reads


@dataclass(frozen=True)
class ParamPlan:
    name: str
    shape: tuple
    placement: Placement  # R, S(0), ... (a string given here is parsed once; JSON holds the string)
    reason: str
    aliases: tuple = ()  # other names of the same (tied) parameter
    # uneven shard: per segment (one for a plain shard), each rank's size along the sharded dim; () if even
    split: tuple = ()

    def __post_init__(self):
        if isinstance(self.placement, str):
            object.__setattr__(self, "placement", Placement.parse(self.placement))

    @property
    def names(self) -> tuple:
        """Every name the parameter goes by: its own, then its aliases (tied weights)."""
        return (self.name,) + tuple(self.aliases)

    @property
    def used(self) -> bool:
        """Does the forward read it? (A multimodal model's vision tower does not, in a text forward.)"""
        return self.reason != UNUSED

    def local_shape(self, tp: int, rank: Optional[int] = None) -> tuple:
        """Shape of a rank's shard; an uneven shard differs by rank, so it needs ``rank``."""
        p = self.placement
        if not p.is_shard:
            return tuple(self.shape)
        shape = list(self.shape)
        if self.split:
            if rank is None:
                raise ValueError(f"{self.name} is split unevenly ({self.split_text()}): its shape depends on the rank")
            shape[p.dim] = sum(sizes[rank] for sizes in self.split)
        elif p.whole:
            shape[p.dim] = sum(p.local_parts(lambda seg: seg // tp))
        else:
            shape[p.dim] //= tp
        return tuple(shape)

    def split_text(self) -> str:
        """Per-rank sizes of an uneven shard, e.g. ``48/24`` (``|`` between the parts of a fused weight)."""
        return "|".join("/".join(map(str, sizes)) for sizes in self.split)

    def local_slices(self, rank: int, tp: int) -> tuple:
        """Index of this rank's shard in the full tensor (one slice per dimension).

        Only for one-piece placements; a segmented shard has several pieces (``pieces``).
        """
        pieces = self.pieces(rank, tp)
        if len(pieces) != 1:
            raise ValueError(f"{self.name} is a segmented shard: use pieces() or shard_of()")
        return pieces[0][0]

    def pieces(self, rank: int, tp: int) -> list:
        """[(index into the full tensor, index into the local shard)] that make up this rank's shard."""
        p = self.placement
        full = [slice(0, s) for s in self.shape]
        if not p.is_shard:
            return [(tuple(full), tuple(full))]
        if p.block is not None:  # the loader, export and DTensor views read segments, not blocks
            raise ValueError(f"{self.name}: a parameter cannot be a blocked shard ({p})")
        out, offset = [], 0
        for start, stop in shard_pieces(self.shape[p.dim], rank, tp, p.segments, self.split or None, p.whole):
            src, dst = list(full), list(full)
            src[p.dim] = slice(start, stop)
            dst[p.dim] = slice(offset, offset + stop - start)
            offset += stop - start
            out.append((tuple(src), tuple(dst)))
        return out

    def shard_of(self, full, rank: int, tp: int):
        """This rank's shard of the full tensor ``full`` (pieces concatenated)."""
        p = self.placement
        parts = [full[src] for src, _ in self.pieces(rank, tp)]
        return parts[0] if len(parts) == 1 else torch.cat(parts, dim=p.dim)


@dataclass(frozen=True)
class CollectivePlan:
    kind: str  # all_reduce, all_gather, reduce_scatter
    direction: str  # forward or backward
    where: str  # the module (layer pattern) whose output it acts on
    bytes_per_token: float  # payload of one call, per token (collectives of activations)
    count: int  # calls per step
    bytes_per_call: float = 0.0  # fixed payload of one call (gradients of parameters), independent of tokens


@dataclass
class ShardingPlan:
    model_type: str
    tp: int
    params: list = field(default_factory=list)  # [ParamPlan]
    collectives: list = field(default_factory=list)  # [CollectivePlan]
    fallbacks: list = field(default_factory=list)  # ["op (where): reason"]
    dtype: str = "float32"
    sequence_parallel: bool = False  # activations outside attention/MLP sharded along the sequence
    sequence_parallel_kept: list = field(default_factory=list)  # ["where: reason"] regions left plain TP
    uneven: dict = field(default_factory=dict)  # full size -> per-rank sizes of the uneven splits (ShardLayout)
    experts: str = ""  # how a mixture of experts is split and why (plan/expert_choice.py); "" without experts

    # ---- queries -------------------------------------------------------------
    def param(self, name: str) -> ParamPlan:
        for p in self.params:
            if p.name == name or name in p.aliases:
                return p
        raise KeyError(name)

    def count(self, kind: str, direction: str) -> int:
        return sum(c.count for c in self.collectives if c.kind == kind and c.direction == direction)

    def bytes_per_token(self, direction: Optional[str] = None) -> float:
        return sum(c.bytes_per_token * c.count for c in self.collectives if direction in (None, c.direction))

    def wire_bytes_per_token(self, direction: Optional[str] = None) -> float:
        """Bytes each rank sends per token with ring algorithms: an all-reduce sends 2(tp-1)/tp of
        its payload, a reduce-scatter or an all-gather (tp-1)/tp (so one of each = one all-reduce)."""
        share = (self.tp - 1) / self.tp if self.tp > 1 else 0.0
        factor = {"all_reduce": 2 * share, "reduce_scatter": share, "all_gather": share}
        return sum(factor.get(c.kind, 0.0) * c.bytes_per_token * c.count for c in self.collectives
                   if direction in (None, c.direction))

    def param_bytes_per_rank(self, itemsize: int = 4, rank: Optional[int] = None) -> int:
        """Parameter bytes of ``rank``; without a rank, of the rank that holds the most (uneven splits)."""
        if rank is None:
            return max(self.param_bytes_per_rank(itemsize, r) for r in range(self.tp))
        total = 0
        for p in self.params:
            n = 1
            for s in p.local_shape(self.tp, rank):
                n *= s
            total += n * itemsize
        return total

    # ---- persistence ---------------------------------------------------------
    def to_dict(self) -> dict:
        return {
            "model_type": self.model_type,
            "tp": self.tp,
            "dtype": self.dtype,
            "params": [{**asdict(p), "placement": str(p.placement)} for p in self.params],
            "collectives": [asdict(c) for c in self.collectives],
            "fallbacks": list(self.fallbacks),
            "sequence_parallel": self.sequence_parallel,
            "sequence_parallel_kept": list(self.sequence_parallel_kept),
            "uneven": {str(k): list(v) for k, v in sorted(self.uneven.items())},
            "experts": self.experts,
        }

    @classmethod
    def from_dict(cls, d: dict) -> "ShardingPlan":
        return cls(
            model_type=d["model_type"],
            tp=d["tp"],
            dtype=d.get("dtype", "float32"),
            params=[ParamPlan(p["name"], tuple(p["shape"]), Placement.parse(p["placement"]), p["reason"],
                              tuple(p.get("aliases", ())),
                              tuple(tuple(s) for s in p.get("split", ())))
                    for p in d["params"]],
            collectives=[CollectivePlan(**c) for c in d["collectives"]],
            fallbacks=list(d.get("fallbacks", [])),
            sequence_parallel=d.get("sequence_parallel", False),
            sequence_parallel_kept=list(d.get("sequence_parallel_kept", [])),
            uneven={int(k): tuple(v) for k, v in d.get("uneven", {}).items()},
            experts=d.get("experts", ""),
        )

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)

    @classmethod
    def from_json(cls, text: str) -> "ShardingPlan":
        return cls.from_dict(json.loads(text))

    def save(self, path) -> None:
        with open(path, "w") as f:
            f.write(self.to_json())

    @classmethod
    def load(cls, path) -> "ShardingPlan":
        with open(path) as f:
            return cls.from_json(f.read())

    # ---- report --------------------------------------------------------------
    def __str__(self) -> str:
        groups: "OrderedDict[str, list]" = OrderedDict()
        for p in self.params:
            groups.setdefault(layer_pattern(p.name), []).append(p)
        rows = []
        for pattern, members in groups.items():
            p = members[0]
            name = pattern + (f" (= {', '.join(p.aliases)})" if p.aliases else "")
            count = f"x{len(members)}" if len(members) > 1 else ""
            placement = str(p.placement) + (f" {p.split_text()}" if p.split else "")
            rows.append((name, count, "x".join(map(str, p.shape)), placement, p.reason))
        widths = [max(len(r[i]) for r in rows + [("parameter", "", "shape", "placement", "why")]) for i in range(5)]
        out = [f"fxparallel plan: {self.model_type}, tp={self.tp}, {self.dtype}"
               + (", sequence parallel" if self.sequence_parallel else "")]
        header = ("parameter", "", "shape", "placement", "why")
        out.append("  ".join(h.ljust(w) for h, w in zip(header, widths)).rstrip())
        out.append("  ".join("-" * w for w in widths))
        for r in rows:
            out.append("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip())
        out.append("")
        if self.experts:
            out.append(f"experts: {self.experts}")
        out.append("collectives per step (bytes per token are the payload of one call):")
        for direction in ("forward", "backward"):
            calls = [c for c in self.collectives if c.direction == direction]
            total = sum(c.count for c in calls)
            fixed = sum(c.count * c.bytes_per_call for c in calls)
            out.append(f"  {direction}: {total} calls, {sum(c.count * c.bytes_per_token for c in calls):.0f} bytes/token"
                       + (f" + {fixed:.0f} bytes/step" if fixed else "")
                       + (f" (ring: {self.wire_bytes_per_token(direction):.0f} bytes/token sent per rank)"
                          if self.sequence_parallel else ""))
            for c in calls:
                size = f"{c.bytes_per_call:>10.0f} B/call " if c.bytes_per_call else f"{c.bytes_per_token:>10.1f} B/token"
                out.append(f"    {c.count:>4} x {c.kind:<14} {size}  {_shown(c.where)}")
        if self.uneven:
            out.append("uneven splits (size: per-rank sizes, whole heads / columns / rows): "
                       + ", ".join(f"{k}: {'/'.join(map(str, v))}" for k, v in sorted(self.uneven.items())))
            per_rank = [self.param_bytes_per_rank(_itemsize(self.dtype), r) / 2**20 for r in range(self.tp)]
            out.append("parameter memory per rank: " + ", ".join(f"{mb:.2f}" for mb in per_rank) + " MiB")
        else:
            mb = self.param_bytes_per_rank(_itemsize(self.dtype)) / 2**20
            out.append(f"parameter memory per rank: {mb:.2f} MiB")
        if self.sequence_parallel_kept:
            out.append("left plain TP by sequence parallelism (a consumer is not token-wise):")
            out.extend(f"  {_shown(k)}" for k in self.sequence_parallel_kept)
        if self.fallbacks:
            out.append("replicated by fallback (gathered):")
            out.extend(f"  {f}" for f in self.fallbacks)
        replicated = [p.name for p in self.params if p.placement.is_replicate and len(p.shape) >= 2]
        if replicated:
            out.append("matrices left replicated: " + ", ".join(sorted({layer_pattern(n) for n in replicated})))
        return "\n".join(out)


# module_path's name for ops of no submodule (the causal LM's own forward: loss, logits processing)
TOP = "<top>"
TOP_SHOWN = "(top-level forward, outside any submodule)"


def _shown(where: str) -> str:
    """A ``where`` as the report prints it: ``<top>`` said in words."""
    return where.replace(TOP, TOP_SHOWN)


def _itemsize(dtype: str) -> int:
    return {"float32": 4, "float16": 2, "bfloat16": 2, "float64": 8}.get(dtype, 4)
