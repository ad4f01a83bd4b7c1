"""Sequence parallelism: activations outside attention/MLP sharded along the sequence.

Same numbers as one device (loss, logits, every gradient, 1e-5 fp32), the collectives
counted from the rewritten graph, plain TP's communication volume, and a clear error for a
sequence that does not divide by tp."""
from __future__ import annotations

import os
import sys

import pytest
import torch

from distributed import run_ranks

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))

TOL = 1e-5


def _compare(rank, tp, paths):
    import torch.distributed as dist

    import fxparallel
    from checks import batch, compare
    from fxparallel.errors import ShardingError
    from models import reference

    results = {}
    for name, path in paths.items():
        model = fxparallel.parallelize(path, dist.group.WORLD, dtype=torch.float32, sequence_parallel=True)
        ref = reference(path)
        ids = batch(model.config.vocab_size, b=2, s=8)
        errors = compare(model, ref, rank, tp, ids=ids)
        r = results[name] = {k: errors[k] for k in ("loss", "logits", "grad")}
        # another length (one graph serves it) and a batch of one (a new graph, batch fixed at 1)
        for other in (batch(model.config.vocab_size, b=2, s=4 * tp, seed=3), ids[:1]):
            r["loss"] = max(r["loss"], abs(model(input_ids=other, labels=other).loss.item()
                                           - ref(input_ids=other, labels=other).loss.item()))
        try:
            model(input_ids=ids[:, :7], labels=ids[:, :7])
            r["error"] = None
        except ShardingError as err:
            r["error"] = str(err)
        r["kept"] = model.plan.sequence_parallel_kept
    return results


@pytest.fixture(scope="module")
def sp_checkpoints(tmp_path_factory, checkpoints):
    from models import save_checkpoint
    from tiny_configs import tiny_config as arch_config

    root = tmp_path_factory.mktemp("sp")
    return {
        "llama": checkpoints["llama"],  # the session's tiny Llama (conftest.py)
        "gpt2": save_checkpoint(arch_config("gpt2"), str(root / "gpt2")),
        "opt": save_checkpoint(arch_config("opt"), str(root / "opt")),
    }


@pytest.mark.parametrize("tp, names", [(2, ("llama", "gpt2")), (4, ("opt",))])
def test_sequence_parallel_matches_single_device(sp_checkpoints, tp, names):
    paths = {n: sp_checkpoints[n] for n in names}
    for results in run_ranks(tp, _compare, paths, timeout=900):
        for name, r in results.items():
            for key in ("loss", "logits", "grad"):
                assert r[key] < TOL, (name, tp, key, r[key])
            assert r["error"] is not None and "sequence length 7" in r["error"] and f"tp size {tp}" in r["error"]


def _plans(config, tp):
    import fxparallel

    tp_plan, _ = fxparallel.plan_model(config, tp)
    sp_plan, graph = fxparallel.plan_model(config, tp, sequence_parallel=True)
    return tp_plan, sp_plan, graph.code


def _calls(code: str, name: str) -> int:
    return code.count(f"collectives_{name}(")


def _norm_params(plan) -> int:
    return sum(1 for p in plan.params if "norm" in p.name and "sequence shards" in p.reason)


