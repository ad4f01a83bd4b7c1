"""transformers.Trainer at tp > 1 on a CPU job, where accelerate refuses it.

Trainer trains a tensor-parallel model through accelerate's ``ParallelismConfig(tp_size=...)``, and
accelerate accepts that only on accelerators: ``multi_device`` lists GPU-like device types, so a
multi-process CPU job (gloo) fails its check "ParallelismConfig is only compatible ...". Nothing else
on that path needs an accelerator. ``allow_tensor_parallel_on_cpu()`` counts a multi-process CPU job as
a multi-device one for that check (a process-wide change of accelerate's ``Accelerator.multi_device``,
made only when called); on GPUs it is not needed."""
from __future__ import annotations


def allow_tensor_parallel_on_cpu() -> None:
    """Let accelerate take ``ParallelismConfig(tp_size=...)`` on a multi-process CPU job (see the module
    docstring). Idempotent."""
    from accelerate import Accelerator
    from accelerate.utils import DistributedType

    listed = Accelerator.multi_device.fget
    if getattr(listed, "_fxparallel_cpu", False):
        return

    def multi_device(self) -> bool:
        return listed(self) or self.distributed_type == DistributedType.MULTI_CPU

    multi_device._fxparallel_cpu = True
    Accelerator.multi_device = property(multi_device)
