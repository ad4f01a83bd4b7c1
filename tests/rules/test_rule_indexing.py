"""plan/rules/indexing.py, reads (writes: test_rule_writes.py): basic indexing keeps a shard of a dim it
leaves whole, moved to where that dim lands; every k-th element of a shard whose blocks hold whole
strides (GPT-OSS's interleaved gate/up); one index of the sharded dim (its owner's value, a partial
sum: ``owned_item``); one segment of a fused projection (``segment_slice``, a whole segment coming out
replicated); and ``aten.slice`` on another dim. Anything else reads the value whole."""
import operator

import torch
from rule_graphs import capture, inputs_of, node, strategies

from fxparallel.plan.layout import ShardLayout
from fxparallel.plan.placement import R, S
from fxparallel.plan.rules.base import LocalOp


def _found(fn, placement, shape=(4, 6, 16), **kw):
    gm = capture(fn, shape)
    (x,) = inputs_of(gm)
    return x, strategies(node(gm, operator.getitem), {x: placement}, **kw)


def test_basic_indexing_moves_the_shard_with_its_dim():
    for fn, out in ((lambda x: x[:, 0], S(1)), (lambda x: x[..., None, :], S(3)), (lambda x: x[:, 1:3], S(2)),
                    (lambda x: x[1], S(1))):
        x, found = _found(fn, S(2))
        assert [(s.inputs, s.output) for s in found] == [({x: S(2)}, out), ({x: R}, R)]
    x, found = _found(lambda x: x[:, 2:4], S(1))  # a slice of the sharded dim itself (one index of it: below)
    assert [s.output for s in found] == [R]


def test_every_kth_element_of_a_shard():
    for fn in (lambda x: x[..., ::2], lambda x: x[..., 1::2], lambda x: x[..., 2::4]):
        x, found = _found(fn, S(2))
        assert found[0].output == S(2) and found[0].note == "every k-th element of a shard"
    x, found = _found(lambda x: x[..., ::3], S(2))  # 16 is not made of whole strides of 3
    assert [s.output for s in found] == [R]
    # 12 as 8/4 at tp=2 would give 6 as 4/2, not the layout's 3/3: no rank holds its part of the result
    x, found = _found(lambda x: x[..., ::2], S(2), shape=(4, 6, 12), layout=ShardLayout(2, {12: (8, 4), 6: (3, 3)}))
    assert [s.output for s in found] == [R]


def test_one_segment_of_a_fused_projection():
    fused = S(2, (8, 4, 4))
    x, found = _found(lambda x: x[..., 8:12], fused)
    assert found[0].output == S(2)
    assert found[0].local == LocalOp.of("segment_slice", placement=fused, index=(Ellipsis, slice(8, 12)), position=1,
                                        segment=1)
    mqa = S(2, (8, 4, 4), whole=(1, 2))
    x, found = _found(lambda x: x[..., 12:], mqa)
    assert found[0].output == R and found[0].local.kwargs()["segment"] == 2
    x, found = _found(lambda x: x[..., 4:12], fused)  # across two segments
    assert [s.output for s in found] == [R]


def test_aten_slice_keeps_a_shard_of_another_dim():
    gm = capture(lambda x: torch.ops.aten.slice(x, 1, 0, 3), (4, 6, 16))
    (x,) = inputs_of(gm)
    sliced = next(n for n in gm.graph.nodes if n.op == "call_function")
    assert [(s.inputs, s.output) for s in strategies(sliced, {x: S(2)})] == [({x: S(2)}, S(2)), ({x: R}, R)]
    assert [s.output for s in strategies(sliced, {x: S(1)})] == [R]


def test_one_index_of_the_sharded_dim_is_its_owners_partial_value():
    from fxparallel.plan.placement import P

    for fn, placement, local in ((lambda x: x[:, 3], S(1), LocalOp.of("owned_item", dim=1, position=1, item=3)),
                                 (lambda x: x[-1], S(0), LocalOp.of("owned_item", dim=0, position=0, item=3)),
                                 (lambda x: x[..., 5], S(2), LocalOp.of("owned_item", dim=2, position=1, item=5))):
        x, found = _found(fn, placement)
        assert [(s.inputs, s.output, s.local) for s in found] == [({x: placement}, P, local), ({x: R}, R, None)]
    x, found = _found(lambda x: x[:, 3], S(1), shape=(4, 7, 16))  # 7 rows cannot be split at tp=2
    assert [s.output for s in found] == [R]
