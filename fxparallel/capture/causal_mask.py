"""Plain causal attention without a mask tensor, as transformers runs it outside Dynamo.

transformers skips building the causal mask for sdpa when no token is padded, the queries
are all the keys and no sliding window applies (``masking_utils._ignore_causal_mask_sdpa``);
sdpa then gets ``is_causal=True``. Under torch 2.13's Dynamo that test always says no (Dynamo
reports every compile as an export), so a captured forward built a batch x 1 x seq x seq mask
and every layer's sdpa turned it into a float mask and kept it for the backward pass:
O(seq^2) bytes per layer, and on a GPU no flash kernel. While a forward without a cache is
captured, this module answers the test for the one case it can decide from the sizes alone (no
window, no offset, equal lengths as symbols), adding no guard; any other case keeps
transformers' mask. Without an attention mask that is all it takes. With one, transformers reads
the mask (no padding: all ones); here the module reads it per call, in the exchange that checks
the ranks' arguments (``inputs.py``), and a mask without padding gets a graph of its own,
captured as ``unpadded``: the model still reads the mask wherever it reads it, only attention
skips it, as in transformers.

transformers also looks for packed sequences in the position ids (a position that does not
follow the one before starts a new sequence), and outside Dynamo drops that mask when there
is one sequence per row. A forward called without ``position_ids`` computes them itself
(0, 1, 2, ... per row), so there it is dropped too; with ``position_ids`` given, the graph
keeps the packed-sequence mask and the test above is never asked.

It also keeps transformers' ``repeat_kv`` (sdpa's ``enable_gqa`` off), as with a mask: the
planner splits the repeated heads the same way for any number of kv heads per rank.
"""
from __future__ import annotations

import contextlib
import functools
import threading

import torch
from torch.fx.experimental.symbolic_shapes import statically_known_true


def _plain_causal(padding_mask, q_length, kv_length, q_offset=0, kv_offset=0, local_attention_size=None, *,
                  unpadded: bool = False) -> bool:
    if (padding_mask is not None and not unpadded) or local_attention_size is not None:
        return False
    if not (isinstance(q_offset, int) and isinstance(kv_offset, int) and q_offset == 0 and kv_offset == 0):
        return False
    return bool(statically_known_true(q_length == kv_length))


def _no_gqa(*args, **kwargs) -> bool:
    return False


def _one_sequence_per_row(position_ids):
    return None


def _while_tracing(ours, original):
    """``ours`` inside Dynamo's trace (the capture), transformers' ``original`` anywhere else: a model run
    eagerly in another thread during a capture keeps transformers' own answers."""

    def decide(*args, **kwargs):
        if torch.compiler.is_compiling():
            return ours(*args, **kwargs)
        return original(*args, **kwargs)

    return decide


_CAPTURE = threading.RLock()  # one capture at a time holds the patch, with its own options


@contextlib.contextmanager
def causal_without_mask(positions_given: bool, unpadded: bool = False):
    """Within it, transformers' sdpa masks skip the plain causal case (``is_causal=True``) in what Dynamo
    traces; ``positions_given``: the forward is called with ``position_ids`` (which may pack sequences);
    ``unpadded``: with an attention mask that holds no padding."""
    from transformers import masking_utils
    from transformers.integrations import sdpa_attention

    wanted = [(masking_utils, "_ignore_causal_mask_sdpa", functools.partial(_plain_causal, unpadded=unpadded)),
              (sdpa_attention, "use_gqa_in_sdpa", _no_gqa)]
    if not positions_given:
        wanted.append((masking_utils, "find_packed_sequence_indices", _one_sequence_per_row))
    with _CAPTURE:
        present = [(module, name, ours, getattr(module, name)) for module, name, ours in wanted
                   if hasattr(module, name)]
        try:
            for module, name, ours, original in present:
                setattr(module, name, _while_tracing(ours, original))
            yield
        finally:
            for module, name, _, original in present:
                setattr(module, name, original)
