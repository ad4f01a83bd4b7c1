"""A planned graph as JSON data and back: generated code with the names it reads, shape guards,
placements and the report. Only what can be named is written: a graph whose code reads an object
that is not importable by name (a custom autograd body, a local function), or one outside the
allow-list below, raises ``Uncacheable`` and is simply rebuilt next time.

Decoding trusts nothing by name alone (the store authenticates the file; this is the second line):
every module imported and every object looked up must lie in ``ALLOWED_MODULES`` with a plain dotted
name, shape-guard calls must be sympy's, and the code must have the form FX generates
(``generated_code.py``)."""
from __future__ import annotations

import builtins
import importlib
import re
import types
from dataclasses import dataclass, field
from typing import Optional

import sympy
import torch
from torch.fx.graph_module import _forward_from_src

from ..capture.spec import GraphSpec
from ..ops.local_graph import LocalGraph
from ..plan.placement import Placement
from ..plan.plan import ShardingPlan
from ..ops.layer_units import LayerPieces, new_piece_key
from .generated_code import check_generated_code

FORMAT = 3


class Uncacheable(Exception):
    """This graph cannot be written as data (the reason says what)."""


@dataclass
class PlannedGraph:
    """What capture, solve and rewrite give for one set of arguments: the code this rank runs, every
    parameter's placement (later graphs are fixed to them), the report (the training graph's), and
    the warnings planning logged (repeated when the graph comes from the cache)."""

    local: LocalGraph
    params: dict  # name -> Placement
    plan: Optional[ShardingPlan] = None
    warnings: tuple = ()
    timings: dict = field(default_factory=dict)  # seconds per stage that made it (not stored)


# ---- names the generated code reads ----------------------------------------------------------
# modules (and their submodules) whose objects the generated code may read: torch's ops and
# fxparallel's runtime functions, Python's operator and math; shape guards: sympy's classes
ALLOWED_MODULES = ("torch", "operator", "_operator", "math", "fxparallel")
# builtins FX binds by name (``getattr`` for a call_function getattr node, e.g. ``weight.T``); the code runs
# with the normal builtins anyway (generated_code.py), so naming one gives it nothing new
ALLOWED_BUILTINS = ("getattr",)
GUARD_MODULES = ("sympy", "torch.utils._sympy")
_PLAIN = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def _allowed(module: str, qualname: str, roots=ALLOWED_MODULES) -> bool:
    names = str(module).split(".") + (str(qualname).split(".") if qualname else [])
    return (any(module == r or str(module).startswith(r + ".") for r in roots)
            and all(plain_name(n) for n in names))


def plain_name(name: str) -> bool:
    """An identifier that is not a dunder name (``__class__``, ``__globals__``): safe to look up or set by name."""
    return bool(_PLAIN.fullmatch(name)) and not name.startswith("__")


def resolve(module: str, qualname: str, roots=ALLOWED_MODULES):
    if not _allowed(module, qualname, roots):
        raise ValueError(f"{module}.{qualname} is not on the graph cache's allow-list ({', '.join(roots)})")
    obj = importlib.import_module(module)
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return obj


def _name_of(name: str, value):
    if isinstance(value, types.ModuleType):
        if not _allowed(value.__name__, ""):
            raise Uncacheable(f"the code reads module {value.__name__}, outside the allow-list")
        return ["module", value.__name__]
    if value is type(None):
        return ["none_type"]
    if isinstance(value, float):
        return ["float", repr(value)]
    if name in ALLOWED_BUILTINS and value is getattr(builtins, name):
        return ["builtin", name]
    module, qualname = getattr(value, "__module__", None), getattr(value, "__qualname__", None)
    if module and qualname and "<" not in qualname and _allowed(module, qualname):
        try:
            if resolve(module, qualname) is value:
                return ["object", module, qualname]
        except (ImportError, AttributeError):
            pass
    raise Uncacheable(f"the code reads {name} = {value!r}, which cannot be imported by name from an allowed module")


def _value_of(ref: list):
    kind = ref[0]
    if kind == "module":
        if not _allowed(ref[1], ""):
            raise ValueError(f"module {ref[1]} is not on the graph cache's allow-list")
        return importlib.import_module(ref[1])
    if kind == "none_type":
        return type(None)
    if kind == "float":
        return float(ref[1])  # repr of a float, inf and nan included
    if kind == "object":
        return resolve(ref[1], ref[2])
    if kind == "builtin":
        if ref[1] not in ALLOWED_BUILTINS:
            raise ValueError(f"builtin {ref[1]} is not on the graph cache's allow-list {ALLOWED_BUILTINS}")
        return getattr(builtins, ref[1])
    raise ValueError(f"unknown global kind {kind!r}")


def _encode_code(forward, code: str) -> dict:
    names = {k: _name_of(k, v) for k, v in forward.__globals__.items() if k != "__builtins__"}
    return {"src": code, "globals": names}


def _decode_code(entry: dict):
    check_generated_code(entry["src"])
    names = {k: _value_of(v) for k, v in entry["globals"].items() if not k.startswith("__")}
    return _forward_from_src(entry["src"], names), entry["src"]


