"""Per-op sharding rules. One file per family of ops; ``base`` holds the registry.

To find the rule of an op, look in the file named after its family:
elementwise (pointwise math, casts), reductions (mean, softmax, ...), norms (layer_norm, rms_norm),
multi_output (chunk, split, topk, ...), views (reshape, transpose, expand, cat; ``dim_maps`` holds
their shape arithmetic), indexing (getitem), linear (linear, addmm, matmul), einsum (subscripted products),
embedding, new_tensors (new_empty / new_zeros / new_ones shaped like their input's shard),
attention (scaled_dot_product_attention), dropout (F.dropout and sdpa's dropout_p in
training: slices of one logical mask), cache (writes into a KV cache), loss (cross_entropy),
custom_autograd (torch.autograd.Function bodies that are pointwise),
experts (MoE expert weights: gather by ids, grouped_mm), expert_rows (expert parallelism: whole experts
per rank, and the ops a rank's expert rows pass through; the solver asks it for any op they reach), conv (depthwise convolution by channels),
repeats (repeat_interleave: Mamba-2's groups widened to heads),
vmap (torch.vmap traced inline: the batch dims it hides and restores). ``partial`` registers the ways to carry a
partial sum through ops linear in it; ``base.rule_for`` offers them before the op's own rule.
Rules are registered by canonical op name; the spellings and traits of ops: ``../op_traits.py``.
"""
from . import (attention, cache_writes, conv, custom_autograd, dropout, einsum, elementwise, embedding, experts,  # noqa: F401
               expert_rows, indexing, linear, loss, multi_output, new_tensors, norms, partial, reductions,
               repeats, triangular_solve, views, vmap)  # (each registers its rules)
from .base import RuleContext, Strategy, register, rule_for, tensor_inputs

__all__ = ["RuleContext", "Strategy", "register", "rule_for", "tensor_inputs"]
