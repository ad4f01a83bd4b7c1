"""The two systems under comparison, behind one small interface.

Each ``System`` builds a ready model from a checkpoint directory and exposes the
three calls the benchmark times: a no-grad forward with labels, a training step
(forward, backward, AdamW), and complete logits + loss for the comparison with the
single-device model.
"""
from __future__ import annotations

import time

import torch
import torch.distributed as dist


class System:
    name = ""
    label = ""

    def __init__(self):
        self.model = None
        self.optimizer = None
        self.timings = {}

    def build(self, path: str, tp: int, dtype: torch.dtype, device: torch.device) -> None:
        raise NotImplementedError

    def loss(self, ids):
        return self.model(input_ids=ids, labels=ids).loss

    def logits(self, ids):
        """Complete logits of a forward without labels."""
        raise NotImplementedError

    def make_optimizer(self, lr: float):
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=lr)

    def close(self):
        self.model = self.optimizer = None


class FxParallel(System):
    name = "fxparallel"
    label = "fxparallel.parallelize"

    def build(self, path, tp, dtype, device):
        import fxparallel

        t = time.perf_counter()
        self.model = fxparallel.parallelize(path, dist.group.WORLD, dtype=dtype, device=device)
        self.timings["ready"] = time.perf_counter() - t
        self.timings["capture+plan"] = self.model.timings["capture+plan+rewrite"]
        self.model.eval()  # dropout off (it applies in train()); the same mode for both systems

    def logits(self, ids):
        return self.model(input_ids=ids).logits  # complete: gathered when no labels are given

    def expected_collectives(self, tokens: int) -> dict:
        """What the plan says one training step sends: {phase: {kind: [calls, bytes]}}.

        Activation collectives scale with the tokens; a parameter-gradient all-reduce
        has a fixed size per call (``bytes_per_call``).
        """
        from fxparallel.inputs import FIELDS

        out = {}
        tp = self.model.tp_group.size
        if tp == 1:  # every collective is the identity
            return out
        for c in self.model.plan.collectives:
            calls_bytes = out.setdefault(c.direction, {}).setdefault(c.kind, [0, 0])
            calls_bytes[0] += c.count
            calls_bytes[1] += round(c.count * (c.bytes_per_token * tokens + c.bytes_per_call))
        check = out.setdefault("forward", {}).setdefault("all_gather", [0, 0])  # the arguments' check of the call:
        check[0] += 1  # each rank's fingerprint of FIELDS int64 numbers (fxparallel/inputs.py), not in the plan
        check[1] += FIELDS * 8 * tp
        return out


class TransformersTP(System):
    name = "transformers"
    label = 'transformers tp_plan="auto"'

    def build(self, path, tp, dtype, device):
        from transformers import AutoModelForCausalLM
        from transformers.distributed import DistributedConfig

        t = time.perf_counter()
        self.model = AutoModelForCausalLM.from_pretrained(path, distributed_config=DistributedConfig(tp_size=tp),
                                                          dtype=dtype)
        if tp == 1 and self.model.device.type != device.type:  # at TP=1 transformers leaves the model on the CPU
            self.model.to(device)
        self.timings["ready"] = time.perf_counter() - t
        self.timings["capture+plan"] = None  # a hand-written plan: nothing to capture or solve
        self.model.eval()  # dropout off, the same mode for both systems
        if self.model.device.type != device.type:
            raise RuntimeError(f"transformers placed the model on {self.model.device}, expected {device.type}")

    def logits(self, ids):
        logits = self.model(input_ids=ids).logits
        if hasattr(logits, "full_tensor"):  # a DTensor: make it a plain complete tensor
            logits = logits.full_tensor()
        return logits


SYSTEMS = {cls.name: cls for cls in (FxParallel, TransformersTP)}
