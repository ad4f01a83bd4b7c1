"""The plan report CLI: `fxparallel plan MODEL --tp N`, in-process and once as a subprocess."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest
import torch

import fxparallel
from fxparallel.cli import main
from models import tiny_config

LAYERS = 2  # tiny_config's depth


@pytest.fixture(scope="module")
def config_dir(tmp_path_factory):
    """A config-only directory (no weights): all the CLI needs."""
    path = tmp_path_factory.mktemp("cli") / "tiny-llama"
    tiny_config("llama").save_pretrained(str(path))
    return str(path)


def test_plan_prints_placements_and_collectives_and_json_round_trips(config_dir, tmp_path, capsys):
    out_json = tmp_path / "plan.json"
    assert main(["plan", config_dir, "--tp", "2", "--json", str(out_json)]) == 0
    out = capsys.readouterr().out
    expected, _ = fxparallel.plan_model(config_dir, 2)
    assert out.strip() == str(expected).strip()
    # placements, grouped by layer pattern
    for row in ("model.layers.*.self_attn.q_proj.weight          x2  64x64   S(0)       column-parallel linear",
                "model.layers.*.self_attn.o_proj.weight          x2  64x64   S(1)       row-parallel linear",
                "model.embed_tokens.weight                           128x64  S(0)       vocab-parallel embedding"):
        assert row in out
    # collective counts: Megatron's 2L+1 each way plus the loss statistics gather
    assert f"forward: {2 * LAYERS + 2} calls" in out and f"backward: {2 * LAYERS + 1} calls" in out
    assert "1 x all_gather" in out and "parameter memory per rank" in out
    again = fxparallel.ShardingPlan.load(out_json)
    assert again == expected
    assert again.count("all_reduce", "backward") == 2 * LAYERS + 1


def test_config_file_path_layers_and_dtype_overrides(config_dir, tmp_path, capsys):
    out_json = tmp_path / "plan.json"
    args = ["plan", os.path.join(config_dir, "config.json"), "--tp", "4", "--layers", "3", "--dtype", "bfloat16",
            "--json", str(out_json)]
    assert main(args) == 0
    assert "x3" in capsys.readouterr().out
    plan = fxparallel.ShardingPlan.load(out_json)
    assert (plan.tp, plan.dtype) == (4, "bfloat16")
    assert plan.count("all_reduce", "forward") == plan.count("all_reduce", "backward") == 2 * 3 + 1
    assert str(plan.param("model.layers.2.mlp.down_proj.weight").placement) == "S(1)"
    expected, _ = fxparallel.plan_model(tiny_config("llama", num_hidden_layers=3), 4, dtype=torch.bfloat16)
    assert plan == expected


def test_sp_prints_the_sequence_parallel_plan(config_dir, capsys):
    assert main(["plan", config_dir, "--tp", "2", "--sp"]) == 0
    out = capsys.readouterr().out
    expected, _ = fxparallel.plan_model(config_dir, 2, sequence_parallel=True)
    assert out.strip() == str(expected).strip()
    assert out.startswith("fxparallel plan: llama, tp=2, float32, sequence parallel")
    # the all-reduces of plain TP become reduce-scatters and all-gathers along the sequence
    assert f"{LAYERS} x reduce_scatter      256.0 B/token  model.layers.*.mlp.down_proj" in out
    assert expected.count("reduce_scatter", "forward") == expected.count("all_gather", "backward") == 2 * LAYERS + 1
    assert expected.count("all_reduce", "forward") == 0
    assert "gradient all-reduced (used on sequence shards)" in out and "ring:" in out


@pytest.mark.parametrize("args, message", [
    (["--tp", "16"], r"tp size 16 is larger than num_attention_heads=8"),
    (["--tp", "16", "--sp"], r"tp size 16 is larger than num_attention_heads=8"),
])
def test_bad_input_gives_the_library_message_and_exit_code(config_dir, capsys, args, message):
    code = main(["plan", config_dir] + args)
    err = capsys.readouterr().err
    assert code == 1
    assert err.startswith("fxparallel: error: ")
    assert "Traceback" not in err
    assert re.search(message, err), err


def test_unknown_and_non_causal_models_exit_1(tmp_path, capsys):
    vit = tmp_path / "vit"
    vit.mkdir()
    (vit / "config.json").write_text(json.dumps({"model_type": "vit"}))
    assert main(["plan", str(vit), "--tp", "2"]) == 1
    assert "is not a causal language model" in capsys.readouterr().err
    missing = tmp_path / "does-not-exist"
    assert main(["plan", str(missing), "--tp", "2"]) == 1
    assert str(missing) in capsys.readouterr().err


def test_bad_command_line_exits_2(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["plan", "x", "--tp", "0"])
    assert exc.value.code == 2
    assert "expected a positive integer, got 0" in capsys.readouterr().err
    assert main([]) == 2


def test_python_dash_m_subprocess(config_dir):
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    proc = subprocess.run([sys.executable, "-m", "fxparallel", "plan", config_dir, "--tp", "2"], env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("fxparallel plan: llama, tp=2, float32")
    assert "model.layers.*.mlp.down_proj.weight" in proc.stdout and "S(1)" in proc.stdout
    assert f"forward: {2 * LAYERS + 2} calls" in proc.stdout


def test_ep_prints_whole_experts_per_rank(tmp_path, capsys):
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), os.pardir, "benchmarks"))
    from tiny_configs import tiny_config as any_tiny_config  # (every model type)

    config_dir = str(tmp_path / "mixtral")
    any_tiny_config("mixtral").save_pretrained(config_dir)
    assert main(["plan", config_dir, "--tp", "2", "--ep"]) == 0
    out = capsys.readouterr().out
    expected, _ = fxparallel.plan_model(config_dir, 2, expert_parallel=True)
    assert out.strip() == str(expected).strip()
    assert "model.layers.*.mlp.experts.gate_up_proj" in out and "expert parallel: whole experts per rank" in out
    assert "experts: whole experts per rank (expert_parallel=True)" in out
    # without --ep the planner chooses (grouped_mm: the experts kernel of a plan without a device); --no-ep splits
    assert main(["plan", config_dir, "--tp", "2"]) == 0
    out = capsys.readouterr().out
    assert "experts: whole experts per rank (chosen: transformers' grouped_mm kernel" in out
    assert main(["plan", config_dir, "--tp", "2", "--no-ep"]) == 0
    out = capsys.readouterr().out
    assert "experts: every expert split inside (like a dense MLP) (expert_parallel=False)" in out
    assert "expert parallel: whole experts per rank" not in out
    few = str(tmp_path / "two-experts")
    any_tiny_config("mixtral", num_experts=2).save_pretrained(few)
    assert main(["plan", few, "--tp", "4", "--ep"]) == 1  # refused, one line
    assert "has 2 experts in a layer, fewer than the tp size 4" in capsys.readouterr().err
