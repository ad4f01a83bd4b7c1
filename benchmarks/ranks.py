"""What every torchrun benchmark does on its ranks: start the process group (gloo on CPU, NCCL on CUDA)
with a local default checkpoint built once, share values between ranks, wait for the GPU before a timer
stops, report errors in one line."""
from __future__ import annotations

import datetime
import os

import torch
import torch.distributed as dist


def start(model, default_dir: str, build_default, timeout_s: float = 1800, device: str = "cpu") -> tuple:
    """Start the process group; returns (rank, world, checkpoint path): ``model`` when given, else
    ``default_dir``, which rank 0 fills with ``build_default(default_dir)`` while the others wait.
    ``device="cuda"``: NCCL, each rank on the GPU of its local rank (fxparallel then places its shards there)."""
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    if device not in ("cpu", "cuda"):
        raise ValueError(f"device: expected 'cpu' or 'cuda', got {device!r}")
    gpu = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if device == "cuda" else None
    if gpu is not None:
        torch.cuda.set_device(gpu)
    dist.init_process_group("nccl" if gpu else "gloo", timeout=datetime.timedelta(seconds=timeout_s), device_id=gpu)
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


def synchronize() -> None:
    """Wait for the GPU's queued work (a no-op on CPU), so that a timer stops when the work is done."""
    if torch.cuda.is_initialized():
        torch.cuda.synchronize()


def transformers_tp(path: str, world: int, dtype, device: str) -> tuple:
    """transformers' ``from_pretrained(path, tp_plan="auto")`` on ``device``: (model, note). At TP=1, where
    transformers may refuse a tp plan, the plain single-device model, with a note saying so."""
    from transformers import AutoModelForCausalLM

    note = None
    try:
        model = AutoModelForCausalLM.from_pretrained(path, tp_plan="auto", dtype=dtype)
    except Exception as err:  # noqa: BLE001
        if world != 1:
            raise
        note = f'tp_plan="auto" failed at TP=1 ({short_error(err)}); the plain model is the reference'
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    if model.device.type != torch.device(device).type:  # at TP=1 transformers may leave the model on the CPU
        model.to(device)
    return model, note


def short_error(err: BaseException) -> str:
    text = f"{type(err).__name__}: {err}".strip().splitlines()
    return text[0][:400] if text else type(err).__name__


def render_saved(path: str, markdown_table) -> int:
    """``--render``: print the markdown table of a saved result."""
    import json

    with open(path) as f:
        print(markdown_table(json.load(f)))
    return 0


def cpu_run_meta(load_start: float) -> dict:
    """Where and when a CPU run was measured, and the machine's 1-minute load at its start and end."""
    import time

    return {"device": "cpu", "cores": os.cpu_count(), "threads": torch.get_num_threads(), "torch": torch.__version__,
            "date": time.strftime("%Y-%m-%d %H:%M %Z"), "load_average_start": load_start,
            "load_average_end": os.getloadavg()[0]}


def write_result(path: str, result: dict, markdown_table) -> None:
    """Rank 0 saves ``result`` as JSON at ``path`` and prints its markdown table."""
    import json

    if dist.get_rank() != 0:
        return
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(result, f, indent=1)
    print(markdown_table(result))
