"""A generation graph runs a custom autograd function's forward body in place of the function.

Dynamo captures a ``torch.autograd.Function`` in model code (RecurrentGemma's ``SqrtBoundDerivative``)
as ``autograd_function_apply(fwd_body, bwd_body, *args)``. Its custom backward matters for training;
a generation graph never runs a backward, and ``torch.compile`` cannot trace the captured function
again (Dynamo: unsupported ``autograd_function_apply``), so ``compile_config`` could not compile the
decode step. Here the forward body's nodes are copied into the graph in the function's place (the
function returns what its body returns first; the rest is what it saves for the backward), so a
generation graph holds plain ops only and is planned as any other.
"""
from __future__ import annotations

import operator

import torch
import torch.fx as fx

_APPLY = torch.ops.higher_order.autograd_function_apply


def inline_custom_forwards(gm: fx.GraphModule) -> int:
    """Replace every custom autograd function of ``gm`` by its forward body; returns how many."""
    applies = [n for n in gm.graph.nodes if n.op == "call_function" and n.target is _APPLY]
    for node in applies:
        _inline(gm, node)
    if applies:
        for node in [n for n in gm.graph.nodes if n.op == "get_attr" and not n.users]:
            gm.graph.erase_node(node)
        gm.delete_all_unused_submodules()
        gm.recompile()
    return len(applies)


def _inline(gm: fx.GraphModule, node: fx.Node) -> None:
    body = getattr(gm, node.args[0].target)
    inputs = [n for n in body.graph.nodes if n.op == "placeholder"]
    args = node.args[2:]
    if len(inputs) != len(args):
        raise ValueError(f"custom autograd function {node.name}: its forward body takes {len(inputs)} inputs, "
                         f"the function {len(args)}")
    env = dict(zip(inputs, args))
    result = None
    with gm.graph.inserting_before(node):
        for inner in body.graph.nodes:
            if inner.op == "placeholder":
                continue
            if inner.op == "output":
                result = fx.map_arg(inner.args[0], env.__getitem__)[0]  # (what it returns, what it saves)
                break
            if inner.op == "get_attr":  # a constant of the body: kept under a name of the graph's own
                name = f"{node.args[0].target}_{inner.target}".replace(".", "_")
                setattr(gm, name, getattr(body, inner.target))
                env[inner] = gm.graph.get_attr(name)
                env[inner].meta = dict(inner.meta)
                continue
            env[inner] = gm.graph.node_copy(inner, env.__getitem__)
    if isinstance(result, (tuple, list)):
        for user in list(node.users):
            if not (user.op == "call_function" and user.target is operator.getitem and isinstance(user.args[1], int)):
                raise ValueError(f"custom autograd function {node.name}: its tuple result is read by {user.name}, "
                                 "not by an index")
            user.replace_all_uses_with(result[user.args[1]])
            gm.graph.erase_node(user)
    else:
        node.replace_all_uses_with(result)
    gm.graph.erase_node(node)
