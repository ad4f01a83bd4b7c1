"""``Trainer.evaluate()`` / ``predict()``: the model's output read as transformers' model gives it.

Trainer's ``prediction_step`` calls the model with labels and takes every field of its output but the loss as the
predictions (``outputs.items()``, less the config's ``keys_to_ignore_at_inference``), which it then pads, gathers
and hands to ``compute_metrics``. With labels the parallel model leaves the logits sharded by default and returns
this rank's vocabulary slice as ``local_logits`` with its ``vocab_range``: predictions that are a piece of the
vocabulary (an argmax over it is wrong) beside an int accelerate cannot gather. So within ``prediction_step``
(unless it was asked for the loss only) the complete logits are gathered and the output holds the fields
transformers' model returns."""
from __future__ import annotations

from .callers import TRAINER, frame_local, functions_on_stack


def predicting(training: bool, labels, gather_logits) -> bool:
    """Is this a call of Trainer's ``prediction_step`` (in eval mode) that keeps the logits as predictions (with
    labels, the gather left to the model)? The stack is read only for a labelled call in eval mode."""
    if training or labels is None or gather_logits is not None:
        return False
    if "prediction_step" not in functions_on_stack(TRAINER):
        return False
    return not frame_local(TRAINER, "prediction_step", "prediction_loss_only")
