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
    "hf_gpt2.py": "wrote train.npy, eval.npy and hf-gpt2-init/",
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


def test_the_newcomers_path(tmp_path):
    """README's walk-through: own model file + a .npy of tokens + a TOML config -> jscaler
    train (progress bar, JSONL and TensorBoard, eval loss, checkpoint) -> jscaler export ->
    transformers loads the trained weights."""
    from jscaler.runtime.metrics_log import read_jsonl, read_scalars

    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}

    def run(*cmd):
        proc = subprocess.run(
            cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600, check=False
        )
        assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
        return proc

    jscaler = Path(sys.executable).with_name("jscaler")
    run(sys.executable, str(EXAMPLES / "hf_gpt2.py"))
    factory = f"{EXAMPLES / 'hf_gpt2.py'}:factory"  # the config's path is the repo root's
    train = run(
        str(jscaler), "train", "--config", str(EXAMPLES / "hf_gpt2.toml"), "--model", factory,
        "--steps", "6", "--warmup-steps", "2", "--eval-every", "3", "--log-every", "3",
    )  # fmt: skip
    out = train.stdout
    assert "init from hf-gpt2-init: 28 tensors (flax names)" in out
    assert "plan megatron(tp=2, dp=4)" in out and "eval loss" in out
    assert "train: 100%" in train.stderr  # the progress bar
    first, last = (float(x) for x in out.split("\nloss ")[1].split(" in ")[0].split(" -> "))
    assert last < first
    rows = read_jsonl(tmp_path / "runs" / "hf-gpt2")
    assert [r["step"] for r in rows] == [3, 6] and "eval_loss" in rows[-1]
    assert [s for s, _ in read_scalars(tmp_path / "runs" / "hf-gpt2")["loss"]] == [3, 6]
    assert (tmp_path / "ckpt" / "hf-gpt2" / "6").is_dir()
    export = run(
        str(jscaler), "export", "--checkpoint-dir", "ckpt/hf-gpt2", "--out", "hf-gpt2-trained"
    )
    assert "exported step 6 of ckpt/hf-gpt2: 28 tensors" in export.stdout
    check = (
        "import numpy as np, transformers as t\n"
        "from flax.traverse_util import flatten_dict\n"
        "from jscaler.runtime.checkpoint import read_params\n"
        "m = t.FlaxGPT2LMHeadModel.from_pretrained('hf-gpt2-trained')\n"
        "_, p = read_params('ckpt/hf-gpt2')\n"
        "got = {'/'.join(k): np.asarray(v) for k, v in flatten_dict(m.params).items()}\n"
        "assert set(got) == set(p) and all((got[k] == p[k]).all() for k in p)\n"
        "print('transformers loaded the trained weights')\n"
    )
    assert "transformers loaded the trained weights" in run(sys.executable, "-c", check).stdout
