"""Which library code is running on the stack: how the parallel model answers a client library's call as that
library needs (accelerate's checkpoint calls, torch's gradient clipping) or refuses it by name (PEFT wrapping it),
where the call itself carries no sign of who made it."""
from __future__ import annotations

import sys
from typing import Optional

TRAINER = "transformers.trainer"  # the module of transformers.Trainer, whose calls several answers look for


def functions_on_stack(module: str, limit: Optional[int] = None) -> list:
    """The names of the functions of ``module`` (or, for a name ending in ".", of any module under it) running on
    the caller's stack, innermost first; ``limit``: the caller's ``limit`` nearest frames only."""
    frame, names = sys._getframe(1), []
    while frame is not None and limit != 0:
        name = str(frame.f_globals.get("__name__", ""))
        if name == module or (module.endswith(".") and name.startswith(module)):
            names.append(frame.f_code.co_name)
        frame, limit = frame.f_back, None if limit is None else limit - 1
    return names


def frame_local(module: str, function: str, name: str):
    """The local ``name`` of the innermost running call of ``module``'s ``function`` on the caller's stack, or None
    (where a library's call carries what it asks for in its own frame only: the options of torch's state-dict
    helpers)."""
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code.co_name == function and frame.f_globals.get("__name__") == module:
            return frame.f_locals.get(name)
        frame = frame.f_back
    return None
