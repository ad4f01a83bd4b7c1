"""Stage 1: build the model on the meta device and capture its forward as one FX graph."""
from .dynamo import capture
from .graph import CapturedGraph
from .meta_model import build_meta_model
from .spec import GraphSpec

__all__ = ["capture", "CapturedGraph", "GraphSpec", "build_meta_model"]
