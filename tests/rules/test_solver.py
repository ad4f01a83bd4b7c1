"""plan/solver.py on a small graph, without processes: a two-matrix MLP gets Megatron's plan
(first matrix by columns, second by rows: one all-reduce of the output, nothing else)."""
import torch
import torch.nn.functional as F
from rule_graphs import capture, captured_graph

from fxparallel.plan.layout import ShardLayout
from fxparallel.plan.placement import R, S
from fxparallel.plan.solver import solve


def _mlp(x, up, down):
    return F.linear(F.silu(F.linear(x, up)), down)


def test_mlp_is_column_then_row():
    gm = capture(_mlp, (3, 5, 16), (64, 16), (16, 64), params=(1, 2))
    plan = solve(captured_graph(gm, params={1: "up.weight", 2: "down.weight"}, inputs={0: "x"}), 2,
                 layout=ShardLayout(2))
    assert plan.params == {"up.weight": S(0), "down.weight": S(1)}
    assert plan.replicated_bytes == 0
    assert not plan.fallbacks


def test_fixed_placements_are_kept():
    gm = capture(_mlp, (3, 5, 16), (64, 16), (16, 64), params=(1, 2))
    fixed = {"up.weight": S(1), "down.weight": S(0)}
    plan = solve(captured_graph(gm, params={1: "up.weight", 2: "down.weight"}, inputs={0: "x"}), 2,
                 fixed=fixed, layout=ShardLayout(2))
    assert plan.params == fixed


def test_search_past_its_budget_finishes_greedily(monkeypatch):
    """A graph whose branch points would take hours (DeepSeek-V4) stops branching after MAX_PASSES passes
    over the graph and completes the branch it is on: the same plan on every rank, in bounded time."""
    import fxparallel.plan.solver as solver

    def two_mlps(x, up, down, up2, down2):
        return _mlp(_mlp(x, up, down) + x, up2, down2)

    gm = capture(two_mlps, (3, 5, 16), (64, 16), (16, 64), (64, 16), (16, 64), params=(1, 2, 3, 4))
    captured = captured_graph(gm, params={1: "up.weight", 2: "down.weight", 3: "up2.weight", 4: "down2.weight"},
                              inputs={0: "x"})
    full = solver.Solver(captured, 2, layout=ShardLayout(2))
    full.solve()
    monkeypatch.setattr(solver, "MAX_PASSES", 0)
    greedy = solver.Solver(captured, 2, layout=ShardLayout(2))
    plan = greedy.solve()
    assert full.steps > len(full.nodes) and greedy.steps == len(greedy.nodes)  # one pass, no branch explored
    assert plan.explored == 1 and plan.params == {"up.weight": S(0), "down.weight": S(1), "up2.weight": S(0),
                                                  "down2.weight": S(1)}  # the preferred branches


def _scaled(x, up, d, down):
    return F.linear(F.linear(x, up) * d, down)


def test_a_whole_weight_read_by_shards_is_sliced_locally():
    """A weight fixed replicated (an earlier graph's placement: Mamba's ``D``, read by a decode step with the
    channels each rank computes) is sliced where a shard reads it: the product stays sharded, nothing is
    gathered. Its gradient reduction counts only in a graph that trains (``trains=False``: a generation graph)."""
    import operator

    from fxparallel.plan.placement import R

    gm = capture(_scaled, (3, 5, 16), (64, 16), (64,), (16, 64), params=(1, 2, 3))
    names = {1: "up.weight", 2: "d", 3: "down.weight"}
    plans = {trains: solve(captured_graph(gm, params=names, inputs={0: "x"}), 2, fixed={"d": R},
                           layout=ShardLayout(2), trains=trains) for trains in (True, False)}
    product = next(n for n in gm.graph.nodes if n.target is operator.mul)
    for plan in plans.values():
        assert plan.params == {"up.weight": S(0), "d": R, "down.weight": S(1)}
        assert plan.placements[product] == S(2) and not plan.fallbacks
    assert plans[False].comm_bytes < plans[True].comm_bytes  # d's gradient reduction, charged when training