# ---- shape guards (sympy expressions over size symbols) --------------------------------------
def _encode_expr(e):
    if e is sympy.true or e is sympy.false:
        return ["bool", bool(e)]
    if e.is_Symbol:
        return ["symbol", e.name, dict(e._assumptions0)]  # the assumptions it was made with
    if e.is_Integer:
        return ["int", int(e)]
    if e.is_Rational:
        return ["rational", int(e.p), int(e.q)]
    if e.args:
        func = e.func
        if not _allowed(func.__module__, func.__qualname__, GUARD_MODULES):
            raise Uncacheable(f"a shape guard calls {func.__module__}.{func.__qualname__}, outside {GUARD_MODULES}")
        return ["call", func.__module__, func.__qualname__, [_encode_expr(a) for a in e.args]]
    raise Uncacheable(f"a shape guard holds {e!r} ({type(e).__name__})")


def _decode_expr(d):
    kind = d[0]
    if kind == "bool":
        return sympy.true if d[1] else sympy.false
    if kind == "symbol":
        if not _PLAIN.fullmatch(str(d[1])) or not all(isinstance(v, bool) for v in d[2].values()):
            raise ValueError(f"symbol {d[1]!r} with assumptions {d[2]!r} is not a size symbol")
        return sympy.Symbol(d[1], **{str(k): v for k, v in d[2].items()})
    if kind == "int":
        return sympy.Integer(d[1])
    if kind == "rational":
        return sympy.Rational(d[1], d[2])
    if kind == "call":
        return resolve(d[1], d[2], GUARD_MODULES)(*[_decode_expr(a) for a in d[3]])
    raise ValueError(f"unknown expression kind {kind!r}")


def _encode_guards(guards) -> dict:
    return {
        "guards": [_encode_expr(g) for g in guards.guards],
        "symbols": [[_encode_expr(s), arg, dim] for s, (arg, dim) in guards.symbol_sources.items()],
        "static": [[arg, dim, size] for (arg, dim), size in guards.static_sizes.items()],
    }


def _decode_guards(d: dict):
    from ..capture.graph import ShapeGuards

    return ShapeGuards(guards=tuple(_decode_expr(g) for g in d["guards"]),
                       symbol_sources={_decode_expr(s): (arg, dim) for s, arg, dim in d["symbols"]},
                       static_sizes={(arg, dim): size for arg, dim, size in d["static"]})


# ---- placements and the rest ----------------------------------------------------------------
def _placement(p) -> Optional[str]:
    if p is not None and not isinstance(p, Placement):
        raise Uncacheable(f"an output placement is {p!r}")
    return None if p is None else repr(p)


def _parse(text: Optional[str]) -> Optional[Placement]:
    return None if text is None else Placement.parse(text)


def _dtype(name: str) -> torch.dtype:
    value = getattr(torch, name.removeprefix("torch."))
    if not isinstance(value, torch.dtype):
        raise ValueError(f"{name} is not a dtype")
    return value


def encode(planned: PlannedGraph) -> dict:
    local = planned.local
    if local.attributes:
        raise Uncacheable(f"the code reads graph attributes {sorted(local.attributes)} (custom autograd bodies)")
    pieces = None
    if local.pieces is not None:
        pieces = {"key": local.pieces.key,
                  "code": {path: _encode_code(fn, local.pieces.code[path]) for path, fn in local.pieces.forward.items()}}
        if local.pieces.root.count(repr(local.pieces.key)) != len(local.pieces.forward):
            raise Uncacheable("the piece key does not appear once per layer call in the root code")
    return {
        "format": FORMAT,
        "spec": local.spec.to_dict(),
        "outputs": list(local.outputs),
        "output_placements": {k: _placement(v) for k, v in local.output_placements.items()},
        "output_sizes": {k: (list(v) if v is not None else None) for k, v in local.output_sizes.items()},
        "state": {k: [list(full), list(loc), str(dtype)] for k, (full, loc, dtype) in local.state.items()},
        "guards": _encode_guards(local.guards),
        "code": _encode_code(local.forward, local.pieces.root if local.pieces is not None else local.code),
        "pieces": pieces,
        "params": {name: _placement(p) for name, p in planned.params.items()},
        "plan": planned.plan.to_dict() if planned.plan is not None else None,
        "warnings": list(planned.warnings),
    }


def decode(d: dict) -> PlannedGraph:
    if d.get("format") != FORMAT:
        raise ValueError(f"format {d.get('format')!r}, expected {FORMAT}")
    pieces, root = None, d["code"]
    if d["pieces"] is not None:
        # a fresh key: another graph of this process may already use the writer's
        key = new_piece_key()
        root = dict(root, src=root["src"].replace(repr(d["pieces"]["key"]), repr(key)))
        decoded = {path: _decode_code(entry) for path, entry in d["pieces"]["code"].items()}
        pieces = LayerPieces(key=key, forward={p: fn for p, (fn, _) in decoded.items()},
                             code={p: src for p, (_, src) in decoded.items()}, root=root["src"])
    forward, code = _decode_code(root)
    if pieces is not None:
        code = pieces.full_code()
    local = LocalGraph(
        spec=GraphSpec.from_dict(d["spec"]), forward=forward, outputs=tuple(d["outputs"]),
        output_placements={k: _parse(v) for k, v in d["output_placements"].items()},
        guards=_decode_guards(d["guards"]), attributes={}, code=code,
        output_sizes={k: (tuple(v) if v is not None else None) for k, v in d["output_sizes"].items()},
        state={k: (tuple(full), tuple(loc), _dtype(dtype)) for k, (full, loc, dtype) in d["state"].items()},
        pieces=pieces)
    plan = ShardingPlan.from_dict(d["plan"]) if d["plan"] is not None else None
    return PlannedGraph(local, {k: _parse(v) for k, v in d["params"].items()}, plan, tuple(d["warnings"]))
