"""The sizes a call spells out, read one way for the rules and the rewrite: ``x.view(a, b)``,
``x.view((a, b))`` and ``x.view(size=(a, b))`` (likewise ``reshape``, ``expand``, ``new_empty``, and
``permute``'s dims)."""
from __future__ import annotations

from typing import Callable


def spelled_out(node, keyword: str = "size") -> tuple[list, Callable[[list], None]]:
    """(the sizes ``node`` spells out after its input, a function that writes new ones in the same form)."""
    args = list(node.args)
    rest = args[1:]
    if not rest and keyword in node.kwargs:
        return list(node.kwargs[keyword]), lambda new: setattr(node, "kwargs", {**node.kwargs, keyword: tuple(new)})
    if len(rest) == 1 and isinstance(rest[0], (tuple, list)):
        return list(rest[0]), lambda new: setattr(node, "args", (args[0], type(rest[0])(new)))
    return rest, lambda new: setattr(node, "args", (args[0],) + tuple(new))