def _two_cache_layers(pos, new, c0, w0, c1, w1):
    c0.index_copy_(2, pos, new)
    c1.index_copy_(2, pos, new)
    return F.linear(c0, w0) + F.linear(c1, w1)


def test_a_tensor_written_whole_stays_whole_for_a_later_reader_of_a_shard():
    """DeepSeek-V2's latent KV cache at TP=4: each layer writes its cache whole (the new latent is replicated),
    then a row-parallel kv_b_proj reads it by shards. Layer 0's write decides the layers' pattern (whole); layer 1's
    write, all of its inputs whole, is planned by the fast path. Its cache must stay whole for the later reader
    (sliced locally): it was planned split, so the graph wrote a whole latent into a quarter of a cache."""
    from fxparallel.plan.placement import R

    gm = capture(_two_cache_layers, ("ids", (3,)), (2, 1, 3, 16), (2, 1, 8, 16), (32, 16), (2, 1, 8, 16), (32, 16))
    names = {2: "layers.0.cache", 3: "layers.0.w", 4: "layers.1.cache", 5: "layers.1.w"}
    captured = captured_graph(gm, params=names, inputs={0: "pos", 1: "new"})
    plan = solve(captured, 4, fixed={"layers.0.w": S(1), "layers.1.w": S(1)}, layout=ShardLayout(4))
    assert plan.params["layers.0.cache"] == plan.params["layers.1.cache"] == R


def _per_layer_inputs(x, scale, g0, p0, g1, p1):
    per_layer = (x.sum(-1, keepdim=True) * scale).view(3, 5, 2, 64)  # replicated, requires grad
    h = x + F.linear(F.gelu(F.linear(x, g0)) * per_layer[:, :, 0, :], p0)
    return h + F.linear(F.gelu(F.linear(h, g1)) * per_layer[:, :, 1, :], p1)


def test_layers_reading_slices_of_one_replicated_tensor_share_its_gradient_reduction():
    """Gemma 4's per-layer inputs: each layer multiplies its column-parallel gate by its slice of one replicated
    tensor, then a row-parallel projection. Each slice is used by shards (sliced locally), and the gradients of
    all the slices are reduced once, on the whole tensor. Charging that whole reduction to the first layer made
    gathering the gate (an all-gather per layer, and a backward all-reduce per layer) look cheaper at TP=4."""
    import operator

    gm = capture(_per_layer_inputs, (3, 5, 16), (128,), (64, 16), (16, 64), (64, 16), (16, 64), params=(1, 2, 3, 4, 5))
    names = {1: "scale", 2: "layers.0.gate.weight", 3: "layers.0.proj.weight", 4: "layers.1.gate.weight",
             5: "layers.1.proj.weight"}
    for tp in (2, 4):
        plan = solve(captured_graph(gm, params=names, inputs={0: "x"}), tp, layout=ShardLayout(tp))
        products = [n for n in gm.graph.nodes if n.target is operator.mul and n.args[0].target is F.gelu]
        assert [plan.placements[n] for n in products] == [S(2), S(2)], tp
        assert plan.params["layers.0.gate.weight"] == S(0) and plan.params["layers.1.proj.weight"] == S(1)



def _one_group_mixer(x, w_in, w_out):
    """Mamba-2's mixer in miniature, one group: in_proj gives z, x (4 heads of 4), B and C (one group's state of
    4, read by every head); C B^T per head, times x, gated by z; out_proj."""
    z, h, b, c = F.linear(x, w_in).split([16, 16, 4, 4], dim=-1)
    b = b.view(3, 5, 1, 4).repeat_interleave(4, dim=2, output_size=4)
    c = c.view(3, 5, 1, 4).repeat_interleave(4, dim=2, output_size=4)
    scores = torch.einsum("blhn,bshn->blsh", c, b)
    y = torch.einsum("blsh,bshp->blhp", scores, h.view(3, 5, 4, 4)).reshape(3, 5, 16) * F.silu(z)
    return F.linear(y, w_out)


