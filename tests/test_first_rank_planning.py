"""One rank plans for its group (``FXPARALLEL_PLANNING=first``, fxparallel/graph_cache/first_rank.py): group rank 0
captures once and sends every rank the graph that rank would have planned itself. Checked on 3 real ranks of an
uneven split (heads, MLP and vocabulary split 2/1 or 3/3/2, so the ranks' code differs in more than the rank):
each rank's code equals the code it plans alone, byte for byte; loss, logits, gradients of every parameter and
generated tokens are bit-identical; only rank 0 captures; an error raised while planning on rank 0 is raised on
every rank with its class and message; ranks that plan different graphs each plan their own; a call that plans on
one rank only (a cast) waits for its peers and names them."""
from __future__ import annotations

import pytest

from distributed import run_ranks
from models import save_checkpoint, tiny_config

WORLD = 3


def _run(path, ids):
    import torch

    import fxparallel
    import torch.distributed as dist

    model = fxparallel.parallelize(path, dist.group.WORLD, dtype=torch.float32)
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    logits = model(input_ids=ids).logits
    tokens = model.generate(input_ids=ids[:, :5], max_new_tokens=5, do_sample=False)
    # (a layer-split graph's code names a key fresh in each process's graphs)
    code = sorted(g.code.replace(repr(g.pieces.key), "key") if g.pieces else g.code for g in model._graph_set)
    return loss.detach(), logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}, tokens, code


def _both_ways(rank, world, path, root):
    import os

    import torch

    import fxparallel.api
    from fxparallel import graph_cache

    ids = torch.randint(0, 1001, (2, 12), generator=torch.Generator().manual_seed(1))
    captures = []
    capture = fxparallel.api.capture
    fxparallel.api.capture = lambda *a, **k: (captures.append(a[1].arguments), capture(*a, **k))[1]
    out = {}
    for mode in ("each", "first"):
        os.environ["FXPARALLEL_PLANNING"] = mode
        os.environ["FXPARALLEL_GRAPH_CACHE"] = os.path.join(root, mode)  # nothing planned before
        before, count = dict(graph_cache.stats), len(captures)
        out[mode] = _run(path, ids)
        out[mode + " captures"] = len(captures) - count
        out[mode + " stats"] = {k: graph_cache.stats[k] - before[k] for k in before}
    (la, ga, gra, ta, ca), (lb, gb, grb, tb, cb) = out.pop("each"), out.pop("first")
    out["same code"] = ca == cb
    out["identical"] = (torch.equal(la, lb) and torch.equal(ga, gb) and torch.equal(ta, tb) and gra.keys() == grb.keys()
                        and all(torch.equal(gra[n], grb[n]) for n in gra))
    os.environ["FXPARALLEL_PLANNING"] = "first"
    before = dict(graph_cache.stats)
    _run(path, ids)  # every rank reads its own cache: nothing planned, nothing sent
    out["again"] = {k: graph_cache.stats[k] - before[k] for k in before}
    fxparallel.api.capture = capture
    return out


def test_rank_zero_plans_every_ranks_graph(tmp_path):
    path = save_checkpoint(tiny_config("llama", hidden_size=72, num_attention_heads=9, num_key_value_heads=3,
                                       intermediate_size=100, vocab_size=1001), str(tmp_path / "uneven"))
    results = run_ranks(WORLD, _both_ways, path, str(tmp_path / "graphs"))
    for rank, out in enumerate(results):
        assert out["same code"] and out["identical"], rank
        # training, logits (cut from the training capture), prefill, decode: 3 captures, 4 graphs
        assert out["each captures"] == 3 and out["each stats"]["misses"] == 4, (rank, out)
        assert out["first captures"] == (3 if rank == 0 else 0), (rank, out)
        assert out["first stats"]["misses" if rank == 0 else "received"] == 4, (rank, out)
        assert out["again"]["hits"] == 4 and out["again"]["misses"] == out["again"]["received"] == 0, (rank, out)


def _failures(rank, world, path):
    import os
    import time
    from types import SimpleNamespace

    import torch
    import torch.distributed as dist

    import fxparallel.api
    from fxparallel.errors import CaptureError, CacheNotCarried, RankTimeoutError
    from fxparallel.graph_cache.first_rank import planned_for_group
    from fxparallel.group import resolve_tp_group

    os.environ.update(FXPARALLEL_PLANNING="first", FXPARALLEL_GRAPH_CACHE="off")
    out = {}
    capture = fxparallel.api.capture

    def failing(meta, spec):  # only rank 0 captures: the others must raise what it raised
        raise CacheNotCarried("TinyModel's recurrent state")

    fxparallel.api.capture = failing
    try:
        fxparallel.parallelize(path, dist.group.WORLD, dtype=torch.float32)
    except CaptureError as err:
        out["error"] = [type(err).__name__, str(err), getattr(err, "why", None)]
    fxparallel.api.capture = capture
    group = resolve_tp_group(dist.group.WORLD)
    built = []
    key = {"graph": "the same on every rank"}
    other = {"graph": f"rank {rank}'s own"}  # e.g. another transformers on one rank: each plans alone
    planned = planned_for_group(other, group, torch.device("cpu"),
                                lambda r, d: built.append(r) or SimpleNamespace(name=f"built {r}", warnings=()))
    out["own"] = planned.name
    out["built"] = list(built)

    def raising(r, d):
        raise ValueError(f"no rule for op foo at rank {r}'s layer 3")

    try:
        planned_for_group(key, group, torch.device("cpu"), raising)
    except ValueError as err:
        out["value error"] = str(err)
    # planning is an agreement point: a cast on one rank (which plans its graphs in float64) waits for the peers,
    # then names them, and changes nothing
    model = fxparallel.parallelize(path, dist.group.WORLD, dtype=torch.float32)
    os.environ["FXPARALLEL_AGREE_TIMEOUT"] = "2"
    if rank == 1:
        try:
            model.double()
        except RankTimeoutError as err:
            out["cast alone"] = str(err)
        out["dtype"] = str(next(model.parameters()).dtype)
    else:
        time.sleep(4)  # (rank 0 hosts the store)
    return out


def test_planning_errors_and_different_graphs(checkpoints):
    results = run_ranks(2, _failures, checkpoints["llama"])
    for rank, out in enumerate(results):
        assert out["error"][0] == "CacheNotCarried" and out["error"][2] == "TinyModel's recurrent state", (rank, out)
        assert out["error"][1].startswith("TinyModel's recurrent state: use_cache is not supported"), (rank, out)
        assert out["own"] == f"built {rank}" and out["built"] == [rank], (rank, out)
        # rank 0 builds rank 1's graph first (then its own): the message is of rank 1's
        assert out["value error"] == "no rule for op foo at rank 1's layer 3", (rank, out)
    assert "rank 1 waited 2 s for rank 0" in results[1]["cast alone"], results[1]
    assert "comparing the graphs the ranks plan" in results[1]["cast alone"], results[1]
    assert results[1]["dtype"] == "torch.float32", results[1]


def test_planning_mode_is_checked(monkeypatch):
    from fxparallel.errors import ArgumentError
    from fxparallel.graph_cache.first_rank import planning_mode

    monkeypatch.setenv("FXPARALLEL_PLANNING", "rank0")
    with pytest.raises(ArgumentError, match=r"FXPARALLEL_PLANNING='rank0': expected one of each, first"):
        planning_mode()
    monkeypatch.delenv("FXPARALLEL_PLANNING")
    assert planning_mode() == "each"
