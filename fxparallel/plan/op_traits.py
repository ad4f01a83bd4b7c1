"""One table of what fxparallel knows about torch ops, so that every stage agrees on them.

A graph spells one op several ways: ``operator.add``, ``torch.add``, the ``add`` method and
``operator.iadd`` are one op. ``op_name`` maps a node to its canonical name, once; everything
else (the rule registry, sequence parallelism, gradient reduction, fused-projection detection,
the context-parallel checks) asks about canonical names. An in-place method (``add_``) is an
op of its own: it is not linear in a partial sum. A custom op is named by its qualified name
(``"namespace::op"``). A spelling not listed has no name (``None``): no rule, no trait.

The traits are sets of canonical names; each says what one consumer relies on.
"""
from __future__ import annotations

import builtins
import operator
from typing import Optional

import torch
import torch._functorch.predispatch  # noqa: F401 - the vmap ops traced inline (rules/vmap.py)
import torch.fx as fx
import torch.nn.functional as F

_nn = torch._C._nn

# canonical name -> its spellings: call_function targets (callables) and call_method names (strings)
SPELLINGS = {
    # ---- arithmetic (``operator.i*``: the same op, in place on a tensor) -------------------------
    "add": (operator.add, operator.iadd, torch.add, "add"),
    "sub": (operator.sub, operator.isub, torch.sub, "sub"),
    "mul": (operator.mul, operator.imul, torch.mul, "mul"),
    "div": (operator.truediv, operator.itruediv, torch.div, torch.true_divide, "div"),
    "floor_divide": (operator.floordiv,),
    "remainder": (operator.mod,),
    "pow": (operator.pow, torch.pow, "pow"),
    "neg": (operator.neg, torch.neg, "neg"),
    "bitwise_and": (operator.and_, "__and__"),
    "bitwise_or": (operator.or_, "__or__"),
    "bitwise_xor": (operator.xor,),
    "bitwise_not": (operator.invert, "__invert__"),
    **{cmp: (getattr(operator, cmp), cmp) for cmp in ("eq", "ne", "lt", "le", "gt", "ge")},
    **{name: (name,) for name in ("logical_and", "logical_or", "logical_not")},
    # ---- unary math and activations -------------------------------------------------------------
    **{name: (getattr(torch, name), name) for name in (
        "rsqrt", "sqrt", "exp", "log", "cos", "sin", "abs", "erf", "square", "reciprocal", "sign", "clamp", "clip",
        "where", "masked_fill", "lerp", "nan_to_num")},
    **{name: (getattr(torch, name),) for name in (
        "log1p", "expm1", "maximum", "minimum", "addcmul", "zeros_like", "ones_like", "empty_like", "full_like",
        "rand_like", "randn_like")},
    "tanh": (torch.tanh, F.tanh, "tanh"),
    "sigmoid": (torch.sigmoid, F.sigmoid, "sigmoid"),
    "silu": (F.silu, _nn.silu, "silu"),
    "gelu": (F.gelu, _nn.gelu, "gelu"),
    "softplus": (F.softplus, _nn.softplus, "softplus"),
    "relu": (F.relu, torch.relu, "relu"),
    **{name: (getattr(F, name),) for name in ("leaky_relu", "elu", "mish", "hardtanh", "relu6")},
    **{name: (name,) for name in ("clamp_min", "clamp_max")},
    # ---- casts and copies (methods) -------------------------------------------------------------
    **{name: (name,) for name in (
        "to", "type", "type_as", "float", "half", "bfloat16", "double", "long", "int", "bool", "detach", "clone",
        "contiguous")},
    # ---- new tensors of another's dtype and device (methods; rules/new_tensors.py) ----------------
    **{name: (name,) for name in ("new_empty", "new_zeros", "new_ones")},
    # ---- in place (methods) ---------------------------------------------------------------------
    **{name: (name,) for name in (
        "add_", "sub_", "mul_", "div_", "neg_", "masked_fill_", "fill_", "zero_", "requires_grad_", "index_copy_",
        "copy_")},
    # ---- reductions along ``dim`` ---------------------------------------------------------------
    **{name: (getattr(torch, name), name) for name in ("mean", "sum", "amax", "argmax", "logsumexp", "cumsum")},
    **{name: (name,) for name in (
        "amin", "prod", "std", "var", "norm", "any", "all", "argmin", "count_nonzero", "cumprod")},
    "softmax": (F.softmax, torch.softmax, "softmax"),
    "log_softmax": (F.log_softmax, torch.log_softmax, "log_softmax"),
    "min": (torch.min, "min"),
    "max": (torch.max, "max"),
    # ---- normalizations -------------------------------------------------------------------------
    "layer_norm": (F.layer_norm, torch.layer_norm),
    "rms_norm": (F.rms_norm, getattr(torch, "rms_norm", None)),
    # ---- views and shapes -----------------------------------------------------------------------
    **{name: (getattr(torch, name), name) for name in ("reshape", "flatten", "squeeze", "unsqueeze", "transpose",
                                                       "permute", "movedim")},
    **{name: (name,) for name in ("view", "unflatten", "expand", "expand_as", "view_as", "swapaxes", "swapdims", "t")},
    "getattr": (builtins.getattr,),  # ``x.T`` / ``x.mT``
    "view_as_complex": (torch.view_as_complex,),
    "view_as_real": (torch.view_as_real,),
    "cat": (torch.cat, torch.concat, torch.concatenate),
    "stack": (torch.stack,),
    "pad": (F.pad, torch._C._nn.pad),
    **{name: (name,) for name in ("size", "dim", "ndimension", "get_device")},
    # ---- several outputs and indexing -----------------------------------------------------------
    **{name: (getattr(torch, name), name) for name in ("chunk", "split", "tensor_split", "unbind", "topk", "sort",
                                                       "index_select")},
    "repeat_interleave": (torch.repeat_interleave, "repeat_interleave"),
    "getitem": (operator.getitem,),
    "setitem": (operator.setitem,),  # ``x[index] = value``: writes into ``x`` (rules/indexing.py)
    # ---- products, attention, embedding, loss, dropout -------------------------------------------
    "linear": (F.linear,),
    "addmm": (torch.addmm,),
    "matmul": (operator.matmul, torch.matmul, "matmul"),
    "bmm": (torch.bmm, "bmm"),
    "baddbmm": (torch.baddbmm, "baddbmm"),
    "mm": (torch.mm, "mm"),
    "einsum": (torch.einsum,),
    "solve_triangular": (torch.linalg.solve_triangular,),
    "grouped_mm": (getattr(torch, "_grouped_mm", None), getattr(F, "grouped_mm", None)),
    "scaled_dot_product_attention": (F.scaled_dot_product_attention,),
    "embedding": (F.embedding, torch.embedding),
    "cross_entropy": (F.cross_entropy,),
    "dropout": (F.dropout,),
    "autograd_function_apply": (torch.ops.higher_order.autograd_function_apply,),
    # ---- mixing tokens along the sequence -------------------------------------------------------
    **{name: (getattr(torch, name), name) for name in ("roll", "flip", "diff", "cummax", "cummin", "logcumsumexp")},
    **{name: (getattr(F, name),) for name in ("conv1d", "conv2d", "conv3d")},
    # ---- torch.vmap traced inline ---------------------------------------------------------------
    **{name: (getattr(torch._functorch.predispatch, name),) for name in ("_add_batch_dim", "_remove_batch_dim")},
}

