"""The shape of code FX generates, checked before a cached entry's source is compiled: one function
``forward`` whose body assigns, deletes and returns the results of calls, subscripts, attribute reads and
arithmetic. A file whose MAC checks out was written by this user's fxparallel, so this is a second line:
it refuses any source that imports, defines functions or classes, loops, reaches dunder attributes
(``__globals__``, ``__class__``, ...), names a name it was not given, or calls a builtin that runs or
reads code or files."""
from __future__ import annotations

import ast
import builtins

# builtins FX's code calls or reads
_BUILTINS = frozenset({"getattr", "slice", "range", "len", "tuple", "list", "dict", "int", "float", "bool", "None",
                       "True", "False", "Ellipsis", "isinstance", "type", "min", "max", "abs", "print"})
_STATEMENTS = (ast.Assign, ast.AnnAssign, ast.Return, ast.Expr, ast.Delete, ast.Pass)
_FORBIDDEN = (ast.Import, ast.ImportFrom, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Lambda,
              ast.Global, ast.Nonlocal, ast.For, ast.While, ast.With, ast.Try, ast.Await, ast.Yield, ast.YieldFrom,
              ast.NamedExpr, ast.GeneratorExp, ast.ListComp, ast.SetComp, ast.DictComp, ast.JoinedStr)


class GeneratedCodeError(ValueError):
    """The source is not of the form FX generates."""


def check_generated_code(src: str, names: dict) -> None:
    """Raise GeneratedCodeError unless ``src`` is one FX-style ``forward`` reading only ``names`` and locals."""
    try:
        tree = ast.parse(src)
    except SyntaxError as err:
        raise GeneratedCodeError(f"the code does not parse ({err.msg}, line {err.lineno})") from None
    if len(tree.body) != 1 or not isinstance(tree.body[0], ast.FunctionDef) or tree.body[0].name != "forward":
        raise GeneratedCodeError("the code is not a single function named forward")
    fn = tree.body[0]
    signature = fn.args
    if fn.decorator_list or signature.vararg or signature.kwarg or signature.defaults or fn.returns or any(
            d is not None for d in signature.kw_defaults):
        raise GeneratedCodeError("forward has decorators, defaults, a return annotation or variable arguments "
                                 "(evaluated when it is defined)")
    for a in signature.posonlyargs + signature.args + signature.kwonlyargs:
        if a.annotation is not None and not isinstance(a.annotation, ast.Constant):
            raise GeneratedCodeError(f"argument {a.arg} has an annotation that is not a constant")
    known = {a.arg for a in signature.posonlyargs + signature.args + signature.kwonlyargs} | set(names) | _BUILTINS
    for statement in fn.body:
        if not isinstance(statement, _STATEMENTS):
            raise GeneratedCodeError(f"line {statement.lineno}: a {type(statement).__name__} statement")
        for node in ast.walk(statement):
            if isinstance(node, _FORBIDDEN):
                raise GeneratedCodeError(f"line {node.lineno}: a {type(node).__name__}")
            if isinstance(node, ast.Attribute) and node.attr.startswith("__"):
                raise GeneratedCodeError(f"line {node.lineno}: reads the attribute {node.attr}")
            if isinstance(node, ast.Name):
                if node.id.startswith("__"):
                    raise GeneratedCodeError(f"line {node.lineno}: the name {node.id}")
                if isinstance(node.ctx, ast.Store):
                    known.add(node.id)
                elif node.id not in known:
                    hint = " (a builtin not on the list)" if hasattr(builtins, node.id) else ""
                    raise GeneratedCodeError(f"line {node.lineno}: reads {node.id}, which it was not given{hint}")
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "getattr" and (
                    len(node.args) < 2 or not isinstance(node.args[1], ast.Constant)
                    or not str(node.args[1].value).isdigit()):
                raise GeneratedCodeError(f"line {node.lineno}: getattr with a name that is not an integer index")
