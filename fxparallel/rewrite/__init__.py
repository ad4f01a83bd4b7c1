"""Stage 3: rewrite the captured graph to local shapes with autograd-aware collectives,
as an ordered list of passes (``passes.py``)."""
from .passes import PASSES, PassContext, run_passes

__all__ = ["PASSES", "PassContext", "run_passes"]
