"""plan/rules/reductions.py: a reduction over other dims keeps the shard (moved to where the dim lands,
or kept with keepdim and by the shape-keeping softmax / cumsum); sum and mean over the sharded dim give a
partial sum (mean rescaled by the local op ``mean_of_full``); any other reduction over it runs whole."""
import torch
from rule_graphs import capture, inputs_of, strategies

from fxparallel.plan.placement import P, R, S
from fxparallel.plan.rules.base import LocalOp


def _found(fn, placement, shape=(4, 6, 16)):
    gm = capture(fn, shape)
    (x,) = inputs_of(gm)
    reduction = next(n for n in gm.graph.nodes if n.op in ("call_method", "call_function"))
    return x, strategies(reduction, {x: placement})


def test_a_shard_outside_the_reduced_dims_follows_its_dim():
    for fn, out in ((lambda x: x.sum(1), S(1)), (lambda x: x.sum(1, keepdim=True), S(2)),
                    (lambda x: x.sum((0, 1)), S(0)), (lambda x: x.amax(0), S(1)), (lambda x: x.softmax(1), S(2)),
                    (lambda x: torch.cumsum(x, 1), S(2)), (lambda x: x.norm(dim=1), S(1))):
        x, found = _found(fn, S(2))
        assert [(s.inputs, s.output) for s in found] == [({x: S(2)}, out), ({x: R}, R)]
    x, found = _found(lambda x: x.sum(1), S(0, block=2))
    assert found[0].output == S(0, block=2)


def test_sum_and_mean_over_the_shard_are_partial_sums():
    x, found = _found(lambda x: x.sum(-1), S(2))
    assert (found[0].inputs, found[0].output, found[0].local) == ({x: S(2)}, P, None)
    assert found[0].own_bytes == 4 * 6 * 4  # the reduced [4, 6] float32 value, per token of the example
    x, found = _found(lambda x: x.sum(), S(2))
    assert found[0].output == P
    x, found = _found(lambda x: x.mean(-1, keepdim=True), S(2))
    assert found[0].output == P and found[0].local == LocalOp.of("mean_of_full", parts=(16,))
    x, found = _found(lambda x: x.mean(-1), S(2, segments=(8, 8)))
    assert found[0].local == LocalOp.of("mean_of_full", parts=(8, 8))


def test_other_reductions_over_the_shard_run_whole():
    for fn in (lambda x: x.amax(-1), lambda x: x.softmax(-1), lambda x: x.logsumexp(2), lambda x: x.cumsum(2)):
        x, found = _found(fn, S(2))
        assert [(s.inputs, s.output) for s in found] == [({x: R}, R)]


def test_dim_and_keepdim_are_read_where_each_signature_puts_them():
    """``norm(x, p, dim, keepdim)`` and ``std / var(x, dim, unbiased, keepdim)`` take other positions than
    ``sum(x, dim, keepdim)``: ``x.norm(2, 0)`` reduces dim 0 (p is 2), ``x.std(1, True)`` keeps no dim."""
    cases = ((lambda x: x.norm(2, 0), S(1), S(0)), (lambda x: x.norm(2, 0, True), S(1), S(1)),
             (lambda x: x.std(1, True), S(2), S(1)), (lambda x: x.var(1, True, True), S(2), S(2)),
             (lambda x: x.std(0), S(2), S(1)))
    for fn, given, out in cases:
        x, found = _found(fn, given)
        assert [(s.inputs, s.output) for s in found] == [({x: given}, out), ({x: R}, R)], (given, out, found)
    x, found = _found(lambda x: x.std(True), S(2))  # std(x, unbiased): every dim, the shard among them
    assert [s.output for s in found] == [R]
