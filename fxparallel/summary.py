"""``print(model)`` of the parallel model: how this rank holds each parameter.

One row per parameter, identical decoder layers grouped (``model.layers.{0-31}.mlp.up_proj.weight
x32``): its placement (``S(d)`` sharded on dim d, ``R`` replicated; uneven per-rank sizes after it),
the kind of split (column / row / vocab-parallel / replicated), the full shape and this rank's
shape with the range of the sharded dim it holds. A layer that differs from the others gets a row
of its own. The collectives are summarized; ``print(model.plan)`` lists them.
"""
from __future__ import annotations

import re
from collections import OrderedDict

_INDEX = re.compile(r"\.(\d+)(?=\.|$)")


def _ranges(values) -> str:
    """{0-31}, {0,2-5}: a compact set of layer indices."""
    values = sorted(set(values))
    runs, start = [], values[0]
    for prev, cur in zip(values, values[1:] + [None]):
        if cur is None or cur != prev + 1:
            runs.append(f"{start}" if start == prev else f"{start}-{prev}")
            start = cur
    return "{" + ",".join(runs) + "}"


def _shape(shape) -> str:
    return "x".join(map(str, shape)) or "scalar"


def _held(param, tp: int, rank: int) -> str:
    """This rank's shape, and the range of the sharded dim it holds (a plain shard)."""
    p = param.placement
    local = _shape(param.local_shape(tp, rank))
    if not p.is_shard or tp == 1:
        return local
    if p.segments:
        return f"{local} (its part of each of {len(p.segments)} segments)"
    piece = param.pieces(rank, tp)[0][0][p.dim]
    what = {0: "rows", 1: "cols"}.get(p.dim, f"dim {p.dim}")
    return f"{local} ({what} {piece.start}:{piece.stop})"


def parameter_rows(plan, tp: int, rank: int) -> list:
    """[(name, count, placement, why, full shape, this rank's shape)], identical layers grouped."""
    groups: "OrderedDict[tuple, list]" = OrderedDict()
    first = {}  # pattern -> position of its first parameter: a layer that differs is listed beside the others
    for i, param in enumerate(plan.params):
        pattern = _INDEX.sub(".*", param.name)
        first.setdefault(pattern, i)
        key = (pattern, param.placement, tuple(param.shape), param.split, param.reason,
               tuple(_INDEX.sub(".*", a) for a in param.aliases), param.local_shape(tp, rank))
        groups.setdefault(key, []).append(param)
    rows = []
    for (pattern, placement, shape, split, reason, aliases, _), members in sorted(
            groups.items(), key=lambda item: first[item[0][0]]):  # stable: groups of a pattern in order
        name = pattern
        if len(members) > 1:  # each layer-index slot: the indices the group covers
            slots = list(zip(*[_INDEX.findall(m.name) for m in members]))
            for values in slots:
                name = name.replace(".*", "." + _ranges(int(v) for v in values), 1)
        else:
            name = members[0].name
        if members[0].aliases:
            name += f" (= {', '.join(members[0].aliases)})"
        shown = str(placement) + (f" {members[0].split_text()}" if split else "")
        rows.append((name, f"x{len(members)}" if len(members) > 1 else "", shown, reason, _shape(shape),
                     _held(members[0], tp, rank)))
    return rows


def sharding_summary(model) -> str:
    """The text ``repr(model)`` prints (see the module docstring)."""
    plan, tp, rank = model.plan, model.tp_group.size, model.tp_group.rank
    local = sum(p.numel() for _, p in model.local_named_parameters())
    extras = []
    if model.cp_group is not None:
        extras.append(f"cp={model.cp_group.size}")
    if getattr(model, "sequence_parallel", False):
        extras.append("sequence parallel")
    data_parallel = getattr(model, "_fxparallel_data_parallel", None)
    if data_parallel is not None:
        extras.append(f"data parallel: {data_parallel.mode}, {data_parallel.units} FSDP units")
    dequantized = getattr(model, "dequantized_from", None)  # load/weights.py: a quantized checkpoint
    if dequantized:
        extras.append(f"weights dequantized from {dequantized} on load")
    head = (f"{type(model).__name__}({plan.model_type}, tp={tp}, rank={rank}"
            + "".join(f", {e}" for e in extras)
            + f", {str(model.dtype).replace('torch.', '')} on {model.device}: "
            + f"{model.num_parameters():,} parameters, {local:,} elements on this rank")
    rows = parameter_rows(plan, tp, rank)
    header = ("parameter", "", "placement", "kind", "full shape", f"rank {rank} holds")
    widths = [max(len(r[i]) for r in rows + [header]) for i in range(len(header))]
    lines = [head, "  " + "  ".join(h.ljust(w) for h, w in zip(header, widths)).rstrip()]
    lines += ["  " + "  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
    per_direction = []
    for direction in ("forward", "backward"):
        kinds = OrderedDict()
        for c in plan.collectives:
            if c.direction == direction:
                kinds[c.kind] = kinds.get(c.kind, 0) + c.count
        per_direction.append(f"{direction} " + (", ".join(f"{n} {k}" for k, n in kinds.items()) or "none"))
    lines.append(f"  collectives per training step: {'; '.join(per_direction)} (print(model.plan) for where)")
    return "\n".join(lines) + "\n)"
