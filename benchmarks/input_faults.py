"""Time from a faulty call to its error, for the per-call input checks (docs/reliability.md).

Two gloo ranks on CPU, a tiny Llama checkpoint built here. Prints one row per fault: the error
text and the median seconds of 5 tries (the fingerprint all-gather and the host sync included).

    python benchmarks/input_faults.py
"""
from __future__ import annotations

import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
from distributed import run_ranks  # noqa: E402


def _faults(rank, world, path):
    import torch
    import torch.distributed as dist

    import fxparallel
    from fxparallel.errors import InputError

    model = fxparallel.parallelize(path, dist.group.WORLD, dtype=torch.float32)
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(0))
    other = ids.clone()
    other[1, 3] = (other[1, 3] + 1) % 128
    faults = {
        "token id >= vocabulary": lambda: model(input_ids=torch.where(ids == ids[0, 0], 128, ids)),
        "labels outside the vocabulary": lambda: model(input_ids=ids, labels=torch.full_like(ids, 10 ** 6)),
        "labels of another shape": lambda: model(input_ids=ids, labels=ids[:, :4]),
        "empty batch (0 x 8)": lambda: model(input_ids=torch.zeros(0, 8, dtype=torch.long)),
        "tp ranks given different tokens": lambda: model(input_ids=other if rank == 1 else ids, labels=ids),
        "tp ranks given different batch sizes": lambda: model(input_ids=ids[:1] if rank == 1 else ids, labels=ids),
        "labels on one tp rank only": lambda: model(input_ids=ids, labels=None if rank == 1 else ids),
    }
    rows = {}
    with torch.no_grad():
        model(input_ids=ids, labels=ids)  # warm
        start = time.perf_counter()
        model(input_ids=ids, labels=ids)
        rows["a good call (for scale)"] = ("ok", time.perf_counter() - start)
        for name, call in faults.items():
            times, text = [], "no error"
            for _ in range(5):
                dist.barrier()
                start = time.perf_counter()
                try:
                    call()
                except InputError as err:
                    text = str(err)
                times.append(time.perf_counter() - start)
            rows[name] = (text, statistics.median(times))
    return rows


def main():
    from models import save_checkpoint, tiny_config

    with tempfile.TemporaryDirectory() as tmp:
        path = save_checkpoint(tiny_config("llama"), os.path.join(tmp, "llama"))
        rows = run_ranks(2, _faults, path)[0]
    print(f"load average: {os.getloadavg()[0]:.1f}")
    print("| fault | what the user sees | seconds to the error |\n|---|---|---|")
    for name, (text, seconds) in rows.items():
        print(f"| {name} | `InputError: {text}` | {seconds:.4f} |" if text != "ok" else
              f"| {name} | (no error) | {seconds:.4f} |")


if __name__ == "__main__":
    main()
