"""Imported by the fork server (``distributed.PRELOAD``): one capture of a tiny model, so that every rank forked
from it starts with Dynamo's first-use work done (its lazy imports and tables: 1-3 s of CPU on this machine)
rather than paying it again in each rank's first ``parallelize``."""
import torch
import torch._dynamo

from fxparallel.api import capture_model, training_spec
from fxparallel.capture.meta_model import build_meta_model
from models import tiny_config

capture_model(build_meta_model(tiny_config("llama"), dtype=torch.float32), training_spec(None))
torch._dynamo.reset()  # its compiled code is not wanted; the warmed state is
