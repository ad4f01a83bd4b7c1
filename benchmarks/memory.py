"""Peak memory of one phase of a process: RSS on CPU, allocated bytes on CUDA.

On Linux the resident-set high-water mark can be reset (``/proc/self/clear_refs``
``5``), so two systems measured one after the other in the same process each get
their own peak. Freed heap is handed back to the OS first (``malloc_trim``) so
the second system does not look smaller by reusing the first one's pages.
"""
from __future__ import annotations

import ctypes
import gc
import resource

import torch

MiB = 2**20


def _status_kib(field: str):
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        pass
    return None


def _release_heap():
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


class PeakMemory:
    """``start()`` before a phase, ``stop()`` after: returns (peak MiB, growth over the start MiB)."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.resettable = True
        self.baseline = 0.0

    def _current(self) -> float:
        if self.cuda:
            return torch.cuda.memory_allocated() / MiB
        kib = _status_kib("VmRSS")
        return (kib or 0) / 1024

    def start(self) -> None:
        _release_heap()
        if self.cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        else:
            try:
                with open("/proc/self/clear_refs", "w") as f:
                    f.write("5")
            except OSError:
                self.resettable = False  # peak since process start (ru_maxrss)
        self.baseline = self._current()

    def stop(self) -> tuple:
        if self.cuda:
            torch.cuda.synchronize()
            peak = torch.cuda.max_memory_allocated() / MiB
        else:
            kib = _status_kib("VmHWM") if self.resettable else None
            peak = (kib if kib is not None else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) / 1024
        return peak, peak - self.baseline

    @property
    def kind(self) -> str:
        if self.cuda:
            return "CUDA max allocated"
        return "RSS high-water mark" + ("" if self.resettable else " (since process start)")
