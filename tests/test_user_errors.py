"""Mistakes users make, and faults of their jobs, give a clear error (or none) instead of wrong numbers,
raw tracebacks or half-hour hangs: fake groups, groups this rank is not in, dtype spellings, configs
transformers refuses, the plan report's wording, packaging metadata, progress output, late ranks."""
from __future__ import annotations

import datetime
import io
import json
import logging
import os
import re
import sys
import time
import warnings

import pytest
import torch

import fxparallel
from distributed import run_ranks
from fxparallel.errors import ArgumentError, ConfigError, GroupError, RankTimeoutError
from fxparallel.group import fake_group, resolve_tp_group
from models import tiny_config

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# ---- 1. a fake group plans only --------------------------------------------------------------------------
def test_fake_group_is_refused_without_processes():
    assert not torch.distributed.is_initialized()
    with pytest.raises(GroupError, match=r"fake_group\(2\) and torch.distributed is not initialized: a fake group "
                                         r"plans only.*fxparallel.plan_model\(model, 2\)"):
        fxparallel.parallelize(tiny_config("llama"), fake_group(2))
    assert resolve_tp_group(fake_group(2), planning=True).size == 2  # what planning passes
    assert resolve_tp_group(fake_group(1)).size == 1  # one process: nothing to split, nothing wrong


def _fake_and_foreign_groups(rank, world_size):
    import torch.distributed as dist

    # 1. a fake group inside a real 2-process job: refused on every rank, whatever its size
    with pytest.raises(GroupError, match=rf"fake_group\(2\), but this process is rank {rank} of a 2-process job: a "
                                         r"fake group plans only.*pass the real ProcessGroup or 1-D DeviceMesh"):
        fxparallel.parallelize(tiny_config("llama"), fake_group(2))
    with pytest.raises(GroupError, match=r"fake_group\(1\).*a fake group plans only"):
        resolve_tp_group(fake_group(1))
    # 2. a group this rank is not in: new_group returns a placeholder (an int) on the ranks it leaves out
    only_rank_0 = dist.new_group(ranks=[0])
    if rank == 1:
        with pytest.raises(GroupError, match=r"rank 1 is not a member of tp_group \(ranks \[0\]\): "
                                             r"dist.new_group\(ranks=...\) returns a placeholder.*Call parallelize "
                                             r"only on ranks \[0\]"):
            fxparallel.parallelize(tiny_config("llama"), only_rank_0)
    else:
        assert resolve_tp_group(only_rank_0).size == 1
    return True


def test_fake_group_in_a_job_and_a_group_without_this_rank():
    assert run_ranks(2, _fake_and_foreign_groups, timeout=240) == [True, True]


# ---- 3. dtype as transformers takes it ------------------------------------------------------------------
def test_resolve_dtype_takes_what_transformers_takes():
    from fxparallel.load.dtype import resolve_dtype

    bf16_config = tiny_config("llama", dtype="bfloat16")
    for given, wanted in [("bfloat16", torch.bfloat16), ("torch.bfloat16", torch.bfloat16),
                          ("float16", torch.float16), ("half", torch.float16), ("float32", torch.float32),
                          (torch.bfloat16, torch.bfloat16), (torch.float64, torch.float64)]:
        assert resolve_dtype(given, config=bf16_config) == wanted, given
    assert resolve_dtype("auto", config=bf16_config) == torch.bfloat16  # the checkpoint's dtype
    assert resolve_dtype(None, config=bf16_config) == torch.bfloat16
    assert resolve_dtype("auto", config=tiny_config("llama")) == torch.float32  # the config names none
    with pytest.warns(FutureWarning, match=r"`torch_dtype` is deprecated! Use `dtype` instead!"):
        assert resolve_dtype(torch_dtype="float16") == torch.float16
    with pytest.warns(FutureWarning, match="torch_dtype"):
        assert resolve_dtype(torch_dtype="auto", config=bf16_config) == torch.bfloat16


