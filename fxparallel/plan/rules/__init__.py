"""Per-op sharding rules. One file per family of ops; ``base`` holds the registry.

To find the rule of an op, look in the file named after its family:
elementwise (pointwise math, casts), reductions (mean, softmax, ...), norms (layer_norm, rms_norm),
multi_output (chunk, split, topk, ...), views
(reshape, transpose, expand, indexing, cat), linear (linear, addmm, matmul),
embedding, attention (scaled_dot_product_attention), loss (cross_entropy),
custom_autograd (torch.autograd.Function bodies that are pointwise).
"""
from . import attention, custom_autograd, elementwise, embedding, linear, loss, multi_output, norms, reductions, views  # noqa: F401  (registers)
from .base import RuleContext, Strategy, register, rule_for, tensor_inputs

__all__ = ["RuleContext", "Strategy", "register", "rule_for", "tensor_inputs"]
