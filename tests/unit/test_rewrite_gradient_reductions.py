"""rewrite/gradient_reductions.py: copy_to_tp's output is a custom autograd Function's view, which torch
forbids modifying in place; a user that does (XLM's ``tensor *= mask``) gets a copy, unless something
reads the value after the write (a copy would hide the write from it)."""
import operator

import torch
import torch.fx as fx

from fxparallel.group import fake_group
from fxparallel.rewrite.gradient_reductions import insert_copy_to_tp


def _graph(read_after: bool):
    g = fx.Graph()
    x, m = g.placeholder("x"), g.placeholder("m")
    y = g.call_function(operator.imul, (x, m))
    outputs = (y, g.call_function(operator.add, (x, 1))) if read_after else (y,)
    g.output(outputs)
    return g, x, y


def test_a_value_modified_in_place_after_copy_to_tp_gets_a_copy():
    g, x, y = _graph(read_after=False)
    f = insert_copy_to_tp(g, x, [y], fake_group(1).handle)
    assert y.args[0].target == "clone" and y.args[0].args[0] is f
    gm = fx.GraphModule(torch.nn.Module(), g)
    leaf = torch.ones(3, requires_grad=True)
    (out,) = gm(leaf * 2, torch.full((3,), 3.0))
    out.sum().backward()  # without the copy: "Output 0 of _CopyToTP is a view and is being modified inplace"
    assert torch.equal(out, torch.full((3,), 6.0)) and torch.equal(leaf.grad, torch.full((3,), 6.0))


def test_no_copy_where_the_write_must_be_seen_by_a_later_reader():
    g, x, y = _graph(read_after=True)
    f = insert_copy_to_tp(g, x, [y], fake_group(1).handle)
    assert y.args[0] is f and not any(n.target == "clone" for n in g.nodes)


def test_users_after_a_write_into_the_value_get_their_own_copy_to_tp():
    """Gemma 3n writes into a replicated value between its sharded users: a view made before the write
    cannot be used after it, so the users after it read a copy_to_tp made after it."""
    g = fx.Graph()
    x = g.placeholder("x")
    before = g.call_function(operator.mul, (x, 2))
    write = g.call_function(operator.setitem, (x, 0, 5.0))
    after = g.call_function(operator.mul, (x, 3))
    g.output((before, after))
    insert_copy_to_tp(g, x, [before, after], fake_group(1).handle)
    first, second = before.args[0], after.args[0]
    assert first.target is second.target and first is not second and second.args[0] is x
    nodes = list(g.nodes)
    assert nodes.index(first) < nodes.index(before) < nodes.index(write) < nodes.index(second) < nodes.index(after)
    leaf = torch.ones(2, requires_grad=True)
    out_before, out_after = fx.GraphModule(torch.nn.Module(), g)(leaf * 1)
    (out_before.sum() + out_after.sum()).backward()  # one view across the write: "modified inplace" error
    assert torch.equal(out_after, torch.tensor([15.0, 3.0])) and torch.equal(leaf.grad, torch.tensor([2.0, 5.0]))
