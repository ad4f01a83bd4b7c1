"""Context parallelism under ``transformers.Trainer``: ``TrainingArguments(parallelism_config=ParallelismConfig(
cp_size=N))`` on a model parallelized with ``cp_group``.

In each training step (and each labelled evaluation step) Trainer enters accelerate's ``maybe_context_parallel``,
which is torch's ``context_parallel`` over accelerate's cp mesh. It cuts ``input_ids``, ``labels``,
``shift_labels`` (the labels shifted by one before the cut, made by Trainer when absent), ``position_ids`` (the
global positions, made when absent) and a 2-D attention mask in place. The cut is the head-tail one: 2*cp chunks,
cp rank i keeps chunks i and 2cp-1-i. That is the parallel model's own context-parallel layout
(``ops/context_parallel_attention.py``). torch also patches the name ``F.scaled_dot_product_attention`` with its
ring attention for the step; the model's attention calls the builtin, which is not patched.

The model then:

- takes ``shift_labels`` as its labels: they are already shifted, which is what its context-parallel graphs take.
  The unshifted chunks of ``labels`` are not read;
- checks ``position_ids`` against the head-tail layout. A sequence length that does not divide by 2*cp makes torch
  cut contiguously, and that is refused there;
- drops an attention mask only when every cp rank's chunks of it are all ones, agreed in one all-reduce over cp
  (``ops/context_parallel_attention.prepare_arguments``); otherwise it is refused on every cp rank;
- normalizes by ``num_items_in_batch``, which Trainer counts over the whole rows before the cut;
- gets its gradients averaged over dp x cp by the DTensor views' data dim (``trainer_data_parallel.view_mesh``).
  Trainer multiplies the loss by dp * cp, so that average is the global batch's gradient.

Refused, naming what to do:

- a model without ``cp_group`` in a step torch has cut;
- a model with ``cp_group`` in Trainer's hands, called outside such a step (the cp ranks would get whole rows);
- predictions (``predict``, ``evaluate`` with logits kept), because the cp ranks hold chunks of the rows.

On GPUs accelerate asks for an FSDP plugin when ``cp_size > 1``, because it shards transformers' models itself. The
parallel model holds its own shards, so when Trainer first reads ``model.tp_size`` the model sets accelerate's own
switch for that case, ``ACCELERATE_ALLOW_CP_STANDALONE=true``, unless the user has set it."""
from __future__ import annotations

import os

import torch.distributed as dist
import torch.nn.functional as F

from .errors import ContextParallelError
from .ops.dropout_kernels import SDPA

STANDALONE = "ACCELERATE_ALLOW_CP_STANDALONE"
PARALLELIZE_WITH_CP = ("parallelize(..., mesh['tp'], cp_group=mesh['cp']) with mesh = init_device_mesh(device, "
                       "(dp, cp, tp), mesh_dim_names=('dp', 'cp', 'tp')), accelerate's layout (docs/training.md, "
                       "\"Context parallelism under Trainer\")")


def cut_by_torch() -> bool:
    """Is this call inside torch's ``context_parallel`` (Trainer's step under ``ParallelismConfig(cp_size=N)``),
    which has cut the batch's sequences into this cp rank's chunks? It patches ``F.scaled_dot_product_attention``
    for its time."""
    return F.scaled_dot_product_attention is not SDPA


def enter_trainer(model) -> None:
    """When Trainer first reads ``model.tp_size`` (building accelerate's arguments): its ``ParallelismConfig`` must
    give the model's sizes, and accelerate's switch for context parallelism without its FSDP plugin is set (see
    the module docstring). Trainer then sets ``tp_size`` and ``dp_shard_size`` on the config it was given, but
    accelerate builds its mesh from the sizes the config was made with, so all of them are needed up front
    (with ``cp_size`` alone, 4 ranks at tp 2 x cp 2 got a mesh of 2 ranks and failed in torch)."""
    from .callers import TRAINER, frame_local

    os.environ.setdefault(STANDALONE, "true")
    args = frame_local(TRAINER, "_build_accelerator_args", "args")
    if args is None:  # (accelerate used directly, or a later read)
        return
    tp, cp = model.tp_group.size, model.cp_size
    dp = dist.get_world_size() // (tp * cp)
    given = args.get("parallelism_config")
    sizes = None if given is None else (given.dp_replicate_size * given.dp_shard_size, given.cp_size, given.tp_size)
    if sizes != (dp, cp, tp):
        raise ContextParallelError(
            f"Trainer with the parallel model's context parallelism (cp group of {cp}, tp group of {tp}, "
            f"{dp} data-parallel ranks) needs TrainingArguments(parallelism_config=ParallelismConfig("
            f"{f'dp_shard_size={dp}, ' if dp > 1 else ''}cp_size={cp}{f', tp_size={tp}' if tp > 1 else ''})), "
            "every size given: accelerate builds its mesh and cuts the sequences from it; "
            + ("none was given" if given is None else
               f"the one given has dp={sizes[0]}, cp={sizes[1]}, tp={sizes[2]}"))


def step_labels(model, labels, shift_labels, fused_lm_head: bool, in_trainer: bool, predicting: bool):
    """(labels, shift_labels) for the forward of ``model`` with a cp group, or in a step torch has cut; refuses
    what the module docstring lists. ``in_trainer``: Trainer holds the model (its DTensor views exist)."""
    cut = cut_by_torch()
    if model.cp_group is None:
        if cut:
            raise ContextParallelError(
                "torch's context_parallel (Trainer / accelerate with ParallelismConfig(cp_size=N)) cut this batch "
                "into chunks of each sequence, but the parallel model was parallelized without cp_group, so its "
                f"attention would see this rank's chunks only: {PARALLELIZE_WITH_CP}")
        return labels, shift_labels
    if in_trainer and not cut:
        raise ContextParallelError(
            f"the parallel model has a cp group of {model.cp_size} ranks, so each call must get this rank's chunks of "
            "the sequences, but Trainer called it with whole rows (outside a context-parallel step). Pass "
            f"TrainingArguments(parallelism_config=ParallelismConfig(cp_size={model.cp_size})) so that Trainer cuts "
            "them. Under context parallelism Trainer cuts only labelled batches, so evaluation needs labels")
    if predicting:
        raise ContextParallelError(
            "Trainer.predict / evaluate keeping the logits under context parallelism: each cp rank holds chunks of "
            "the sequences, so the predictions would be out of order. Use TrainingArguments(prediction_loss_only="
            "True): the evaluation loss is exact")
    if shift_labels is not None and not fused_lm_head:
        return shift_labels, None  # Trainer's: shifted before the cut, what the context-parallel graphs take
    return labels, shift_labels
