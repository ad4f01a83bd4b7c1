"""A LoRA adapter written as PEFT writes it: ``adapter_config.json`` (the LoraConfig, with the base model
it was loaded on) and ``adapter_model.safetensors`` under PEFT's stored names, so that
``PeftModel.from_pretrained(base, directory)`` loads it on one device (the writer only)."""
from __future__ import annotations

import os

from ..load.adapter_files import WEIGHTS, stored_name


def write_adapter(name: str, config, state: dict, directory: str) -> None:
    """The adapter ``name`` of LoraConfig ``config``; ``state``: {parameter name: full tensor} of its matrices
    (gathered to the writer)."""
    from safetensors.torch import save_file

    os.makedirs(directory, exist_ok=True)
    save_file({stored_name(n, name): t.contiguous() for n, t in state.items()},
              os.path.join(directory, WEIGHTS), metadata={"format": "pt"})
    config.save_pretrained(directory)
