"""Stage 2: decide a placement for every parameter and value (rules -> solver -> plan)."""
from .placement import P, R, S, Placement
from .plan import CollectivePlan, ParamPlan, ShardingPlan
from .solver import GraphPlan, layer_pattern, solve

__all__ = ["P", "R", "S", "Placement", "CollectivePlan", "ParamPlan", "ShardingPlan", "GraphPlan", "layer_pattern",
           "solve"]