def test_parts_every_head_reads_are_whole_and_their_products_keep_partial_gradients():
    """B and C of one group are held whole (``ShardLayout.shared_widths``); C B^T is computed whole from them on
    every rank and sliced by the product with each rank's heads, which uses it for those heads only: made from
    whole segments alone, its gradient stays partial back to them (``grad_reduction.whole_segment_region``): no
    reduction of C B^T is charged."""
    gm = capture(_one_group_mixer, (3, 5, 16), (40, 16), (16, 16), params=(1, 2))
    names = {1: "in_proj.weight", 2: "out_proj.weight"}
    plan = solve(captured_graph(gm, params=names, inputs={0: "x"}), 2, layout=ShardLayout(2, shared_widths=(4,)))
    assert plan.params == {"in_proj.weight": S(0, (16, 16, 4, 4), whole=(2, 3)), "out_proj.weight": S(1)}
    assert not plan.fallbacks
    scores = [n for n in gm.graph.nodes if n.target is torch.einsum]
    assert [plan.placements[n] for n in scores] == [R, S(2)]
    # nothing charged: out_proj's partial sum is the graph's output and x takes no gradient here; charging C B^T's
    # gradient (whole on every rank, used on shards) would cost its bytes per token
    assert plan.comm_bytes == 0.0


def _shape_spelled_by_a_query(x, up, down):
    h = F.linear(x, up).view(x.shape[0], x.shape[1], 4, 16)  # by heads
    shape = h.shape  # a shape query of a head-sharded value (Qwen3-Next's ``z_shape_og = z.shape``)
    h = F.silu(h).reshape(-1, 16).reshape(shape)
    return F.linear(h.reshape(x.shape[0], x.shape[1], -1), down)


def test_the_shape_of_a_shard_is_answered_full_and_keeps_the_plan():
    """``x.size()`` of a shard whose sharded dims are static is planned as a shape query answering the full sizes
    (``ops/shapes.py``), which the view it spells then makes local: Megatron's plan, no gather."""
    import inspect

    from fxparallel.ops.shapes import full_size
    from fxparallel.plan.rules.base import LocalOp

    torch._dynamo.reset()
    seen = []
    examples = (torch.empty(3, 5, 16, device="meta"), torch.empty(64, 16, device="meta", requires_grad=True),
                torch.empty(16, 64, device="meta", requires_grad=True))
    torch._dynamo.mark_dynamic(examples[0], 0)  # batch and sequence symbolic, as in a model's capture
    torch._dynamo.mark_dynamic(examples[0], 1)
    torch.compile(_shape_spelled_by_a_query, backend=lambda gm, ex: seen.append(gm) or gm.forward,
                  fullgraph=True)(*examples)
    gm = seen[0]
    gm.meta["argument_names"] = list(inspect.signature(_shape_spelled_by_a_query).parameters)
    plan = solve(captured_graph(gm, params={1: "up.weight", 2: "down.weight"}, inputs={0: "x"}), 2,
                 layout=ShardLayout(2))
    assert plan.params == {"up.weight": S(0), "down.weight": S(1)} and not plan.fallbacks
    queries = [n for n in gm.graph.nodes if n.target == "size" and plan.placements.get(n.args[0]) == S(2)]
    assert len(queries) == 1 and all(plan.strategies[n].local == LocalOp.of("full_shape") for n in queries)
    # what the rewritten query answers on a rank's shard: the full sizes
    shard = torch.empty(3, 5, 2, 16)
    assert full_size(shard, (None, None, 4, 16)) == torch.Size([3, 5, 4, 16])
