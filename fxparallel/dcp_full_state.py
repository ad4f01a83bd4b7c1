"""torch's state-dict helpers asked for the full state dict: the complete tensors, not each rank's shards.

``torch.distributed.checkpoint.state_dict.get_model_state_dict`` / ``get_optimizer_state_dict`` / ``get_state_dict``
with ``StateDictOptions(full_state_dict=True)`` (how torchtitan and FSDP2 users export a model) gather the DTensors
of the state dict and leave every other tensor as it is. The parallel model's state dict (and its optimizer's)
holds plain shards, so the "full" state dict would be each rank's shards under the full names (tried at TP=2:
``q_proj`` [32, 64] of [64, 64], silently). Within those calls ``model.state_dict()`` and the optimizer's
``state_dict()`` answer the complete tensors instead, gathered over the tp group on every rank, on the CPU (torch
then keeps them on rank 0 alone where ``cpu_offload`` asks it to). ``set_state_dict(..., full_state_dict=True)``
hands the model complete tensors, which its ``load_state_dict`` cuts to the shards as it always does
(``full_state_loading.py``), and the optimizer complete states, paired with the parameters by name, which its
``load_state_dict`` cuts the same way here (a complete state loaded by position is refused:
``optimizer_checks.py``). Without ``full_state_dict`` the helpers get the shards described for DCP
(``dcp_state.py``, ``dcp_optimizer.py``), which ``dcp.save`` / ``dcp.load`` / ``set_state_dict`` round-trip
exactly."""
from __future__ import annotations

from .callers import frame_local

HELPERS = "torch.distributed.checkpoint.state_dict"


def full_state_dict_requested(kind: str) -> bool:
    """Is the state dict being taken for torch's helper of ``kind`` ("model" or "optim") with
    ``full_state_dict=True``?"""
    info = frame_local(HELPERS, f"_get_{kind}_state_dict", "info")
    return bool(getattr(info, "full_state_dict", False))


def full_state_dict_given(kind: str) -> bool:
    """Is a state dict being loaded by torch's ``set_{kind}_state_dict`` with ``full_state_dict=True`` (complete
    tensors, paired with the parameters by name)?"""
    info = frame_local(HELPERS, f"_load_{kind}_state_dict", "info")
    return bool(getattr(info, "full_state_dict", False))


def complete_state_dict(model, state_dict: dict, prefix: str, planned, to_rank0_only: bool) -> None:
    """Replace ``state_dict``'s parameters (``planned``: their names) by the complete tensors, in place (collective
    over the tp group): on every rank, or on tp rank 0 alone (``to_rank0_only``: the others get an empty dict).
    Buffers, whole on every rank, stay."""
    from .runtime.export import gather_full_state_dict

    full = gather_full_state_dict(model, to_rank0_only=to_rank0_only)
    whole = {k: v for k, v in state_dict.items() if k[len(prefix):] not in planned}
    state_dict.clear()
    if full or not to_rank0_only:
        state_dict.update(whole)
        state_dict.update({prefix + name: tensor for name, tensor in full.items()})
