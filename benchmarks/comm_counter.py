"""Count collectives by kind, bytes and phase, the same way for every system.

Both systems end in a handful of Python entry points: the ``torch.distributed``
functions (fxparallel, and transformers' no-grad and gradient-hook paths) and the
functional collectives ``torch.ops._c10d_functional.*`` that DTensor
redistribution calls (transformers' grad-mode path). ``CommCounter`` wraps all of
them while it is active and records (phase, kind, bytes) per call; the phase is a
plain attribute the caller sets around forward / backward / optimizer step.

Bytes are the size of the complete tensor one call acts on, the convention of
``ShardingPlan.bytes_per_token``: an all-reduce counts its input, an all-gather its
gathered output, a reduce-scatter its unscattered input. Nested calls (one
wrapped function implemented with another) count once.

Each record also holds the call's wall time: for a ``torch.distributed`` call without ``async_op`` that
includes the wait for the other ranks; a functional collective only issues its work (the wait is in
``wait_tensor``, not wrapped), so its time is the issue alone.
"""
from __future__ import annotations

import threading
import time
from collections import Counter
from contextlib import contextmanager

import torch
import torch.distributed as dist

# torch.distributed function -> kind reported
DIST_FUNCTIONS = {
    "all_reduce": "all_reduce",
    "all_gather": "all_gather",
    "all_gather_into_tensor": "all_gather",
    "all_gather_single": "all_gather",
    "_all_gather_base": "all_gather",
    "reduce_scatter": "reduce_scatter",
    "reduce_scatter_tensor": "reduce_scatter",
    "reduce_scatter_single": "reduce_scatter",
    "_reduce_scatter_base": "reduce_scatter",
    "broadcast": "broadcast",
    "all_to_all_single": "all_to_all",
    "all_to_all": "all_to_all",
    "scatter": "scatter",
    "gather": "gather",
    "reduce": "reduce",
}
# op in torch.ops._c10d_functional (and _c10d_functional_autograd) -> kind reported
FUNCTIONAL_OPS = {
    "all_reduce": "all_reduce",
    "all_reduce_": "all_reduce",
    "all_reduce_coalesced": "all_reduce",
    "all_gather_into_tensor": "all_gather",
    "all_gather_single": "all_gather",
    "all_gather_into_tensor_out": "all_gather",
    "all_gather_into_tensor_coalesced": "all_gather",
    "reduce_scatter_tensor": "reduce_scatter",
    "reduce_scatter_single": "reduce_scatter",
    "reduce_scatter_tensor_coalesced": "reduce_scatter",
    "all_to_all_single": "all_to_all",
    "broadcast": "broadcast",
    "broadcast_": "broadcast",
}
FUNCTIONAL_NAMESPACES = ("_c10d_functional", "_c10d_functional_autograd")


def _nbytes(x) -> int:
    if isinstance(x, torch.Tensor):
        return x.numel() * x.element_size()
    if isinstance(x, (list, tuple)):
        return sum(_nbytes(t) for t in x)
    return 0


def _dist_bytes(name: str, args, kwargs) -> int:
    """Bytes of the complete tensor of one torch.distributed call."""
    def arg(i, key):
        return kwargs[key] if key in kwargs else (args[i] if len(args) > i else None)

    if name in ("all_gather", "all_gather_into_tensor", "_all_gather_base"):
        return _nbytes(arg(0, "tensor_list" if name == "all_gather" else "output_tensor"))
    if name in ("reduce_scatter", "reduce_scatter_tensor", "_reduce_scatter_base"):
        return _nbytes(arg(1, "input_list" if name == "reduce_scatter" else "input"))
    if name in ("all_to_all_single", "all_to_all"):
        return _nbytes(arg(1, "input" if name == "all_to_all_single" else "input_tensor_list"))
    if name == "scatter":
        return _nbytes(arg(1, "scatter_list")) or _nbytes(arg(0, "tensor")) * max(1, dist.get_world_size())
    return _nbytes(arg(0, "tensor"))


def _functional_bytes(kind: str, op: str, args) -> int:
    """Bytes of the complete tensor of one functional-collective call (args: tensor(s), ..., group_size?, ...)."""
    data = _nbytes(args[0]) if args else 0
    if kind == "all_gather":
        size = next((a for a in args[1:] if isinstance(a, int)), 1)
        return data * size
    return data


