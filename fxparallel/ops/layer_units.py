"""Decoder layers as modules the graphs call: each ``LayerUnit`` owns its layer's parameters and runs
its piece of whichever graph is executing (``rewrite/split_by_layer.py`` cuts the pieces). FSDP2
all-gathers a unit's parameters in that module's forward pre-hook and frees them after, so each
layer can be an FSDP unit; activation checkpointing and ``compile_layers`` wrap the same call."""
from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Callable, Optional

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from ..capture.graph import layer_container

_keys = itertools.count()


def new_piece_key() -> str:
    """A key no other graph of this process uses (the root code passes it to each layer module)."""
    return f"graph{next(_keys)}"


@dataclass
class LayerPieces:
    key: str  # the root graph passes this to each layer module: which graph's piece to run
    forward: dict  # layer module path -> generated ``forward(self, *inputs)``, self = that module
    code: dict  # layer module path -> its source
    root: str = ""  # the source of the root graph's own forward

    def full_code(self) -> str:
        """The root's code followed by every piece's (what ``LocalGraph.code`` shows)."""
        return self.root + "".join(f"\n# {path}\n{src}" for path, src in self.code.items())


class LayerUnit(nn.Module):
    """A decoder layer: owns its parameters and runs its piece of whichever graph is executing.

    ``checkpoint``: keyword arguments of ``torch.utils.checkpoint.checkpoint`` when the layer is
    recomputed in the backward pass (``runtime/activation_checkpointing.py``), else None.
    ``compile_pieces`` compiles what ``forward`` runs (checkpointing included), not ``__call__``:
    hooks (FSDP's all-gathers) stay outside the compiled code and parameter names do not change."""

    def __init__(self):
        super().__init__()
        self._pieces: dict = {}
        self.checkpoint: Optional[dict] = None
        self._compiled: Optional[Callable] = None

    def add_piece(self, key: str, forward: Callable) -> None:
        self._pieces[key] = forward

    def compile_pieces(self, **options) -> None:
        self._compiled = torch.compile(self._run, **options)

    def forward(self, key: str, *inputs):
        return (self._compiled or self._run)(key, *inputs)

    def _run(self, key: str, *inputs):
        piece = self._pieces[key]
        if self.checkpoint is not None and self.training and torch.is_grad_enabled():
            return checkpoint(piece, self, *inputs, **self.checkpoint)
        return piece(self, *inputs)


def layer_of(name: str, container: Optional[str]) -> Optional[str]:
    """``model.layers.3`` for ``model.layers.3.mlp.up_proj.weight``; None outside the layers."""
    if container is None or not name.startswith(container + "."):
        return None
    index = name[len(container) + 1:].split(".", 1)[0]
    return f"{container}.{index}" if index.isdigit() else None


def install_layer_units(root: nn.Module, params: list, parent_of: Callable[..., tuple]) -> tuple:
    """Create a LayerUnit at each layer path of the plan's ``params`` (``ParamPlan``) that the
    forward uses (a multimodal model's vision tower has layers of its own, which a text forward
    never runs), before the parameters are registered under them; the modules above them are
    made by ``parent_of(root, path, layers=True)`` (-> the layer's parent, its name there).
    Returns (layer paths, None), or (layer paths, why they cannot be FSDP units: one parameter
    object under names of two units, e.g. a weight shared by several layers)."""
    param_names = [p.names for p in params if p.used]
    container = layer_container(names[0] for names in param_names)
    if container is None:
        return [], None
    paths = sorted({layer_of(names[0], container) for names in param_names} - {None},
                   key=lambda p: int(p.rsplit(".", 1)[1]))
    for path in paths:
        module, leaf = parent_of(root, path, layers=True)
        module.add_module(leaf, LayerUnit())
    for names in param_names:
        owners = {layer_of(n, container) for n in names}
        if len(owners) > 1:
            return paths, f"parameter {names[0]} is shared by {sorted(map(str, owners))}"
    return paths, None
