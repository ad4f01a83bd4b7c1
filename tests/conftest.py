"""Fixtures shared by the whole suite, and the suite's layout:

* ``tests/unit/`` and ``tests/rules/``: tests that start no process (fake groups, op rules, the solver, plan
  data, graph-cache files, runtime pieces); ``pytest tests/unit tests/rules`` runs them in about a minute.
  ``tests/rules/`` holds a rule-level test per rule family (``fxparallel/plan/rules/<family>.py``) and the
  sweep of every op the traits table knows (``test_rule_sweep.py``).
* ``tests/`` (top level): tests that start ranks (``distributed.run_ranks``) or other processes, or need a GPU,
  in files that may also hold a few single-process cases.
* Shared helpers: ``checks.py`` (comparisons with transformers, ``max_diff``, ``raised``, ...),
  ``distributed.py`` (``run_ranks``: a rank body must be a module-level function of an importable module),
  ``models.py`` (tiny checkpoints), ``hub.py``, ``fp8_checkpoints.py``, ``quantized_checkpoints.py``,
  ``rules/rule_graphs.py`` (rule tests). This folder is put on ``sys.path`` below, so every test module
  imports them by name, wherever it sits.
"""
import os
import sys
import tempfile

import pytest

sys.path.insert(0, os.path.dirname(__file__))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
# planned graphs are reused across the session's tests (and its spawned ranks), never across sessions
os.environ.setdefault("FXPARALLEL_GRAPH_CACHE", tempfile.mkdtemp(prefix="fxparallel-graphs-"))
# group rank 0 plans for its peers (graph_cache/first_rank.py): the suite's ranks share two cores, and capture is most
# of their work; test_first_rank_planning and test_graph_cache compare it with every rank planning alone
os.environ.setdefault("FXPARALLEL_PLANNING", "first")


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


# the slowest files first (seconds in a clean-clone run of 2026-12-01): the two workers (pyproject's -n 2 --dist
# loadfile) take whole files in collection order, and a long file taken last leaves one worker running alone at the end
SLOW_FIRST = ("test_experts_over_dp.py", "test_coverage.py", "test_router_logits.py", "test_generate_recurrent.py",
              "test_lora.py", "test_trainer_stack.py", "test_expert_parallel.py", "test_generation.py",
              "test_trainer_data_parallel.py", "test_generate_without_cache.py", "test_fsdp_units.py",
              "test_fused_checkpoint.py", "test_hf_methods.py")


def pytest_collection_modifyitems(items):
    order = {name: i for i, name in enumerate(SLOW_FIRST)}
    items.sort(key=lambda item: order.get(item.path.name, len(SLOW_FIRST)))  # stable: each file's own order kept