@pytest.mark.parametrize("family, layers, tp", [("llama", 2, 2), ("llama", 3, 4), ("qwen3", 2, 2)])
def test_collectives_counted_from_the_graph(family, layers, tp):
    """Each forward all-reduce of plain TP becomes a reduce-scatter, each copy_to_tp an all-gather
    (backward: all-gather and reduce-scatter); only norm weights add fixed-size all-reduces."""
    from models import tiny_config

    tp_plan, sp, code = _plans(tiny_config(family, num_hidden_layers=layers), tp)
    L = layers
    assert sp.sequence_parallel and not tp_plan.sequence_parallel
    assert sp.count("all_reduce", "forward") == 0
    assert sp.count("reduce_scatter", "forward") == tp_plan.count("all_reduce", "forward") == 2 * L + 1
    assert sp.count("all_gather", "forward") == (2 * L + 1) + 1  # before q/k/v, gate/up, lm_head; loss statistics
    assert sp.count("all_gather", "backward") == sp.count("reduce_scatter", "backward") == 2 * L + 1
    # backward all-reduces: parameter gradients only, fixed size per step (2L+1 norms on sequence shards,
    # plus Qwen3's q/k norms, reduced as in plain TP)
    grads = [c for c in sp.collectives if c.kind == "all_reduce" and c.direction == "backward"]
    assert all(c.bytes_per_token == 0 and c.bytes_per_call > 0 for c in grads)
    assert _norm_params(sp) == 2 * L + 1
    assert sum(c.count for c in grads) == 2 * L + 1 + sum(
        c.count for c in tp_plan.collectives if c.direction == "backward" and c.bytes_per_call)
    # plain TP's communication volume, per token and direction (ring algorithms)
    for direction in ("forward", "backward"):
        assert sp.wire_bytes_per_token(direction) == pytest.approx(tp_plan.wire_bytes_per_token(direction))
    # the same counts straight from the generated code
    assert _calls(code, "reduce_scatter_seq") == _calls(code, "gather_seq_to_tp") == 2 * L + 1
    assert _calls(code, "all_reduce") == _calls(code, "gather_seq") == 0
    assert not sp.fallbacks and not sp.sequence_parallel_kept
    assert _round_trips(sp)


def _round_trips(plan) -> bool:
    import fxparallel

    return fxparallel.ShardingPlan.from_json(plan.to_json()) == plan


def test_layernorm_biases_flattened_tokens_and_a_region_left_plain_tp():
    """OPT: LayerNorm weights and biases and row-layer biases on shards, a feed-forward on
    [batch*seq, hidden] rows, and tied logits that feed a cross-entropy the pass does not know
    as token-wise: that region keeps its all-reduce (recorded with the reason)."""
    from tiny_configs import tiny_config

    tp_plan, sp, code = _plans(tiny_config("opt"), 2)
    assert sp.count("all_reduce", "forward") == 1  # the logits
    assert len(sp.sequence_parallel_kept) == 1
    assert "cross_entropy is not known to be token-wise" in sp.sequence_parallel_kept[0]
    assert sp.count("reduce_scatter", "forward") == tp_plan.count("all_reduce", "forward") - 1
    biases = [p.name for p in sp.params if "sequence shards" in p.reason and p.name.endswith("bias")]
    assert len(biases) == 2 * 2 + 2 * 2 + 1  # two LayerNorms and two row biases per layer, final LayerNorm
    # never more than plain TP (less where two embeddings summed on shards share one gather), in total equal
    assert sp.wire_bytes_per_token("forward") <= tp_plan.wire_bytes_per_token("forward")
    assert sp.wire_bytes_per_token() == pytest.approx(tp_plan.wire_bytes_per_token())


def test_an_op_not_known_token_wise_keeps_its_region_plain_tp(monkeypatch):
    """Token-wise-ness is checked op by op: take rsqrt off the list and every norm's region
    keeps its all-reduces, each listed with the op and the reason."""
    import fxparallel
    from fxparallel.plan import op_traits
    from models import tiny_config

    monkeypatch.setattr(op_traits, "TOKEN_WISE", op_traits.TOKEN_WISE - {"rsqrt"})
    monkeypatch.setenv("FXPARALLEL_GRAPH_CACHE", "off")  # a graph planned earlier in the session would hide the patch
    plan, graph = fxparallel.plan_model(tiny_config("llama"), 2, sequence_parallel=True)
    assert plan.count("all_reduce", "forward") == 2 * 2 + 1 and plan.count("reduce_scatter", "forward") == 0
    assert plan.sequence_parallel_kept and all("rsqrt is not known to be token-wise" in k
                                               for k in plan.sequence_parallel_kept)
    assert _calls(graph.code, "reduce_scatter_seq") == _calls(graph.code, "gather_seq_to_tp") == 0
    assert "left plain TP by sequence parallelism" in str(plan)
