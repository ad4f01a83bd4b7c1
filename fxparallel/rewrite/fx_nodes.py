"""Reading FX nodes, shared by the rewrite passes: an argument by position or name, the attention op,
sizes compared symbolically."""
from __future__ import annotations

import torch
import torch.fx as fx
import torch.nn.functional as F

SDPA = (F.scaled_dot_product_attention, torch._C._nn.scaled_dot_product_attention)
SDPA_ARGS = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")


def node_arg(node: fx.Node, index: int, name: str, default=None):
    """The argument of a call node given at ``index`` or as ``name``."""
    if len(node.args) > index:
        return node.args[index]
    return node.kwargs.get(name, default)


def _expr(size):
    return size.node.expr if isinstance(size, torch.SymInt) else size


def same_size(a, b) -> bool:
    """Whether two sizes (ints or symbolic) are the same expression."""
    try:
        return bool(_expr(a) == _expr(b))
    except TypeError:
        return False
