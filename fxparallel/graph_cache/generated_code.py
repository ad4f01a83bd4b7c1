"""The shape of code FX generates, checked before a cached entry's source is compiled. A file whose MAC
checks out was written by this user's fxparallel, so this is a second line, cheap enough for every launch
(one parse, a look at the function's signature and top-level statements, and a scan of the text): one
function ``forward`` without decorators, defaults or annotations that are not constants (they would run when
it is defined), whose statements assign (``x /= y`` to a plain name too: FX writes in-place operators so),
delete, evaluate and return; no dunder name anywhere
(``__globals__``, ``__class__``, ``__import__``), no ``import`` / ``lambda`` / ``global``, no call of a
builtin that runs or reads code or files, or ends the process.

The code keeps the normal builtins when it runs: Dynamo, which traces it under ``torch.compile``, guards on
builtins through the function's own builtins dict, so a reduced one breaks compiled decode."""
from __future__ import annotations

import ast
import re

_STATEMENTS = (ast.Assign, ast.AnnAssign, ast.Return, ast.Expr, ast.Delete, ast.Pass)
_DUNDER = re.compile(r"\b__\w*")
_KEYWORDS = re.compile(r"\b(import|lambda|global|nonlocal|yield|await|async)\b")
_CALLS = re.compile(r"\b(eval|exec|compile|open|globals|locals|vars|breakpoint|input|setattr|delattr|memoryview|"
                    r"exit|quit|help)\s*\(")


class GeneratedCodeError(ValueError):
    """The source is not of the form FX generates."""


def _line(src: str, position: int) -> int:
    return src.count("\n", 0, position) + 1


def check_generated_code(src: str) -> None:
    """Raise GeneratedCodeError unless ``src`` has the form of one FX-generated ``forward`` (module docstring)."""
    for pattern, what in ((_DUNDER, "the name"), (_KEYWORDS, "the keyword"), (_CALLS, "a call of")):
        found = pattern.search(src)
        if found:
            name = found.group(1) if pattern is _CALLS else found.group(0)
            raise GeneratedCodeError(f"line {_line(src, found.start())}: {what} {name}")
    try:
        tree = ast.parse(src)
    except SyntaxError as err:
        raise GeneratedCodeError(f"the code does not parse ({err.msg}, line {err.lineno})") from None
    if len(tree.body) != 1 or not isinstance(tree.body[0], ast.FunctionDef) or tree.body[0].name != "forward":
        raise GeneratedCodeError("the code is not a single function named forward")
    fn, signature = tree.body[0], tree.body[0].args
    if fn.decorator_list or signature.vararg or signature.kwarg or signature.defaults or fn.returns or any(
            d is not None for d in signature.kw_defaults):
        raise GeneratedCodeError("forward has decorators, defaults, a return annotation or variable arguments "
                                 "(evaluated when it is defined)")
    for a in signature.posonlyargs + signature.args + signature.kwonlyargs:
        if a.annotation is not None and not isinstance(a.annotation, ast.Constant):
            raise GeneratedCodeError(f"argument {a.arg} has an annotation that is not a constant")
    for statement in fn.body:
        in_place_on_name = isinstance(statement, ast.AugAssign) and isinstance(statement.target, ast.Name)
        if not (isinstance(statement, _STATEMENTS) or in_place_on_name):
            raise GeneratedCodeError(f"line {statement.lineno}: a {type(statement).__name__} statement")
