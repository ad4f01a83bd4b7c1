"""The ranks of a group compare their plans and the versions that made them at the end of ``parallelize``
(``fxparallel/plan_agreement.py``), and refuse to run mismatched, on every rank, naming what differs.

Two gloo ranks on a tiny Llama: one rank reporting another transformers version; one rank given a plan
with the MLP replicated (same versions, different parameter placements); one rank with sequence
parallelism (same parameters, different collectives); and the same call on both ranks, which agrees.
"""
from __future__ import annotations

import pytest
import torch

from distributed import run_ranks

MISMATCHED = "4.0.0.dev0"


def _replicated_mlp(plan):
    from fxparallel import ShardingPlan

    d = plan.to_dict()
    for p in d["params"]:
        if ".mlp." in p["name"]:
            p["placement"], p["split"] = "R", []
    return ShardingPlan.from_dict(d)


def _error(call) -> str:
    from fxparallel.errors import GroupError

    try:
        call()
    except GroupError as err:
        return str(err)
    return None


def _parallelize_mismatched(rank, world, path):
    import torch.distributed as dist
    import transformers

    import fxparallel
    from fxparallel.graph_cache import key

    real = transformers.__version__

    def parallelize(**kwargs):
        return fxparallel.parallelize(path, dist.group.WORLD, dtype=torch.float32, **kwargs)

    out = {"real": real}
    agreed = parallelize()
    out["agreed"] = agreed.plan.to_dict()
    edited = _replicated_mlp(agreed.plan)
    out["plan"] = _error(lambda: parallelize(**({"plan": edited} if rank == 1 else {})))
    out["sequence parallel"] = _error(lambda: parallelize(sequence_parallel=rank == 1))
    # this rank's process only: another transformers, as the graph cache and the agreement read it (patching
    # transformers.__version__ would not last: building a model re-registers transformers' lazy module)
    versions = key._versions
    if rank == 1:
        key._versions = lambda: {**versions(), "transformers": MISMATCHED}
    try:
        out["versions"] = _error(parallelize)
    finally:
        key._versions = versions
    out["again"] = _error(parallelize)  # the ranks are still at the same steps after refusing
    return out


@pytest.fixture(scope="module")
def results(checkpoints):
    return run_ranks(2, _parallelize_mismatched, checkpoints["llama"])


def test_different_transformers_versions_are_refused_on_every_rank(results):
    for out in results:
        message = out["versions"]
        assert message is not None
        assert (f"the ranks of tp_group run different versions: transformers {out['real']} on rank 0; "
                f"{MISMATCHED} on rank 1") in message, message
        assert "torch" not in message.split("Install")[0], message  # only what differs is named
        assert "would run mismatched collectives" in message and "Install the same python, torch" in message


def test_different_parameter_placements_name_the_first_one(results):
    for out in results:
        message = out["plan"]
        assert message is not None
        assert "the ranks of tp_group made different plans with the same versions: their " in message, message
        assert ("the first parameter placed differently is model.layers.0.mlp.gate_proj.weight: "
                "S(0) (shape 128x64) on rank 0; R (shape 128x64) on rank 1") in message, message
        assert "another plan= or sequence_parallel" in message


def test_different_collectives_are_named(results):
    for out in results:
        message = out["sequence parallel"]
        assert message is not None
        # the parameters are placed alike, for other reasons (sequence parallelism names its own)
        assert "made different plans with the same versions: their collectives, params, sequence_parallel differ; " \
            "the first parameter with different reasons is " in message, message


def test_the_same_call_agrees(results):
    assert results[0]["again"] is None and results[1]["again"] is None
    assert results[0]["agreed"] == results[1]["agreed"]


def test_the_fingerprint_is_json_and_rank_independent_for_uneven_splits():
    """The plan of an uneven split (9 heads in 3 kv groups, MLP 100, vocabulary 1001 over 2 ranks) is the
    same data on both ranks: the planning of each rank (a fake group of that rank) gives one fingerprint."""
    import json

    from fxparallel.api import planned_graph, _meta_model
    from fxparallel.group import fake_group
    from fxparallel.load import resolve_source
    from fxparallel.plan_agreement import fingerprint
    from fxparallel.capture import GraphSpec
    from models import tiny_config

    config = tiny_config("llama", hidden_size=72, num_attention_heads=9, num_key_value_heads=3,
                         intermediate_size=100, vocab_size=1001)
    meta = _meta_model(resolve_source(config), 2, torch.float32, False)
    prints = []
    for rank in range(2):
        planned = planned_graph(meta, GraphSpec(("input_ids", "labels")), fake_group(2, rank), torch.device("cpu"),
                                torch.float32, report=True)
        assert planned.local.code  # each rank's own graph (its own local sizes)
        prints.append(fingerprint(planned.plan))
    assert prints[0] == prints[1]
    assert json.loads(json.dumps(prints[0])) == prints[0]
    assert planned.plan.uneven  # the split is uneven indeed
