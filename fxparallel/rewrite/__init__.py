"""Stage 3: rewrite the captured graph to local shapes with autograd-aware collectives."""
from .local_graph import localize, output_placements

__all__ = ["localize", "output_placements"]
