"""plan/plan.py's ShardingPlan as data, without processes: placements are typed (``Placement``),
written to JSON as their strings and read back typed, so a saved plan round-trips byte for byte."""
import json

from fxparallel.plan.placement import R, S, Placement
from fxparallel.plan.plan import UNUSED, CollectivePlan, ParamPlan, ShardingPlan


def _plan() -> ShardingPlan:
    return ShardingPlan("llama", 2, params=[
        ParamPlan("q.weight", (72, 72), S(0), "column", (), ((48, 24),)),
        ParamPlan("qkv.weight", (6, 3), S(0, (4, 1, 1), whole=(1, 2)), "fused"),
        ParamPlan("down.weight", (16, 64), S(1), "row"),
        ParamPlan("embed.weight", (256, 16), S(0), "vocab", ("lm_head.weight",)),
        ParamPlan("norm.weight", (16,), R, "replicated"),
        ParamPlan("vision.weight", (4, 4), R, UNUSED),
    ], collectives=[CollectivePlan("all_reduce", "forward", "model.layers.*.mlp", 64.0, 2)],
        fallbacks=["cumsum (<top>): no sharding rule"], uneven={72: (48, 24)})


def test_placements_are_typed_and_written_as_strings():
    plan = _plan()
    assert all(isinstance(p.placement, Placement) for p in plan.params)
    written = [p["placement"] for p in json.loads(plan.to_json())["params"]]
    assert written == ["S(0)", "S(0)[4,1R,1R]", "S(1)", "S(0)", "R", "R"]


def test_json_round_trip_is_identical_and_typed():
    plan = _plan()
    text = plan.to_json()
    again = ShardingPlan.from_json(text)
    assert again.to_json() == text
    assert again == plan
    assert again.param("qkv.weight").placement == S(0, (4, 1, 1), whole=(1, 2))
    assert again.param("lm_head.weight").placement == S(0) and again.param("norm.weight").placement == R


def test_a_placement_given_as_text_is_parsed_once():
    assert ParamPlan("w", (4, 6), "S(1)", "column").placement == S(1)


def test_a_planned_model_round_trips():
    import fxparallel
    from models import tiny_config

    plan, _ = fxparallel.plan_model(tiny_config("llama"), 2)
    text = plan.to_json()
    assert ShardingPlan.from_json(text).to_json() == text
    assert '"placement": "S(0)"' in text and '"placement": "R"' in text
