"""plan/rules/einsum.py: a subscript sharded in the operands that carry it is kept in the output (sharded
there) or summed out (a partial sum); operands without it are read whole."""
import torch
from rule_graphs import capture, inputs_of, node, strategies

from fxparallel.plan.placement import P, R, S
from fxparallel.plan.rules.einsum import _einsum


def _one(gm):
    return node(gm, torch.einsum)


def test_a_kept_subscript_stays_sharded_and_a_missing_operand_is_read_whole():
    # Mamba-2's ``bclsh,bcshp->bclhp``: heads (h) sharded in both operands, kept in the output
    gm = capture(lambda m, x: torch.einsum("bclsh,bcshp->bclhp", m, x), (2, 1, 4, 4, 6), (2, 1, 4, 6, 8))
    m, x = inputs_of(gm)
    found = strategies(_one(gm), {m: S(4), x: S(3)})
    assert (found[0].inputs, found[0].output) == ({m: S(4), x: S(3)}, S(3))
    assert found[-1].inputs == {m: R, x: R} and found[-1].output == R
    # a decay without the heads' subscript... none here: an operand lacking the subscript is whole
    gm = capture(lambda a, b: torch.einsum("bh,bn->bhn", a, b), (2, 6), (2, 4))
    a, b = inputs_of(gm)
    found = strategies(_one(gm), {a: S(1)})
    assert (found[0].inputs, found[0].output) == ({a: S(1), b: R}, S(1))


def test_a_summed_subscript_gives_a_partial_sum():
    gm = capture(lambda a, b: torch.einsum("bk,kn->bn", a, b), (2, 6), (6, 4))
    a, b = inputs_of(gm)
    found = strategies(_one(gm), {a: S(1)})
    assert (found[0].inputs, found[0].output) == ({a: S(1), b: S(0)}, P) and found[0].own_bytes > 0


def test_unsplittable_or_unsupported_equations_run_replicated():
    gm = capture(lambda a, b: torch.einsum("bk,kn->bn", a, b), (2, 5), (5, 4))  # 5 does not split over 2
    a, b = inputs_of(gm)
    assert [s.output for s in strategies(_one(gm), {a: S(1)})] == [R]
    gm = capture(lambda a, b: torch.einsum("...k,kn->...n", a, b), (2, 6), (6, 4))
    a, b = inputs_of(gm)
    assert _einsum(_one(gm), {a: S(1), b: R}, None) == []  # ellipsis: no rule, the solver gathers
