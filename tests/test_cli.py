"""The ``jscaler`` command, run as a user runs it: in a fresh process."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

JSCALER = Path(sys.executable).with_name("jscaler")


def run(*args, check=True):
    cmd = [str(JSCALER)] if JSCALER.exists() else [sys.executable, "-m", "jscaler.cli"]
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    proc = subprocess.run(
        [*cmd, *args], capture_output=True, text=True, env=env, timeout=300, check=False
    )
    if check:
        assert proc.returncode == 0, proc.stderr
    return proc


def test_console_script_is_installed():
    assert JSCALER.exists(), "pip install -e . should install the `jscaler` console script"


def test_inspect_gpt_tiny_prints_the_table_with_module_paths():
    out = run("inspect", "--model", "gpt-tiny").stdout
    assert "module path" in out and "annotation" in out
    assert "blocks/0/attn/q_proj" in out and "dot_general" in out
    assert "coverage: 100.0% of ops, 100.0% of FLOPs annotated" in out
    assert "repeated layers: blocks/0, blocks/1, blocks/2, blocks/3" in out


@pytest.mark.parametrize("model", ["convnet-tiny", "mlp-tiny"])
def test_inspect_json_for_other_model_kinds(model):
    data = json.loads(run("inspect", "--model", model, "--json").stdout)
    assert data["coverage"] == {"ops": 1.0, "flops": 1.0}
    assert any(o["primitive"] == "dot_general" for o in data["ops"])


def test_inspect_select_and_a_paper_scale_config_without_allocating():
    out = run("inspect", "--model", "llama-7b", "--select", "blocks/0/mlp/*").stdout
    assert "blocks/0/mlp/gate_proj" in out and "blocks/1/" not in out.split("\n\n")[0]
    assert "params: 6,7" in out  # ~6.7B parameters, from shapes only


def test_unknown_model_is_a_clear_error():
    proc = run("inspect", "--model", "gpt-huge", check=False)
    assert proc.returncode == 2
    assert "unknown model 'gpt-huge'" in proc.stderr and "gpt-tiny" in proc.stderr