class CommCounter:
    """Context manager: while active, every wrapped collective is recorded under ``self.phase``.

        counter = CommCounter()
        with counter:
            counter.phase = "forward"; loss = model(...).loss
            counter.phase = "backward"; loss.backward()
        counter.count("all_reduce", "backward"), counter.bytes("backward")
    """

    def __init__(self):
        self.phase = "other"  # a plain attribute, not thread-local: CUDA backward runs on another thread
        self.records: list = []  # (phase, kind, bytes, seconds)
        self._saved: list = []
        self._local = threading.local()

    # ---- results -------------------------------------------------------------
    def count(self, kind=None, phase=None) -> int:
        return sum(1 for p, k, _, _ in self.records if kind in (None, k) and phase in (None, p))

    def bytes(self, phase=None, kind=None) -> int:
        return sum(b for p, k, b, _ in self.records if kind in (None, k) and phase in (None, p))

    def seconds(self, phase=None, kind=None) -> float:
        """Wall seconds inside the recorded calls (see the module docstring for what that includes)."""
        return sum(t for p, k, _, t in self.records if kind in (None, k) and phase in (None, p))

    def summary(self, phase) -> dict:
        """{kind: (calls, bytes)} of one phase."""
        calls, size = Counter(), Counter()
        for p, k, b, _ in self.records:
            if p == phase:
                calls[k] += 1
                size[k] += b
        return {k: (calls[k], size[k]) for k in sorted(calls)}

    def reset(self):
        self.records.clear()

    # ---- recording -----------------------------------------------------------
    @contextmanager
    def in_phase(self, phase: str):
        previous, self.phase = self.phase, phase
        try:
            yield
        finally:
            self.phase = previous

    def _record(self, kind: str, size_fn, call):
        depth = getattr(self._local, "depth", 0)
        if depth:
            return call()
        self._local.depth = 1
        phase, size, start = self.phase, size_fn(), time.perf_counter()
        try:
            return call()
        finally:
            self.records.append((phase, kind, size, time.perf_counter() - start))
            self._local.depth = 0

    def _wrap_dist(self, name, original):
        kind = DIST_FUNCTIONS[name]

        def wrapper(*args, **kwargs):
            return self._record(kind, lambda: _dist_bytes(name, args, kwargs), lambda: original(*args, **kwargs))

        wrapper.__wrapped__ = original
        return wrapper

    def _wrap_op(self, op_name, packet):
        kind = FUNCTIONAL_OPS[op_name]

        class Wrapped:  # keeps .default / overloads reachable for code that names them
            def __call__(_, *args, **kwargs):
                return self._record(kind, lambda: _functional_bytes(kind, op_name, args),
                                    lambda: packet(*args, **kwargs))

            def __getattr__(_, attr):
                overload = getattr(packet, attr)
                if isinstance(overload, torch._ops.OpOverload):
                    return lambda *a, **k: self._record(kind, lambda: _functional_bytes(kind, op_name, a),
                                                        lambda: overload(*a, **k))
                return overload

        return Wrapped()

    def __enter__(self):
        from torch.distributed import distributed_c10d

        for name in DIST_FUNCTIONS:
            original = getattr(distributed_c10d, name, None)
            if original is None:
                continue
            wrapper = self._wrap_dist(name, original)
            for module in (distributed_c10d, dist):  # the same function, reachable under both names
                if getattr(module, name, None) is original:
                    self._saved.append((module, name, original))
                    setattr(module, name, wrapper)
        for ns_name in FUNCTIONAL_NAMESPACES:
            namespace = getattr(torch.ops, ns_name)
            for op_name in FUNCTIONAL_OPS:
                try:
                    packet = getattr(namespace, op_name)
                except (AttributeError, RuntimeError):
                    continue
                self._saved.append((namespace, op_name, packet))
                setattr(namespace, op_name, self._wrap_op(op_name, packet))
        return self

    def __exit__(self, *exc):
        while self._saved:
            owner, name, original = self._saved.pop()
            setattr(owner, name, original)
        return False
