"""Every script in examples/ runs as a user runs it (a fresh process, from another folder)
and prints what its docstring promises."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
EXPECT = {
    "quickstart.py": "under zero(stage=3, dp=4) on 4 devices",
    "custom_space.py": "MATCH with one device",
    "custom_schedule.py": "MATCH with one device",
    "wrap_train_step.py": "lies P(None, 'tp') on 8 devices",
    "multi_process.py": "2 processes, 8 devices; stage groups in processes [[0], [1]]",
    "own_model.py": "loss",
    "third_party_models.py": "equinox_lm: loss",
}


def test_every_example_is_listed():
    assert sorted(p.name for p in EXAMPLES.glob("*.py")) == sorted(EXPECT)


@pytest.mark.parametrize("name", sorted(EXPECT))
def test_example_runs(name, tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    proc = subprocess.run(
        [sys.executable, str(EXAMPLES / name)], cwd=tmp_path, env=env, capture_output=True,
        text=True, timeout=600, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert EXPECT[name] in proc.stdout, proc.stdout[-2000:]
