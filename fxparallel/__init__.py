"""fxparallel: automatic tensor parallelism for Hugging Face causal LMs, planned from the FX graph.

    model = fxparallel.parallelize("org/model", tp_group)
    out = model(input_ids=ids, labels=labels)
    print(model.plan)
"""
from .api import parallelize, plan_model
from .errors import CaptureError, CheckpointError, FxParallelError, GroupError, ShardingError
from .group import fake_group
from .plan import ShardingPlan
from .trainer_checkpoints import TrainerCheckpoints
from .version import __version__  # noqa: F401 - fxparallel.__version__

__all__ = ["parallelize", "plan_model", "ShardingPlan", "fake_group", "FxParallelError", "ShardingError", "CaptureError",
           "CheckpointError", "GroupError", "TrainerCheckpoints"]
