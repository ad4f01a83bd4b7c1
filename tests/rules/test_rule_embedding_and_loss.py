"""plan/rules/embedding.py and loss.py: vocab-parallel lookup (a partial sum) and cross-entropy
over vocab-sharded logits, each naming the local op the rewrite applies."""
import torch.nn.functional as F
from rule_graphs import by_name, capture, inputs_of, node, strategies

from fxparallel.plan.placement import P, R, S
from fxparallel.plan.rules.base import LocalOp


def test_vocab_parallel_embedding_gives_a_partial_sum():
    gm = capture(lambda ids, w: F.embedding(ids, w), ("ids", (3, 5)), (64, 16), params=(1,))
    ids, w = inputs_of(gm)
    found = by_name(strategies(node(gm, F.embedding), {}))
    vocab = found["vocab"]
    assert vocab.inputs == {ids: R, w: S(0)} and vocab.output == P
    assert vocab.local == LocalOp.of("vocab_parallel_embedding")
    assert found["hidden"].output == S(2)


def test_cross_entropy_over_vocab_shards():
    gm = capture(lambda logits, t: F.cross_entropy(logits, t), (15, 64), ("ids", (15,)))
    logits, t = inputs_of(gm)
    vocab = by_name(strategies(node(gm, F.cross_entropy), {logits: S(1)}))["vocab"]
    assert vocab.inputs == {logits: S(1), t: R} and vocab.output == R
    assert vocab.local == LocalOp.of("vocab_parallel_cross_entropy")
    assert vocab.own_bytes == 8.0 * 2  # two floats per token per rank


def test_label_smoothing_is_not_vocab_parallel():
    gm = capture(lambda logits, t: F.cross_entropy(logits, t, label_smoothing=0.1), (15, 64), ("ids", (15,)))
    assert "vocab" not in by_name(strategies(node(gm, F.cross_entropy), {}))
