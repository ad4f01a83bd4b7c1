"""The ``context_parallel`` pass: every ``scaled_dot_product_attention`` of the local graph becomes
``context_parallel_attention`` over the cp group (``ops/context_parallel_attention.py``, whose
docstring gives the layout and why attention stays exact)."""
from __future__ import annotations

import operator
from typing import Optional

import torch.fx as fx

from ..group import TPGroup
from ..ops.context_parallel_attention import context_parallel_attention
from ..ops.dropout_kernels import attention_dropout
from .fx_nodes import SDPA, SDPA_ARGS, node_arg


def apply_context_parallel(graph: fx.Graph, group: TPGroup) -> int:
    """Replace every sdpa node by ``context_parallel_attention`` over ``group``; returns how many."""
    count = 0
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target not in SDPA + (attention_dropout,):
            continue
        q, k, v = (node_arg(node, i, SDPA_ARGS[i]) for i in range(3))
        gqa = bool(node_arg(node, 7, "enable_gqa", False))
        k_source, v_source = _before_repeat_kv(k), _before_repeat_kv(v)
        if k_source is not None and v_source is not None:  # gather the kv heads, expand after
            k, v, gqa = k_source, v_source, True
        dropout = {}
        if node.target is attention_dropout:  # training: rows of this rank's chunks of the logical mask
            dropout = {"dropout_p": node_arg(node, 4, "dropout_p"), "cuts": node.kwargs["cuts"], "training": None}
        node.target = context_parallel_attention
        node.args = (q, k, v, group.handle, node_arg(node, 6, "scale"), gqa)
        node.kwargs = dropout
        count += 1
    _drop_unused(graph)  # the model's own (local) mask
    return count


def _before_repeat_kv(node) -> Optional[fx.Node]:
    """The key/value heads before transformers' ``repeat_kv`` (x[:, :, None].expand(b, kv, n, s, d)
    .reshape(b, kv*n, s, d), i.e. each kv head repeated n times in place), else None. Gathering
    them instead of the expanded heads sends n times fewer bytes; the expansion is redone after."""
    if not (isinstance(node, fx.Node) and node.op == "call_method" and node.target == "reshape"):
        return None
    expand = node.args[0]
    if not (isinstance(expand, fx.Node) and expand.op == "call_method" and expand.target == "expand"):
        return None
    unsqueeze = expand.args[0]
    if not (isinstance(unsqueeze, fx.Node) and unsqueeze.op == "call_function"
            and unsqueeze.target is operator.getitem):
        return None
    index = unsqueeze.args[1]
    full = slice(None, None, None)
    if index != (full, full, None, full, full) or len(node.args) != 5 or len(expand.args) != 6:
        return None
    return unsqueeze.args[0]


def _drop_unused(graph: fx.Graph) -> None:
    """Dead-code elimination without FX's lint (the bound graph's attributes live on our module)."""
    for node in reversed(list(graph.nodes)):
        if node.op not in ("placeholder", "output") and not node.users and not node.is_impure():
            graph.erase_node(node)


