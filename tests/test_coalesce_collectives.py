"""The pass that joins a LoRA adapter's collectives with its base layer's (``rewrite/coalesce_collectives.py``),
on small hand-built graphs: a column-parallel layer's input copy and its adapters' ``A x`` copies become one
``copy_to_tp_many`` placed before the first consumer, with each adapter's dropout moved along in draw order; a
random draw between the two places keeps that adapter's collective (its mask would change); collectives of
base layers alone are left as they are; under sequence parallelism the gathers join the same way. End-to-end
numerics (loss, every gradient, dropout masks, generate against PEFT) are in ``test_lora.py``; the many-tensor
collectives' values and gradients in ``test_collective_tracing.py``."""
from __future__ import annotations

import operator

import torch
import torch.fx as fx

from fxparallel.ops import collectives
from fxparallel.ops.dropout_kernels import logical_dropout
from fxparallel.rewrite.coalesce_collectives import coalesce_adapter_collectives

LINEAR = torch._C._nn.linear
PARAMS = {"w_q": "layers.0.q_proj.weight", "a_q": "layers.0.q_proj.lora_A.default.weight",
          "w_k": "layers.0.k_proj.weight", "a_k": "layers.0.k_proj.lora_A.default.weight"}


def _graph(noise_between: bool = False, dropout: bool = True, sequence: bool = False, tokens: int = 5) -> fx.Graph:
    """x -> q and k base layers on copy_to_tp(x), each adapter's A x (after its own dropout) computed after
    its base layer, as PEFT does; optionally a random draw between the q base layer and the adapters.
    ``sequence``: as sequence parallelism leaves it, x this rank's tokens, gathered (``gather_seq_to_tp``) for
    the base layers and, after A, for the adapters, A's gradient all-reduced; ``tokens``: the adapters' A x
    tokens."""
    g = fx.Graph()
    x = g.placeholder("x")
    x.meta["example_value"] = torch.empty(2, 5, 8)
    weights = {name: g.placeholder(name) for name in PARAMS}
    if sequence:
        weights.update({name: g.call_function(collectives.copy_to_tp, (w, 0)) for name, w in weights.items()
                        if name.startswith("a_")})

    def collective(value):
        return g.call_function(collectives.gather_seq_to_tp, (value, 1, 0, None)) if sequence else \
            g.call_function(collectives.copy_to_tp, (value, 0))

    copy = collective(x)
    copy.meta["example_value"] = x.meta["example_value"]
    outputs = []
    for proj in ("q", "k"):
        base = g.call_function(LINEAR, (copy, weights[f"w_{proj}"], None))
        if noise_between and proj == "q":
            outputs.append(g.call_function(logical_dropout, (base, 0.1)))  # another dropout site
        source = g.call_function(logical_dropout, (x, 0.1)) if dropout else x
        ax = g.call_function(LINEAR, (source, weights[f"a_{proj}"], None))
        reduced = collective(ax)
        reduced.meta["example_value"] = torch.empty(2, tokens, 4)
        outputs.append(g.call_function(operator.add, (base, reduced)))
    g.output(tuple(outputs))
    return g


def _calls(g: fx.Graph, target) -> list:
    return [n for n in g.nodes if n.op == "call_function" and n.target is target]


def test_an_adapters_copies_join_the_base_layers_before_its_first_consumer():
    g = _graph()
    assert coalesce_adapter_collectives(g, PARAMS) == 2
    g.lint()
    (joined,) = _calls(g, collectives.copy_to_tp_many)
    assert not _calls(g, collectives.copy_to_tp)
    assert [a.name for a in joined.args[0]][0] == "x" and len(joined.args[0]) == 3
    order = list(g.nodes)
    first_base = _calls(g, LINEAR)[2]  # after the two moved A x products
    assert first_base.args[0].target is operator.getitem and order.index(joined) < order.index(first_base)
    drops = _calls(g, logical_dropout)
    assert len(drops) == 2 and all(order.index(d) < order.index(joined) for d in drops)
    # the q adapter's dropout still draws before the k adapter's
    assert [d.users.copy().popitem()[0].args[1].name for d in drops] == ["a_q", "a_k"]


def test_a_random_draw_in_between_keeps_the_dropped_out_adapters_apart():
    g = _graph(noise_between=True)
    assert coalesce_adapter_collectives(g, PARAMS) == 0
    assert len(_calls(g, collectives.copy_to_tp)) == 3 and not _calls(g, collectives.copy_to_tp_many)
    g = _graph(noise_between=True, dropout=False)  # no dropout to move: the products join
    assert coalesce_adapter_collectives(g, PARAMS) == 2


def test_sequence_parallel_gathers_join_along_the_features():
    g = _graph(sequence=True)
    assert coalesce_adapter_collectives(g, PARAMS) == 2
    g.lint()
    (joined,) = _calls(g, collectives.gather_seq_to_tp_many)
    assert not _calls(g, collectives.gather_seq_to_tp) and joined.args[1:] == (1, 0, None)
    assert [a.name for a in joined.args[0]][0] == "x" and len(joined.args[0]) == 3
    # values whose sizes up to the token dim differ are not joined
    g = _graph(sequence=True, tokens=6)
    assert coalesce_adapter_collectives(g, PARAMS) == 0 and len(_calls(g, collectives.gather_seq_to_tp)) == 3


def test_gradient_reductions_of_a_layers_parameters_join_within_the_layer():
    """copy_to_tp of parameters (their gradients all-reduced once per step): a layer's join where one is an
    adapter's; never across layers or dtypes, nor in a layer without an adapter matrix among them."""
    names = {"n0": "model.layers.0.input_layernorm.weight", "a0": "model.layers.0.q_proj.lora_A.default.weight",
             "b0": "model.layers.0.o_proj.lora_B.default.weight", "n1": "model.layers.1.input_layernorm.weight",
             "m1": "model.layers.1.post_attention_layernorm.weight",
             "a2": "model.layers.2.q_proj.lora_A.default.weight", "n3": "model.layers.3.input_layernorm.weight",
             "a3": "model.layers.3.q_proj.lora_A.default.weight", "b3": "model.layers.3.o_proj.lora_B.default.weight"}
    g = fx.Graph()
    outputs, placeholders = [], [g.placeholder(name) for name in names]
    for p in placeholders:  # layer 3: a bfloat16 base, float32 adapters (one dtype per call)
        p.meta["example_value"] = torch.empty(4, dtype=torch.bfloat16 if p.name == "n3" else torch.float32)
        copy = g.call_function(collectives.copy_to_tp, (p, 0))
        copy.meta["example_value"] = p.meta["example_value"]
        outputs.append(g.call_function(operator.mul, (copy, 2.0)))
    g.output(tuple(outputs))
    assert coalesce_adapter_collectives(g, names) == 3
    g.lint()
    assert [[a.name for a in j.args[0]] for j in _calls(g, collectives.copy_to_tp_many)] == [["n0", "a0", "b0"],
                                                                                            ["a3", "b3"]]
    assert sorted(c.args[0].name for c in _calls(g, collectives.copy_to_tp)) == ["a2", "m1", "n1", "n3"]


def test_base_layers_alone_are_left_as_they_are():
    g = _graph()
    assert coalesce_adapter_collectives(g, {k: v.replace(".lora_A.default", "") for k, v in PARAMS.items()}) == 0
    assert len(_calls(g, collectives.copy_to_tp)) == 3