def test_resolve_dtype_refuses_with_the_value_and_the_accepted_ones():
    from fxparallel.load.dtype import resolve_dtype

    with pytest.raises(ArgumentError, match=r"dtype='bf16' is not a dtype fxparallel knows: pass a floating-point "
                                            r"torch.dtype, 'auto', or one of 'float32', .*'bfloat16'"):
        resolve_dtype("bf16")
    with pytest.raises(ArgumentError, match=r"torch_dtype='fp8' is not a dtype"):
        with pytest.warns(FutureWarning):
            resolve_dtype(torch_dtype="fp8")
    with pytest.raises(ArgumentError, match=r"pass dtype= or its deprecated alias torch_dtype=, not both \(got "
                                            r"dtype='bfloat16', torch_dtype=torch.float16\)"):
        resolve_dtype("bfloat16", torch_dtype=torch.float16)
    with pytest.raises(ArgumentError, match=r"dtype=torch.int8 is not a floating-point dtype"):
        resolve_dtype(torch.int8)
    with pytest.raises(ArgumentError, match=r"dtype must be a torch.dtype or a string, got int 16"):
        resolve_dtype(16)
    with pytest.raises(ValueError):  # also a ValueError, as transformers raises for a bad dtype
        resolve_dtype("bf16")


# ---- 4. a config transformers refuses -------------------------------------------------------------------
def _bad_config(tmp_path, name, **changes):
    path = tmp_path / name
    tiny_config("llama").save_pretrained(str(path))
    data = json.loads((path / "config.json").read_text())
    data.update(changes)
    (path / "config.json").write_text(json.dumps(data))
    return str(path)


def test_config_that_fails_transformers_validation_names_field_and_model_type(tmp_path):
    from fxparallel.load import resolve_source

    heads = _bad_config(tmp_path, "heads", num_attention_heads=6)  # 64 hidden over 6 heads
    with pytest.raises(ConfigError, match=r"invalid config of '.*heads/config.json', model_type 'llama' "
                                          r"\(LlamaConfig\): config fields hidden_size, num_attention_heads: "
                                          r"ValueError: The hidden size \(64\) is not a multiple of the number of "
                                          r"attention heads \(6\)\. \(transformers' check validate_architecture\)"):
        resolve_source(heads)
    typed = _bad_config(tmp_path, "typed", hidden_size="64")
    with pytest.raises(ConfigError, match=r"model_type 'llama' \(LlamaConfig\): config field hidden_size: "
                                          r"TypeError: Field 'hidden_size' expected int, got str"):
        resolve_source(typed)
    layers = _bad_config(tmp_path, "layers", layer_types=["full_attention"] * 3)
    with pytest.raises(ConfigError, match=r"config fields layer_types, num_hidden_layers: .*must be equal to the "
                                          r"number of `layer_types` \(3\)"):
        resolve_source(layers)


def test_plan_cli_prints_one_line_for_an_invalid_config(tmp_path, capsys):
    from fxparallel.cli import main

    heads = _bad_config(tmp_path, "heads", num_attention_heads=6)
    assert main(["plan", heads, "--tp", "2"]) == 1
    err = capsys.readouterr().err
    assert "Traceback" not in err and err.count("\n") == 1, err
    assert re.match(r"fxparallel: error: invalid config of .*model_type 'llama' \(LlamaConfig\): config fields "
                    r"hidden_size, num_attention_heads: ", err), err


def test_cli_prints_any_library_error_on_one_line(monkeypatch, capsys):
    from fxparallel import cli
    from fxparallel.errors import CheckpointError

    def refuse(args):
        raise CheckpointError("the checkpoint does not match the model:\n  tensor 'a'\n  tensor 'b'")

    monkeypatch.setattr(cli, "_plan", refuse)
    assert cli.main(["plan", "x", "--tp", "2"]) == 1
    assert capsys.readouterr().err == ("fxparallel: error: the checkpoint does not match the model: tensor 'a' "
                                       "tensor 'b'\n")


