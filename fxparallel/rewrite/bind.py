"""Pass: bind. Parameters and buffers become attributes under their Hugging Face names; size
symbols are read from the arguments; meta-device constants become the runtime device; dead
code goes (keeping in-place writes). After it the graph is this rank's runnable code."""
from __future__ import annotations

import torch
import torch.fx as fx

from ..capture.graph import eliminate_dead_code


def _map_devices(obj, device: torch.device):
    if isinstance(obj, torch.device) and obj.type == "meta":
        return device
    if isinstance(obj, (tuple, list)):
        return type(obj)(_map_devices(o, device) for o in obj)
    if isinstance(obj, dict):
        return {k: _map_devices(v, device) for k, v in obj.items()}
    if isinstance(obj, str) and obj == "meta":
        return str(device)
    return obj


def bind_inputs(graph: fx.Graph, captured, device: torch.device, attributes: dict) -> None:
    """Placeholders for parameters/buffers -> attributes; sizes -> read from arguments."""
    import warnings

    with warnings.catch_warnings():
        # the attributes live on the ParallelCausalLM, not on Dynamo's GraphModule: FX would warn per attribute
        warnings.simplefilter("ignore")
        _bind_inputs(graph, captured, device, attributes)


def _bind_inputs(graph: fx.Graph, captured, device: torch.device, attributes: dict) -> None:
    eliminate_dead_code(graph)
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    first_real = next(n for n in graph.nodes if n.op != "placeholder")
    new_inputs = {}
    with graph.inserting_before(placeholders[0]):
        for node in placeholders:
            if node.name in captured.inputs:
                new_inputs[captured.inputs[node.name]] = graph.placeholder(captured.inputs[node.name])
    for node in placeholders:
        if node.name in captured.inputs:
            node.replace_all_uses_with(new_inputs[captured.inputs[node.name]])
    with graph.inserting_before(first_real):
        for node in placeholders:
            if node.name in captured.params or node.name in captured.buffers:
                target = captured.params.get(node.name) or captured.buffers[node.name]
                attr = graph.get_attr(target)
                attr.meta = dict(node.meta)
                node.replace_all_uses_with(attr)
            elif node.name in captured.symbols:
                arg_name, dim = captured.symbols[node.name]
                size = graph.call_function(torch.ops.aten.sym_size.int, (new_inputs[arg_name], dim))
                node.replace_all_uses_with(size)
    for node in placeholders:
        graph.erase_node(node)
    # attributes of Dynamo's own module (e.g. the bodies of custom autograd functions)
    owner = captured.gm
    for node in graph.nodes:
        if node.op == "get_attr" and node.target not in captured.params.values() and \
                node.target not in captured.buffers.values() and hasattr(owner, str(node.target)):
            name = f"_fxparallel_graph_{id(graph)}_{node.target}".replace(".", "_")
            attributes[name] = getattr(owner, str(node.target))
            node.target = name
    for node in graph.nodes:
        node.args = _map_devices(node.args, device)
        node.kwargs = _map_devices(node.kwargs, device)


def generate_forward(graph: fx.Graph):
    """Python code of the local graph, as a function ``forward(self, **arguments)`` whose
    ``self`` is the module that owns the parameters."""
    import warnings

    from torch.fx.graph_module import _forward_from_src

    from ..capture.names import check_graph_targets

    check_graph_targets(graph)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # FX warns about module paths it cannot fetch; they are attributes here
        code = graph.python_code(root_module="self")
    return _forward_from_src(code.src, dict(code.globals)), code.src
