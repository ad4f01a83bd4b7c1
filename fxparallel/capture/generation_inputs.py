"""What transformers' ``generate`` feeds the model at a step, asked of the meta model's own
``prepare_inputs_for_generation``: the parallel model's loop (generation/loop.py) passes the same."""
from __future__ import annotations

from typing import Optional

import torch

from .static_cache import cache_argument

# what the loop passes (or transformers' loop passes and the graphs need not: flags, the cache, its positions)
_PASSED = {"input_ids", "attention_mask", "position_ids", "use_cache", "is_first_iteration", "cache_position",
           "logits_to_keep", "past_key_values", "cache", "return_dict"}


def decodes_without_mask(model, cache, batch: int, length: int) -> bool:
    """Does transformers' generate leave the attention mask out of a decode step of this model (its
    ``prepare_inputs_for_generation`` says: Mamba, whose layers would mask the new token with the whole mask)?"""
    try:
        step = model.prepare_inputs_for_generation(
            torch.zeros(batch, 1, dtype=torch.long, device="meta"), use_cache=True, is_first_iteration=False,
            attention_mask=torch.ones(batch, length, dtype=torch.long, device="meta"),
            **cache_argument(model, cache))
    except Exception:  # noqa: BLE001 - a model whose preparation needs more: the mask is passed as it is
        return False
    return "attention_mask" in step and step["attention_mask"] is None


def inputs_beyond_tokens(model) -> Optional[str]:
    """Why transformers' generate without a cache feeds ``model`` more than its tokens, mask and positions
    (XLNet's permutation mask and target mapping, XLM's language ids, a token appended to the sequence), or
    None where it feeds just those: then a forward over the sequence so far is what transformers runs."""
    ids = torch.zeros(2, 5, dtype=torch.long, device="meta")
    try:
        step = model.prepare_inputs_for_generation(ids, use_cache=False, is_first_iteration=True,
                                                   attention_mask=torch.ones_like(ids))
    except Exception as err:  # noqa: BLE001 - its preparation needs what the loop does not have
        return f"its prepare_inputs_for_generation needs more than tokens and a mask ({type(err).__name__}: {err})"
    extra = sorted(k for k, v in step.items() if k not in _PASSED and v is not None)
    appended = tuple(step["input_ids"].shape) != tuple(ids.shape) if "input_ids" in step else False
    if not extra and not appended:
        return None
    what = [f"passes {', '.join(extra)}"] if extra else []
    return "its generate " + " and ".join(what + (["appends a token to the sequence"] if appended else []))
