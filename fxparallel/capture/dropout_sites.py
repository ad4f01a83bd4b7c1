"""Which models have dropout, and what a training-mode capture may contain.

A model with a dropout rate above 0 anywhere is captured in training mode
(``api.plan_graph``), so that its graph holds every dropout site with its rate
(``F.dropout(x, p, training=True)``, ``scaled_dot_product_attention(..., dropout_p=p)``);
the rewrite makes each site depend on the parallel module's ``training`` flag at call
time (``ops/dropout_kernels.py``), so one graph serves ``train()`` and ``eval()``. A model
without dropout is captured in eval mode exactly as before: its graph does not change.

Random numbers other than those dropout spellings (``torch.rand_like``, ``bernoulli_``,
``dropout2d``, LayerDrop, ...) would draw different numbers per layout; a training-mode
graph that holds one is refused, naming the op and the module.
"""
from __future__ import annotations

import torch
import torch.fx as fx
import torch.nn.functional as F
from torch import nn

from ..errors import CaptureError
from .graph import module_path

_RATE_WORDS = ("dropout", "pdrop")  # attribute names holding a rate: attention_dropout, resid_pdrop, hidden_dropout
_IGNORED = ("classifier_dropout", "summary_first_dropout", "summary_last_dropout")  # heads a causal LM does not run

_UNSUPPORTED_FUNCTIONS = {
    F.dropout1d, F.dropout2d, F.dropout3d, F.alpha_dropout, F.feature_alpha_dropout, torch.dropout,
    torch.feature_dropout, torch.alpha_dropout, torch.bernoulli, torch.rand, torch.rand_like, torch.randn,
    torch.randn_like, torch.randint, torch.randint_like, torch.randperm, torch.multinomial, torch.normal,
    torch.poisson, torch.native_dropout,
}
_UNSUPPORTED_METHODS = {"bernoulli", "bernoulli_", "uniform_", "normal_", "exponential_", "random_", "geometric_",
                        "cauchy_", "log_normal_"}


def _rate(value):
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value)


def dropout_rates(model: nn.Module) -> dict:
    """``{where: rate}`` of every dropout rate above 0 the modules of ``model`` hold (``nn.Dropout``
    modules, float attributes such as ``attention_dropout``) and its config states. Raises for
    LayerDrop above 0 (skipping layers at random is a data-dependent graph)."""
    found = {}
    for path, module in model.named_modules():
        if isinstance(module, nn.modules.dropout._DropoutNd) and module.p > 0:
            found[path or "<root>"] = float(module.p)
        for name, value in vars(module).items():
            rate = _rate(value)
            if rate is None or rate <= 0:
                continue
            where = f"{path}.{name}" if path else name
            if name == "layerdrop":
                raise CaptureError(f"{where} = {rate}: LayerDrop (skipping decoder layers at random in training) is "
                                   "not supported; set config.layerdrop = 0")
            if any(w in name for w in _RATE_WORDS) and name not in _IGNORED:
                found[where] = rate
    config = getattr(model, "config", None)
    for name, value in (vars(config).items() if config is not None else ()):
        rate = _rate(value)
        if rate is not None and rate > 0 and any(w in name for w in _RATE_WORDS) and name not in _IGNORED:
            found[f"config.{name}"] = rate
    return found


def _describe(node: fx.Node) -> str:
    name = node.target if isinstance(node.target, str) else getattr(node.target, "__name__", str(node.target))
    return f"{name} ({node.name} in {module_path(node)})"


def check_training_graph(gm: fx.GraphModule, kind: str) -> None:
    """Refuse random ops of a training-mode graph that are not F.dropout or sdpa's dropout_p."""
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target in _UNSUPPORTED_FUNCTIONS or \
                node.op == "call_method" and node.target in _UNSUPPORTED_METHODS:
            raise CaptureError(f"{kind}: {_describe(node)} draws random numbers in training mode; fxparallel applies "
                               "dropout spelled F.dropout / nn.Dropout / scaled_dot_product_attention(dropout_p=...) "
                               "only (other draws would differ between layouts)")
        if node.op == "call_function" and node.target is F.dropout:
            inplace = node.args[3] if len(node.args) > 3 else node.kwargs.get("inplace", False)
            source = node.args[0] if node.args else node.kwargs.get("input")
            if inplace and isinstance(source, fx.Node) and len(source.users) > 1:
                raise CaptureError(f"{kind}: in-place dropout {_describe(node)} of a value that is read elsewhere "
                                   "is not supported")


def is_identity_dropout(node: fx.Node) -> bool:
    """``F.dropout`` that returns its input: eval mode or a rate of 0 (as captured)."""
    p = node.args[1] if len(node.args) > 1 else node.kwargs.get("p", 0.5)
    training = node.args[2] if len(node.args) > 2 else node.kwargs.get("training", True)
    return training is False or p == 0

