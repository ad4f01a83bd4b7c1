import os
import sys
import tempfile

import pytest

sys.path.insert(0, os.path.dirname(__file__))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
# planned graphs are reused across the session's tests (and its spawned ranks), never across sessions
os.environ.setdefault("FXPARALLEL_GRAPH_CACHE", tempfile.mkdtemp(prefix="fxparallel-graphs-"))


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory):
    """Tiny checkpoints of each family, built once per session."""
    from models import save_checkpoint, tiny_config

    root = tmp_path_factory.mktemp("checkpoints")
    return {
        "llama": save_checkpoint(tiny_config("llama"), str(root / "llama")),
        "mistral": save_checkpoint(tiny_config("mistral"), str(root / "mistral")),
        "qwen2": save_checkpoint(tiny_config("qwen2"), str(root / "qwen2")),
        "qwen3-tied": save_checkpoint(tiny_config("qwen3", tie_word_embeddings=True), str(root / "qwen3-tied")),
        "llama-sharded": save_checkpoint(tiny_config("llama"), str(root / "llama-sharded"), max_shard_size="20KB"),
    }
