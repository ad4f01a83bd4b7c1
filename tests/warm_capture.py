"""Imported by the fork server that every rank is forked from (``distributed.PRELOAD``): one capture and plan of
a tiny Llama on the meta device, so that torch.compile's one-off start-up (Dynamo's and the fake-tensor mode's
lazy set-up, about 3 s of CPU) is paid once per session rather than by every rank of every test. Nothing runs on
real tensors here (no thread pool is started before the fork), nothing is written to a graph cache, and the cache
counters are left at zero."""
import os


def _warm() -> None:
    import torch

    import fxparallel
    from fxparallel import graph_cache
    from models import tiny_config

    kept = os.environ.get("FXPARALLEL_GRAPH_CACHE")
    os.environ["FXPARALLEL_GRAPH_CACHE"] = "off"
    try:
        fxparallel.plan_model(tiny_config("llama"), 2, dtype=torch.float32)
    finally:
        if kept is None:
            os.environ.pop("FXPARALLEL_GRAPH_CACHE")
        else:
            os.environ["FXPARALLEL_GRAPH_CACHE"] = kept
        for key in graph_cache.stats:
            graph_cache.stats[key] = 0


_warm()