# ---- 5. the plan report says what "<top>" was ------------------------------------------------------------
def test_plan_report_says_outside_any_submodule_not_top():
    from fxparallel.plan.plan import CollectivePlan, ShardingPlan

    plan = ShardingPlan("llama", 2, collectives=[
        CollectivePlan("all_reduce", "forward", "<top>", 4.0, 1),
        CollectivePlan("all_reduce", "backward", "gradient of the input of <top>, lm_head", 256.0, 1)],
        sequence_parallel=True, sequence_parallel_kept=["<top> .. lm_head: flip (not token-wise)"])
    text = str(plan)
    assert "<top>" not in text
    assert "1 x all_reduce            4.0 B/token  (top-level forward, outside any submodule)" in text
    assert "gradient of the input of (top-level forward, outside any submodule), lm_head" in text
    assert "  (top-level forward, outside any submodule) .. lm_head: flip" in text
    assert plan.collectives[0].where == "<top>"  # the data (JSON) keeps its name


def test_plan_report_names_the_attention_whose_kv_gradient_is_reduced():
    """With fewer kv heads than ranks, k and v are gathered whole and each rank slices its heads; their
    gradient is all-reduced in the backward pass. The slice is the rewrite's own op (no module), so the
    report named '(top-level forward, outside any submodule)'; it names the attention that consumes them."""
    import fxparallel
    from models import tiny_config

    plan, _ = fxparallel.plan_model(tiny_config("llama", num_key_value_heads=2), 4)
    text = str(plan)
    assert "top-level forward" not in text, text
    assert re.search(r"\n +4 x all_reduce +64\.0 B/token  gradient of the input of model\.layers\.\*\.self_attn\n",
                     text), text


# ---- 6. packaging metadata -------------------------------------------------------------------------------
def test_pyproject_license_is_an_spdx_string_without_deprecation_warning(monkeypatch):
    import tomllib

    from packaging.requirements import Requirement
    from setuptools import __version__ as setuptools_version
    from setuptools.config.pyprojecttoml import apply_configuration
    from setuptools.dist import Distribution

    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        data = tomllib.load(f)
    assert data["project"]["license"] == "Apache-2.0"
    (backend,) = [Requirement(r) for r in data["build-system"]["requires"] if r.startswith("setuptools")]
    assert not backend.specifier.contains("76.0") and backend.specifier.contains(setuptools_version)
    monkeypatch.chdir(ROOT)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        apply_configuration(Distribution(), os.path.join(ROOT, "pyproject.toml"))
    assert not [w for w in caught if "license" in str(w.message).lower()], [str(w.message) for w in caught]


# ---- 7. progress bars end their line in logs ---------------------------------------------------------------
class _Terminal(io.StringIO):
    def isatty(self):
        return True


def test_byte_bar_keeps_its_line_in_a_log_and_clears_it_on_a_terminal():
    from fxparallel.load.progress import byte_bar

    log_file, terminal = io.StringIO(), _Terminal()
    for stream in (log_file, terminal):
        bar = byte_bar("loading", 1000, file=stream)
        bar.update(1000)
        bar.close()
        stream.write("next log line\n")
    assert log_file.getvalue().splitlines()[-1] == "next log line"  # on its own line
    assert "100%" in log_file.getvalue().splitlines()[-2]
    assert terminal.getvalue().endswith("\rnext log line\n")  # the cleared bar's line is reused


def test_loader_log_line_is_not_glued_to_the_progress_bar(checkpoints, capsys, monkeypatch):
    from fxparallel.load import load_from_files, local_checkpoint
    from fxparallel.module import ParallelCausalLM

    plan, _ = fxparallel.plan_model(tiny_config("llama"), 2)
    module = ParallelCausalLM(tiny_config("llama"), plan, fake_group(2, 1), "cpu", torch.float32, None)
    logger = logging.getLogger("fxparallel")
    handler = logging.StreamHandler(sys.stderr)  # sys.stderr is capsys's stream now
    handler.setFormatter(logging.Formatter("%(levelname)s %(message)s"))
    logger.addHandler(handler)
    monkeypatch.setattr(logger, "level", logging.INFO)
    try:
        load_from_files(module, plan, local_checkpoint(checkpoints["llama"]), 1, 2)
    finally:
        logger.removeHandler(handler)
    err = capsys.readouterr().err
    assert "loading rank 1/2 shards" in err
    (line,) = [ln for ln in err.split("\n") if "INFO rank 1 read" in ln]
    assert line.startswith("INFO rank 1 read"), repr(line)


