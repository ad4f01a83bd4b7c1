"""accelerate's checkpoint calls on the parallel model: the complete weights, or a refusal before anything is written.

accelerate writes a model's state dict from its main process alone, taking it from ``Accelerator.get_state_dict``,
which for the sharded models it knows (FSDP, DeepSpeed ZeRO-3 and AutoTP) answers the complete, consolidated
tensors. The parallel model's ``state_dict()`` is this rank's shards (nn.Module's convention, and what DCP reads):
written by the main process alone they would be part of a checkpoint, which ``accelerator.load_state`` then loads
into every rank (tried at TP=2: rank 1's ``q_proj`` took rank 0's shard, silently). So, in the model's
``state_dict()`` post-hook:

- called from ``Accelerator.get_state_dict`` (``accelerator.save_model(model, dir)``, or by hand): the complete
  tensors, gathered to tp rank 0 (collective: every rank makes the call, as accelerate's own callers do); the other
  ranks get an empty dict, as accelerate's FSDP2 path answers with ``full_state_dict`` and CPU offload;
- within ``Accelerator.save_state``: refused, since it also writes the main process's optimizer states alone (this
  rank's moments, which ``load_state`` would hand every rank), before anything is written.
"""
from __future__ import annotations

from .callers import functions_on_stack
from .dcp_full_state import complete_state_dict
from .errors import CheckpointError

SAVE_STATE_REFUSAL = (
    "accelerator.save_state() cannot checkpoint the parallel model: accelerate writes the model's and the "
    "optimizer's state dicts from its main process alone, and here each rank holds its own shards and optimizer "
    "moments (accelerator.load_state would hand every rank the main process's). Save the weights with "
    "accelerator.save_model(model, dir) or model.save_pretrained(dir) (complete tensors), and the training state "
    "with torch.distributed.checkpoint: dcp.save({'model': model.state_dict(), 'optim': optimizer.state_dict()}, "
    "checkpoint_id=dir), full-shape tensors that load at any tp size (docs/training.md); under Trainer, "
    "fxparallel.TrainerCheckpoints()")


def accelerate_caller():
    """"save_state" while ``Accelerator.save_state`` is on the stack, else "get_state_dict" while
    ``Accelerator.get_state_dict`` is, else None."""
    running = functions_on_stack("accelerate.accelerator")
    return next((name for name in ("save_state", "get_state_dict") if name in running), None)


def complete_for_accelerate(model, state_dict: dict, prefix: str, planned) -> bool:
    """Answer accelerate's calls (see the module docstring) in ``state_dict``, in place; False where the call is
    not accelerate's and the shards stay. ``planned``: the names of the planned parameters."""
    caller = accelerate_caller()
    if caller is None:
        return False
    if caller == "save_state":
        raise CheckpointError(SAVE_STATE_REFUSAL)
    complete_state_dict(model, state_dict, prefix, planned, to_rank0_only=True)
    return True
