"""Shape queries of sharded values, answered as on one device.

``x.size()`` of a shard is the shard's size; the captured code asked for the full one (Qwen3-Next's
``z_shape_og = z.shape``, then ``out.reshape(z_shape_og)``). Where the sharded dims are static, the plan keeps
the query local and the rewrite (``rewrite/local_ops.py::full_shape``) makes it return the full sizes: views
of shards then make them local as they do literal sizes (``rewrite/view_sizes.py``)."""
from __future__ import annotations

import torch


def full_size(x: torch.Tensor, full: tuple) -> torch.Size:
    """``x.size()`` with the dims of ``full`` that are not None replaced by them."""
    return torch.Size(f if f is not None else s for f, s in zip(full, x.size()))