# ---- 8. a rank that does not arrive: bounded waits -------------------------------------------------------
AGREE_TIMEOUT = 3
LATE_BY = 9  # seconds rank 1 sleeps before its first agreement point of parallelize


def _late_rank(rank, world_size, checkpoint):
    import torch.distributed as dist

    from fxparallel.load import checkpoint_files as checkpoint_module
    from fxparallel.load import coordinate

    group = dist.group.WORLD
    dist.barrier()  # both ranks have imported everything: the waits below are the test's own
    # a rank that is slow but makes progress (downloading, reading) is waited for beyond the timeout
    beat = coordinate.heartbeat(group)
    if rank == 1:
        for _ in range(int(2 * AGREE_TIMEOUT / 0.25)):
            beat()
            time.sleep(0.25)
    assert coordinate.exchange(group, rank * 10, "a slow step with progress") == [0, 10]
    # ranks at different steps (one retried after an error): refused on both, not paired
    with pytest.raises(GroupError, match=r"different steps: rank 0 at step A; rank 1 at step B"):
        coordinate.exchange(group, None, "step A" if rank == 0 else "step B")
    dist.barrier()

    # rank 1 stuck (alive) before its first agreement point in parallelize
    entered = {}
    original_agree, original_local = checkpoint_module.agree, checkpoint_module.local_checkpoint

    def timed_agree(*args, **kwargs):
        entered.setdefault("t", time.monotonic())
        return original_agree(*args, **kwargs)

    def stuck(directory):
        time.sleep(LATE_BY)
        return original_local(directory)

    checkpoint_module.agree = timed_agree
    if rank == 1:
        checkpoint_module.local_checkpoint = stuck
    pattern = (rf"rank 0 waited \d+ s for rank 1 of the tensor-parallel group \(ranks \[0, 1\]\) at "
               rf"reading the checkpoint in {re.escape(checkpoint)}: it did not arrive within {AGREE_TIMEOUT} s "
               r"\(FXPARALLEL_AGREE_TIMEOUT\) and reported no progress")
    if rank == 1:
        pattern += r".*\(rank 1 is this process: it arrived after its peers had stopped waiting\)"
    with pytest.raises(RankTimeoutError, match=pattern):
        fxparallel.parallelize(checkpoint, group)
    waited = time.monotonic() - entered["t"]
    store = dist.distributed_c10d._get_default_store()  # rank 0 hosts it: keep it up until rank 1 is done
    if rank == 1:
        store.set("test/late-rank-done", "1")
    else:
        store.wait(["test/late-rank-done"], datetime.timedelta(seconds=120))
    return waited


def test_a_stuck_rank_is_named_on_every_rank_within_the_agreement_timeout(checkpoints, monkeypatch):
    monkeypatch.setenv("FXPARALLEL_AGREE_TIMEOUT", str(AGREE_TIMEOUT))
    waited_0, waited_1 = run_ranks(2, _late_rank, checkpoints["llama"], timeout=240)
    # no wall-clock window: rank 0 waited the agreement timeout (a lower bound, whatever the load), and stopped
    # before the late rank arrived (which rank 1's own message says: "it arrived after its peers had stopped
    # waiting"), so not the process group's 30 minutes; the late rank read the verdict instead of timing out
    assert waited_0 >= AGREE_TIMEOUT
    assert waited_1 < AGREE_TIMEOUT


def test_agree_timeout_setting(monkeypatch):
    from fxparallel.load.coordinate import DEFAULT_TIMEOUT, agree_timeout

    monkeypatch.delenv("FXPARALLEL_AGREE_TIMEOUT", raising=False)
    assert agree_timeout() == DEFAULT_TIMEOUT == 300
    monkeypatch.setenv("FXPARALLEL_AGREE_TIMEOUT", "2.5")
    assert agree_timeout() == 2.5
    for bad in ("soon", "0", "-1"):
        monkeypatch.setenv("FXPARALLEL_AGREE_TIMEOUT", bad)
        with pytest.raises(GroupError, match=rf"FXPARALLEL_AGREE_TIMEOUT='{bad}' must be a positive number of "
                                             r"seconds \(default 300\)"):
            agree_timeout()