_FUNCTIONS: dict = {}  # call_function target -> canonical name
_METHODS: dict = {}  # call_method name -> canonical name
for _name, _spellings in SPELLINGS.items():
    for _s in _spellings:
        if _s is None:  # not in this torch
            continue
        table = _METHODS if isinstance(_s, str) else _FUNCTIONS
        if table.setdefault(_s, _name) != _name:
            raise AssertionError(f"{_s!r} spells both {table[_s]} and {_name}")


def op_name(node: fx.Node) -> Optional[str]:
    """The canonical name of what a call node runs; None when the table does not list it."""
    if node.op == "call_method":
        return _METHODS.get(node.target)
    if node.op != "call_function":
        return None
    packet = getattr(node.target, "_overloadpacket", node.target)  # torch.ops.ns.op(.overload)
    qualified = getattr(packet, "_qualified_op_name", None)
    if isinstance(qualified, str):
        return qualified
    try:
        return _FUNCTIONS.get(node.target)
    except TypeError:  # an unhashable target
        return None


def is_known(name: str) -> bool:
    """Is ``name`` a canonical name of the table (or a custom op's qualified name)?"""
    return name in SPELLINGS or "::" in name


# ---- traits -----------------------------------------------------------------------------------
_CASTS = {"to", "type", "float", "half", "bfloat16", "double"}

# the output is sharded wherever a sharded input lines up with it (rules/elementwise.py; a custom
# autograd function whose bodies use only these is pointwise too, rules/custom_autograd.py)
POINTWISE = frozenset({
    "add", "sub", "mul", "div", "floor_divide", "remainder", "pow", "neg", "bitwise_and", "bitwise_or", "bitwise_xor",
    "bitwise_not", "eq", "ne", "lt", "le", "gt", "ge", "logical_and", "logical_or", "logical_not",
    "rsqrt", "sqrt", "exp", "log", "cos", "sin", "abs", "erf", "square", "reciprocal", "sign", "clamp", "clip",
    "clamp_min", "clamp_max", "where", "masked_fill", "lerp", "nan_to_num", "log1p", "expm1", "maximum", "minimum",
    "addcmul", "zeros_like", "ones_like", "empty_like", "full_like", "rand_like", "randn_like", "tanh", "sigmoid",
    "silu", "gelu", "softplus", "relu", "leaky_relu", "elu", "mish", "hardtanh", "relu6",
    *_CASTS, "type_as", "long", "int", "bool", "detach", "clone", "contiguous",
    "add_", "sub_", "mul_", "div_", "neg_", "masked_fill_", "fill_", "zero_", "requires_grad_",
})

