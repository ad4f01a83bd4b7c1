"""Code the model chose for the meta device, made to run on the real one.

Models pick kernels by the device of their tensors: transformers' MoE load-balancing loss and its grouped_mm
experts count tokens per expert with an integer ``histc`` off CPU and a float one on CPU. Captured on the meta
device they take the integer branch, which CPU has no kernel for; on CPU each such count is taken in float32
and cast back (exact: counts of tokens stay far below 2**24)."""
from __future__ import annotations

import torch
import torch.fx as fx


def _is_histc(node: fx.Node) -> bool:
    return (node.op == "call_function" and node.target in (torch.histc, torch.ops.aten.histc.default)) or \
        (node.op == "call_method" and node.target == "histc")


def float_histograms_on_cpu(graph: fx.Graph, device: torch.device) -> None:
    if device.type != "cpu":
        return
    for node in [n for n in graph.nodes if _is_histc(n)]:
        counted = node.args[0]
        value = counted.meta.get("example_value") if isinstance(counted, fx.Node) else None
        if value is None or value.dtype.is_floating_point:
            continue
        with graph.inserting_before(node):
            as_float = graph.call_method("float", (counted,))
        node.replace_input_with(counted, as_float)
        with graph.inserting_after(node):
            back = graph.call_method("to", (node, value.dtype))
        node.replace_all_uses_with(back, delete_user_cb=lambda user: user is not back)
