"""TRL's ``GRPOTrainer`` at tp > 1: what is exact, and what is refused before any update.

accelerate gathers over every process, so each tp rank's rewards (the same completions: a sampling ``generate``
leaves the tp ranks' generators alike, ``generation/loop.py``) appear once per tp rank in the gathered batch.
Statistics of a group, or of a process's slice, are those of one device: GRPO's default advantages (the reward
less its group's mean, over its group's std), the loss and every gradient (tested against the same training at
TP=1). A standard deviation over the whole gathered batch is not: with each reward repeated ``tp`` times its
Bessel correction differs, and ``scale_rewards="batch"`` or ``multi_objective_aggregation="normalize_then_sum"``
would scale every advantage by it, silently. Those two are refused when GRPOTrainer first generates. The logged
``reward_std`` (and a reward function's ``.../std``) is that batch statistic, so it differs from one device's."""
from __future__ import annotations

from .callers import frame_local
from .errors import ArgumentError

_GRPO = "trl.trainer.grpo_trainer"
# GRPOConfig option (a GRPOTrainer attribute of the same name) -> the value that divides the advantages by the std
# of the whole gathered batch
_BATCH_STATISTICS = {"scale_rewards": "batch", "multi_objective_aggregation": "normalize_then_sum"}


def refuse_batch_statistics(tp: int) -> None:
    """Raise if this generate is GRPOTrainer's, at ``tp`` > 1, with an option that normalizes the advantages by the
    whole gathered batch (module docstring)."""
    if tp == 1:
        return
    trainer = frame_local(_GRPO, "_generate_single_turn", "self")
    if trainer is None:
        return
    for option, value in _BATCH_STATISTICS.items():
        if getattr(trainer, option, None) == value:
            raise ArgumentError(
                f"GRPOConfig({option}={value!r}) at tp={tp}: accelerate gathers each tp rank's rewards, the same "
                f"ones, so the standard deviation over the whole batch that {option}={value!r} divides the "
                f"advantages by would count each reward {tp} times and differ from one device's. Use the default "
                f"(scale_rewards='group', multi_objective_aggregation='sum_then_normalize'), which is exact; no "
                "weight was changed")
