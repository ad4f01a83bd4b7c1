"""Names that become code: every module, parameter and buffer path of the model is spelled in the
Python that fxparallel generates and runs (``self.model.layers[0]...``). Some transformers models
build module names from config strings (X-MOD's ``adapter_modules[language]``), and torch.fx writes a
component that is not an identifier as ``getattr(r, "<component>")`` without escaping it, so a crafted
config.json could put code there. Only identifiers and integers are accepted; anything else is refused
before capture, and checked again on every target the code generator spells."""
from __future__ import annotations

import keyword
import re

from ..errors import CaptureError

_COMPONENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]*|[0-9]+")


def unsafe_component(path: str):
    """The first component of the dotted ``path`` that is not an ASCII identifier or integer, else None."""
    for part in str(path).split("."):
        if not _COMPONENT.fullmatch(part) or keyword.iskeyword(part):
            return part
    return None


def _refuse(kind: str, path: str, part: str):
    raise CaptureError(f"the model's {kind} {path!r} has the name component {part!r}, which is not a Python "
                       "identifier or integer; fxparallel spells these names in the code it generates, so it refuses "
                       "them (such names come from config strings, e.g. X-MOD's `languages`: use identifiers there)")


def check_model_names(model) -> None:
    """Refuse a model any of whose module, parameter or buffer paths holds an unsafe component."""
    for kind, names in (("module", (n for n, _ in model.named_modules() if n)),
                        ("parameter", (n for n, _ in model.named_parameters(remove_duplicate=False))),
                        ("buffer", (n for n, _ in model.named_buffers(remove_duplicate=False)))):
        for path in names:
            part = unsafe_component(path)
            if part is not None:
                _refuse(kind, path, part)


def check_graph_targets(graph) -> None:
    """Refuse a graph whose attribute or submodule reads would spell an unsafe name in generated code."""
    for node in graph.nodes:
        if node.op in ("get_attr", "call_module"):
            part = unsafe_component(node.target)
            if part is not None:
                _refuse(f"graph {node.op} target", str(node.target), part)