# linear in a partial sum (rules/partial.py): f(x) of its single tensor input; x * y and x / y for a
# replicated y (DIVIDES: only in the numerator); x + y and x - y of two partial sums
LINEAR_UNARY = frozenset({"reshape", "view", "flatten", "unflatten", "squeeze", "unsqueeze", "transpose", "permute",
                          "contiguous", "expand", "sum", "mean", "neg", "clone", *_CASTS})
LINEAR_SCALE = frozenset({"mul", "div"})
DIVIDES = frozenset({"div"})
LINEAR_ADD = frozenset({"add", "sub"})

# reductions along ``dim`` (rules/reductions.py); the shape-keeping ones keep the reduced dim
REDUCTIONS = frozenset({"mean", "sum", "amax", "amin", "prod", "std", "var", "norm", "logsumexp", "any", "all",
                        "argmax", "argmin", "count_nonzero", "softmax", "log_softmax", "cumsum", "cumprod"})
SHAPE_KEEPING = frozenset({"softmax", "log_softmax", "cumsum", "cumprod"})
LINEAR_REDUCTIONS = REDUCTIONS & LINEAR_UNARY  # sum, mean: over the sharded dim, a partial sum

# normalizations over trailing dims: op -> index of ``normalized_shape`` among the arguments
NORMALIZED_SHAPE_ARG = {"layer_norm": 1, "rms_norm": 1}

# views whose arguments spell out the output's sizes (rewritten to local sizes)
SIZED_VIEWS = frozenset({"view", "reshape"})
# pure reshapes: the gradient may be reduced before or after them alike (grad_reduction.py)
PURE_RESHAPES = frozenset({"view", "reshape", "expand", "transpose", "permute", "unsqueeze", "contiguous", "flatten"})
# read only the shape of their input, never its data
SHAPE_QUERIES = frozenset({"size", "dim", "ndimension", "get_device"})

# the same values, perhaps in another dtype or another tensor (a cast or copy written between two ops)
SAME_VALUES = frozenset({*_CASTS, "type_as", "detach", "clone", "contiguous"})

# a fused projection's features pass through these unchanged on the way to its split (rules/fused.py)
KEEPS_FEATURES = frozenset({"to", "float", "half", "bfloat16", "contiguous", "view", "reshape", "add", "mul",
                            "unsqueeze", "dropout"})
# ... and, where the features are not the last dimension (rules/fused.py ``_keeps_channels``), these
ELEMENTWISE_ACTIVATIONS = frozenset({"silu", "gelu", "relu", "softplus", "sigmoid", "tanh", "to", "float", "half",
                                     "bfloat16", "contiguous"})

# sequence parallelism lets a sequence shard through these, operand by operand checked
# (rewrite/sequence_parallel.py); reductions and norms there: over other dims only
TOKEN_WISE = frozenset({"add", "sub", "mul", "div", "neg", "pow", "rsqrt", "sqrt", "exp", "tanh", "sigmoid", "erf",
                        "abs", "square", "where", "clamp", "silu", "gelu", "relu", "softplus", "mish", "to", "float",
                        "half", "bfloat16", "double", "contiguous", "clone"})
TOKEN_WISE_REDUCTIONS = frozenset({"mean", "sum", "amax"})
# each token alone times weights: token-wise on a shard when the weights are replicated (a LoRA adapter's A of a
# column-parallel layer, B of a row-parallel one; a router); their gradients then get reduced like a norm's
TOKEN_WISE_PRODUCTS = frozenset({"linear"})

# mix tokens along the sequence outside attention: a context-parallel chunk cannot compute them
SEQUENCE_MIXING = frozenset({"cumsum", "cumprod", "roll", "flip", "diff", "conv1d", "conv2d", "conv3d", "cummax",
                             "cummin", "logcumsumexp"})
# products that may multiply two activations (attention written out by hand)
ACTIVATION_PRODUCTS = frozenset({"matmul", "bmm", "baddbmm", "einsum", "mm"})

# results that may share their first argument's storage: a write into them is a write into it (rewrite/redistribute.py)
SHARES_STORAGE = frozenset({"getitem", "view", "reshape", "expand", "transpose", "permute", "unsqueeze", "squeeze",
                            "flatten", "unflatten", "movedim", "t", "split", "chunk", "unbind"})

_TRAITS = (POINTWISE, LINEAR_UNARY, LINEAR_SCALE, DIVIDES, LINEAR_ADD, REDUCTIONS, SHAPE_KEEPING, SIZED_VIEWS,
           PURE_RESHAPES, SHAPE_QUERIES, SAME_VALUES, KEEPS_FEATURES, TOKEN_WISE, TOKEN_WISE_REDUCTIONS,
           SEQUENCE_MIXING, ACTIVATION_PRODUCTS, TOKEN_WISE_PRODUCTS, frozenset(NORMALIZED_SHAPE_ARG), ELEMENTWISE_ACTIVATIONS,
           SHARES_STORAGE)
for _trait in _TRAITS:
    if not _trait <= SPELLINGS.keys():
        raise AssertionError(f"traits name ops the table does not spell: {sorted(_trait - SPELLINGS.keys())}")
