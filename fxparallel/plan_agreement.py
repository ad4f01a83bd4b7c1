"""Every rank of a group runs the same plan, made by the same versions, or none runs.

Each rank plans alone, with its own graph cache and its own installed packages, and the collectives
of the rewritten graphs pair up across ranks only when every rank's plan is the same: a node with
another transformers captures another graph, and its ranks would run mismatched collectives (a hang,
or sums of unrelated tensors). So at the end of ``parallelize`` (before any weight is read) every rank
of the tp group, and of the cp group if any, exchanges the versions that made its plan (the graph
cache's: python, torch, transformers, fxparallel and the digest of fxparallel's source,
``graph_cache/key.py``) and a digest of each field of its plan, and where anything differs every rank
raises a GroupError naming it: which versions differ on which ranks, or which part of the plans
(for the parameters, the first one whose placement or shape differs, found by a second exchange that
runs only then, and only between ranks of the same versions).

The plan compared is ``ShardingPlan.to_dict()``, which is the same on every rank of a correct run:
it holds full shapes, and an uneven split lists every rank's size (``ParamPlan.split``), so ranks
whose local shapes differ still agree.
"""
from __future__ import annotations

import hashlib
import json
from typing import Optional

import torch.distributed as dist

from .errors import GroupError
from .graph_cache import key as cache_key
from .load.coordinate import exchange

# the versions' names as the message shows them, and how much of a digest it shows
_SHOWN = {"fxparallel_source": "fxparallel's source (sha256)"}
_DIGEST_SHOWN = 12


def _digest(value) -> str:
    return hashlib.sha256(json.dumps(value, sort_keys=True).encode()).hexdigest()[:16]


def fingerprint(plan) -> dict:
    """What the ranks compare: the versions that made ``plan`` and a digest of each of its fields."""
    return {"versions": sorted([k, str(v)] for k, v in cache_key._versions().items()),
            "plan": {field: _digest(value) for field, value in sorted(plan.to_dict().items())}}


def check_plans_agree(plan, groups) -> None:
    """Raise a GroupError on every rank of each of ``groups`` ([(name, TPGroup or None)]) whose ranks'
    plans or versions differ; every rank of each group must call it (an agreement point)."""
    mine = fingerprint(plan)
    for name, group in groups:
        if group is None or group.size == 1:
            continue
        everyone = exchange(group.process_group, mine, f"comparing the plans of the ranks of {name}",
                            step=f"plan agreement of {name}")
        versions = _versions_differ(everyone, group, name)
        fields = sorted(f for f in set().union(*(e["plan"] for e in everyone))
                        if len({e["plan"].get(f) for e in everyone}) > 1)
        if versions is None and not fields:
            continue
        said = [versions] if versions else []
        if fields and versions:  # the versions explain it; no second exchange with a rank of another version
            said.append(f"Their plans differ too (in {', '.join(fields)})")
        elif fields:
            said.append(f"the ranks of {name} made different plans with the same versions: "
                        + _plans_differ(plan, fields, group, name))
        raise GroupError(". ".join(said) + ". The ranks would run mismatched collectives, so none runs. "
                         + _advice(same_versions=versions is None))


def _rank_names(ranks: list, global_ranks: list) -> str:
    shown = [f"{r}" + (f" (global {global_ranks[r]})" if global_ranks[r] != r else "") for r in ranks]
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(shown)


def _by_value(values: list, global_ranks: list) -> str:
    """``values`` (one per rank) as '<value> on ranks 0, 2; <other> on rank 1'."""
    ranks_of: dict = {}
    for rank, value in enumerate(values):
        ranks_of.setdefault(value, []).append(rank)
    return "; ".join(f"{value} on {_rank_names(ranks, global_ranks)}" for value, ranks in ranks_of.items())


def _global_ranks(group) -> list:
    return list(dist.get_process_group_ranks(group.process_group))


def _versions_differ(everyone: list, group, name: str) -> Optional[str]:
    """'the ranks of tp_group run different versions: transformers 5.24.0 on rank 0; ...', or None."""
    tables = [dict(map(tuple, e["versions"])) for e in everyone]
    names = sorted(set().union(*tables))
    differ = [n for n in names if len({t.get(n) for t in tables}) > 1]
    if not differ:
        return None
    global_ranks = _global_ranks(group)
    return f"the ranks of {name} run different versions: " + ", ".join(
        f"{_SHOWN.get(n, n)} {_by_value([_shown(n, t.get(n, 'missing')) for t in tables], global_ranks)}"
        for n in differ)


def _shown(name: str, value: str) -> str:
    """A version as the message shows it (a digest shortened)."""
    return value[:_DIGEST_SHOWN] if name in _SHOWN else value


def _plans_differ(plan, fields: list, group, name: str) -> str:
    """Which fields of the plans differ; for the parameters, the first one that differs (a second exchange,
    entered by every rank since they all see the same differing fields)."""
    said = f"their {', '.join(fields)} differ"
    if "params" not in fields:
        return said
    mine = [[p.name, str(p.placement) + (f" {p.split_text()}" if p.split else ""), "x".join(map(str, p.shape)),
             p.reason] for p in plan.params]
    everyone = exchange(group.process_group, mine, f"finding where the plans of the ranks of {name} differ",
                        step=f"plan parameters of {name}")
    order = list(dict.fromkeys(entry[0] for entries in everyone for entry in entries))
    placed = [{n: f"{placement} (shape {shape})" for n, placement, shape, _ in entries} for entries in everyone]
    reasons = [{n: repr(reason) for n, _, _, reason in entries} for entries in everyone]
    for what, tables in (("placed differently", placed), ("with different reasons", reasons)):
        for param in order:
            values = [t.get(param, "absent") for t in tables]
            if len(set(values)) > 1:
                return f"{said}; the first parameter {what} is {param}: {_by_value(values, _global_ranks(group))}"
    return said


def _advice(same_versions: bool) -> str:
    if same_versions:
        return ("Same versions, different plans: a rank was given another plan= or sequence_parallel, or a "
                "graph cache (FXPARALLEL_GRAPH_CACHE) holds a plan made otherwise; pass the same arguments on "
                "every rank, and clear the cache if that does not help")
    return ("Install the same python, torch, transformers and fxparallel on every node (the graph cache "
            "keys planned graphs by these versions, so each node plans with its own)")
