"""Trainer's per-process counters, made the single device's: the tokens seen and the floating-point operations.

Trainer counts both on every process and sums the counts over all of them (``accelerator.gather`` of each batch's
tokens for ``include_num_input_tokens_seen``; ``distributed_broadcast_scalars`` of each process's
``floating_point_ops`` for ``total_flos``), as data parallelism needs: each process there has batches of its own.
The ranks of one tp group share their batch, so both sums count it once per tp rank (transformers' own ``tp_plan``
models too): ``num_input_tokens_seen`` and ``total_flos`` tp times the single device's, silently. So:

- ``total_flos``: asked by ``Trainer.floating_point_ops`` (``6 * tokens * num_parameters(exclude_embeddings=True)``),
  ``num_parameters`` answers this rank's share of the whole count (``flops_share``): the shares of a tp group add
  up to it, and Trainer's sum over all processes is the single device's;
- ``num_input_tokens_seen``: at the first training forward under a Trainer that counts tokens, the model adds a
  ``TrainerCallback`` to it (``Trainer.add_callback``) that divides what each optimizer step added to the count
  by the tp size, before Trainer logs it (``on_step_end``). Trainer counts after the forward, so the callback
  starts from the count before the step's first micro-batch."""
from __future__ import annotations

import weakref

from transformers import TrainerCallback

from .callers import TRAINER, frame_local, functions_on_stack

_FOLLOWED = weakref.WeakSet()  # the Trainers whose token count a model already follows


class TokensSeenOncePerGroup(TrainerCallback):
    """Divides each step's addition to ``state.num_input_tokens_seen`` by ``copies``, the processes that counted
    each batch (the tp size: every tp rank of a group counts the same tokens)."""

    def __init__(self, seen: int, copies: int):
        self.seen, self.copies = seen, copies

    def _correct(self, state) -> None:
        added = state.num_input_tokens_seen - self.seen
        state.num_input_tokens_seen = self.seen + added // self.copies
        self.seen = state.num_input_tokens_seen

    def on_step_end(self, args, state, control, **kwargs):
        self._correct(state)

    def on_train_end(self, args, state, control, **kwargs):
        self._correct(state)


def follow_trainer_tokens(tp: int) -> None:
    """Called by a training forward on tp > 1 ranks: under a Trainer's ``training_step`` that counts tokens, the
    first call adds ``TokensSeenOncePerGroup`` to that Trainer."""
    trainer = frame_local(TRAINER, "training_step", "self")
    if trainer is None or trainer in _FOLLOWED:
        return
    _FOLLOWED.add(trainer)
    if getattr(trainer.args, "include_num_input_tokens_seen", "no") not in ("no", False):
        trainer.add_callback(TokensSeenOncePerGroup(trainer.state.num_input_tokens_seen, tp))


def flops_share(total: int, rank: int, tp: int) -> int:
    """``total`` as this rank's share when ``Trainer.floating_point_ops`` asks (its caller), else ``total``: the
    shares of the tp ranks add up to it (``total // tp``, one more on the first ``total % tp`` ranks)."""
    if tp == 1 or "floating_point_ops" not in functions_on_stack(TRAINER, limit=3):
        return total
    return total // tp + (1 if rank < total % tp else 0)
