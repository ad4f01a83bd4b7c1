"""plan/rules/multi_output.py: chunk, split, unbind, topk and sort along a dim that is not sharded leave
every output sharded like the input (unbind drops its dim); along the sharded dim only a fused
projection's segments are split (``local_split_sizes``, a whole segment coming out replicated)."""
from rule_graphs import capture, inputs_of, strategies

from fxparallel.plan.placement import R, S
from fxparallel.plan.rules.base import LocalOp


def _found(fn, placement, shape=(4, 6, 16)):
    gm = capture(fn, shape)
    (x,) = inputs_of(gm)
    op = next(n for n in gm.graph.nodes if n.op in ("call_method", "call_function"))
    return x, strategies(op, {x: placement})


def test_along_another_dim_every_output_keeps_the_shard():
    for fn, placement, outs in ((lambda x: x.chunk(2, -1), S(1), (S(1),) * 2),
                                (lambda x: x.split([4, 2], 1), S(2), (S(2),) * 2),
                                (lambda x: x.tensor_split(3, 1), S(2), (S(2),) * 3),
                                (lambda x: x.unbind(1), S(2), (S(1),) * 6),  # the unbound dim is gone
                                (lambda x: x.unbind(1), S(0), (S(0),) * 6),
                                (lambda x: x.topk(2), S(1), (S(1),) * 2),
                                (lambda x: x.sort(dim=1), S(2), (S(2),) * 2)):
        x, found = _found(fn, placement)
        assert [(s.inputs, s.output) for s in found] == [({x: placement}, outs), ({x: R}, (R,) * len(outs))]


def test_along_the_shard_only_segments_split():
    for fn, placement in ((lambda x: x.chunk(2, -1), S(2)), (lambda x: x.topk(2), S(2)),
                          (lambda x: x.sort(dim=1), S(1)), (lambda x: x.split([8, 8], -1), S(2, (4, 12)))):
        x, found = _found(fn, placement)
        assert [s.output for s in found] == [(R, R)]
    fused = S(2, (8, 4, 4))
    x, found = _found(lambda x: x.split([8, 4, 4], -1), fused)
    assert found[0].output == (S(2), S(2), S(2)) and found[0].local == LocalOp.of("local_split_sizes", placement=fused)
    x, found = _found(lambda x: x.chunk(2, -1), S(2, (8, 8)))
    assert found[0].output == (S(2), S(2))


def test_a_whole_segment_comes_out_replicated_by_split_not_chunk():
    mqa = S(2, (8, 4, 4), whole=(1, 2))
    x, found = _found(lambda x: x.split([8, 4, 4], -1), mqa)
    assert found[0].output == (S(2), R, R) and found[0].local == LocalOp.of("local_split_sizes", placement=mqa)
    x, found = _found(lambda x: x.chunk(2, -1), S(2, (8, 8), whole=(1,)))
    assert [s.output for s in found] == [(R, R)]


def test_a_split_into_runs_of_segments():
    """Mamba-2: ``in_proj``'s five segments z | x, B, C | dt come out of a split into three parts, the middle
    one still segmented (split again after the convolution); a part that cuts a segment is gathered."""
    fused = S(2, (8, 8, 4, 4, 2))
    x, found = _found(lambda x: x.split([8, 16, 2], -1), fused, shape=(4, 6, 26))
    assert found[0].output == (S(2), S(2, (8, 4, 4)), S(2))
    assert found[0].local == LocalOp.of("local_split_sizes", placement=fused, groups=((0,), (1, 2, 3), (4,)))
    x, found = _found(lambda x: x.split([10, 14, 2], -1), fused, shape=(4, 6, 26))
    assert [s.output for s in found] == [(R, R, R)]
    # B and C of one group, whole on every rank: the run keeps them whole; a whole segment alone comes out
    # replicated (its gradient made partial again by ``partial_grad``)
    mqa = S(2, (8, 8, 4, 4, 2), whole=(2, 3))
    x, found = _found(lambda x: x.split([8, 16, 2], -1), mqa, shape=(4, 6, 26))
    assert found[0].output == (S(2), S(2, (8, 4, 4), whole=(1, 2)), S(2))
    x, found = _found(lambda x: x.split([8, 8, 8, 2], -1), S(2, (8, 8, 4, 4, 2), whole=(2,)), shape=(4, 6, 26))
    assert found[0].output == (S(2), S(2), S(2, (4, 4), whole=(0,)), S(2))
