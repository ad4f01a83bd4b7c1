"""Generation on the parallel model: a static KV cache sharded by heads (``cache.py``), the next
token chosen from vocab-sharded logits (``select.py``), and the decode loop around transformers'
own GenerationConfig, logits processors, stopping criteria and streamers (``loop.py``), which it builds
with transformers' private helpers, called from ``transformers_private.py`` only."""
from .parallel_cache import ParallelCache
from .loop import generate

__all__ = ["ParallelCache", "generate"]
