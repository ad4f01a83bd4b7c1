"""What every torchrun benchmark does on its ranks: start the gloo group with a local default
checkpoint built once, share values between ranks, report errors in one line."""
from __future__ import annotations

import datetime
import os

import torch.distributed as dist


def start(model, default_dir: str, build_default, timeout_s: float = 1800) -> tuple:
    """Start the process group; returns (rank, world, checkpoint path): ``model`` when given, else
    ``default_dir``, which rank 0 fills with ``build_default(default_dir)`` while the others wait."""
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=timeout_s))
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    rank, world = dist.get_rank(), dist.get_world_size()
    if model is None:
        if rank == 0:
            build_default(default_dir)
        dist.barrier()
    return rank, world, model or default_dir


def everyone(obj) -> list:
    """``obj`` of every rank, in rank order."""
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, obj)
    return gathered


def short_error(err: BaseException) -> str:
    text = f"{type(err).__name__}: {err}".strip().splitlines()
    return text[0][:400] if text else type(err).__name__
