"""fxparallel: automatic tensor parallelism for Hugging Face causal LMs, planned from the FX graph.

    model = fxparallel.parallelize("org/model", tp_group)
    out = model(input_ids=ids, labels=labels)
    print(model.plan)
"""
from .api import parallelize, plan_model
from .errors import CaptureError, CheckpointError, FxParallelError, GroupError, ShardingError
from .group import fake_group
from .plan import ShardingPlan

__all__ = ["parallelize", "plan_model", "ShardingPlan", "fake_group", "FxParallelError", "ShardingError", "CaptureError",
           "CheckpointError", "GroupError"]
__version__ = "0.1.0"
