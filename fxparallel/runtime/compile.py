"""Compile each decoder layer with ``torch.compile``, as torchtitan compiles each block.

The layers are the modules the graphs call (``ops/layer_units.py``); what is compiled is the
code a layer runs (its piece of the executing graph, inside activation checkpointing when that is
on), so FSDP's hooks stay eager around it and parameter names are unchanged. The decoder layers of
a model are identical code, so Dynamo compiles one and reuses it (one recompile per graph: prefill,
decode and training pieces differ). Call it after ``gradient_checkpointing_enable`` if used, before
or after ``apply_data_parallel``.
"""
from __future__ import annotations


def compile_layers(model, **options) -> None:
    """``torch.compile(**options)`` on what every decoder layer of ``model`` runs (without layers:
    compile the whole model instead, ``torch.compile(model)``)."""
    for unit in model.layer_units(required_by="compile_layers"):
        unit.compile_pieces(**options)
