"""Per-op sharding rules. One file per family of ops; ``base`` holds the registry.

To find the rule of an op, look in the file named after its family:
elementwise (pointwise math, casts), reductions (mean, softmax, ...), norms (layer_norm, rms_norm),
multi_output (chunk, split, topk, ...), views (reshape, transpose, expand, cat; ``dim_maps`` holds
their shape arithmetic), indexing (getitem), linear (linear, addmm, matmul),
embedding, attention (scaled_dot_product_attention), dropout (F.dropout and sdpa's dropout_p in
training: slices of one logical mask), cache (writes into a KV cache), loss (cross_entropy),
custom_autograd (torch.autograd.Function bodies that are pointwise),
experts (MoE expert weights: gather by ids, grouped_mm). ``partial`` adds, in front of the
rules above, the ways to carry a partial sum through ops linear in it: import it last.
"""
from . import (attention, cache, custom_autograd, elementwise, embedding, experts, indexing,  # noqa: F401
               linear, loss, multi_output, norms, reductions, views)  # (each registers its rules)
from . import dropout  # noqa: F401,E402  (after elementwise and attention, whose rules it builds on)
from . import partial  # noqa: F401,E402  (wraps the rules registered above)
from .base import RuleContext, Strategy, register, rule_for, tensor_inputs

__all__ = ["RuleContext", "Strategy", "register", "rule_for", "tensor_inputs"]
