"""``jscaler train`` checkpoints, resume, NaN stop and profiling; ``jscaler profile``;
``--json`` and ``--help`` of every command."""

import json
import re

import pytest
from test_cli import run

COMMANDS = ["inspect", "train", "verify", "plan", "launch", "bench", "viz", "profile"]


def losses(out: str) -> dict[int, float]:
    return {int(s): float(v) for s, v in re.findall(r"step (\d+): loss ([\d.]+)", out)}


def test_resumed_run_continues_the_uninterrupted_loss_trajectory(tmp_path):
    args = ["train", "--model", "gpt-tiny", "--plan", "megatron(tp=2, dp=4)", "--log-every", "1"]
    whole = losses(run(*args, "--steps", "5").stdout)
    ck = str(tmp_path / "ck")
    first = run(*args, "--steps", "3", "--checkpoint-dir", ck, "--checkpoint-every", "2")
    assert sorted(p.name for p in (tmp_path / "ck").iterdir()) == ["2", "3"]
    # resumed under another plan on fewer devices: the arrays reshard on restore
    resumed = run(
        "train", "--model", "gpt-tiny", "--plan", "zero(stage=3)", "--devices", "4",
        "--log-every", "1", "--steps", "5", "--checkpoint-dir", ck, "--resume",
    ).stdout  # fmt: skip
    assert f"resumed from {ck}/3 (step 3)" in resumed
    got = losses(first.stdout) | losses(resumed)
    assert sorted(got) == [1, 2, 3, 4, 5]
    for step, loss in whole.items():  # printed to 4 decimals
        assert got[step] == pytest.approx(loss, abs=2e-4), (step, got, whole)
    assert "steady state:" in resumed and "tokens/s" in resumed and "MFU" in resumed
    assert sorted(p.name for p in (tmp_path / "ck").iterdir()) == ["2", "3", "5"]


def test_a_nan_loss_stops_with_the_step_and_keeps_the_last_good_checkpoint(tmp_path):
    ck = str(tmp_path / "ck")
    proc = run(
        "train", "--model", "mlp-tiny", "--steps", "4", "--lr", "1e30", "--checkpoint-dir", ck,
        "--checkpoint-every", "1", check=False,
    )  # fmt: skip
    assert proc.returncode == 2, proc.stderr
    assert "step 2: the loss is inf" in proc.stderr
    assert f"last good checkpoint: {ck}/1" in proc.stderr
    assert [p.name for p in (tmp_path / "ck").iterdir()] == ["1"]
    again = run("train", "--model", "mlp-tiny", "--steps", "1", "--checkpoint-dir", ck,
                check=False)  # fmt: skip
    assert again.returncode == 2 and "already holds step 1; add --resume" in again.stderr
    done = run("train", "--model", "mlp-tiny", "--steps", "1", "--checkpoint-dir", ck, "--resume")
    assert "nothing to do: the checkpoint is at step 1" in done.stdout


def test_a_nan_update_from_a_finite_loss_stops_before_anything_is_saved(tmp_path):
    ck = str(tmp_path / "ck")
    proc = run(
        "train", "--model", "mlp-tiny", "--steps", "3", "--lr", "nan", "--checkpoint-dir", ck,
        "--checkpoint-every", "1", check=False,
    )  # fmt: skip
    assert proc.returncode == 2, proc.stderr
    assert "step 1: the update is not finite" in proc.stderr
    assert "last good checkpoint: none written" in proc.stderr
    assert not (tmp_path / "ck").exists() or not list((tmp_path / "ck").iterdir())


@pytest.mark.parametrize("where", ["a file", "under a file"])
def test_an_unusable_checkpoint_directory_stops_the_run_before_any_training(tmp_path, where):
    """It was checked at the first save: the whole run trained, then died with a raw
    OSError or FileExistsError and the work was lost."""
    (tmp_path / "f").write_text("not a folder")
    ck = tmp_path / "f" if where == "a file" else tmp_path / "f" / "ck"
    proc = run(
        "train", "--model", "mlp-tiny", "--steps", "3", "--checkpoint-dir", str(ck), check=False
    )
    assert proc.returncode == 2, proc.stderr
    assert str(ck) in proc.stderr and "jscaler train: error:" in proc.stderr
    assert ("is a file" if where == "a file" else "Not a directory") in proc.stderr
    assert "loss" not in proc.stdout  # nothing trained


def test_train_profile_and_the_profile_command(tmp_path):
    trace = tmp_path / "trace"
    out = run("train", "--model", "mlp-tiny", "--steps", "3", "--profile", str(trace)).stdout
    assert f"profile: {trace}" in out and "samples/s" in out
    assert list(trace.rglob("*.xplane.pb"))
    proc = run("profile", "--model", "gpt-tiny", "--plan", "megatron(tp=2, dp=4)", "--steps",
               "2", "--out", str(tmp_path / "p"), "--json")  # fmt: skip
    row = json.loads(proc.stdout)
    assert row["step_ms"] > 0 and row["predicted_step_ms"] > 0 and 0 < row["mfu"] < 1
    assert row["traced_step_ms"] > 0  # the steps under the profiler, timed apart
    assert row["memory_mib"] > 0 and row["comm_mb"] > 0 and row["tokens_per_s"] > 0
    events = json.loads((tmp_path / "p" / "timeline.json").read_text())["traceEvents"]
    assert any(e.get("cat") == "comm" for e in events)
    assert list((tmp_path / "p" / "trace").rglob("*.xplane.pb"))


def test_verify_json():
    proc = run("verify", "--model", "mlp-tiny", "--plan", "dp", "--json")
    out = json.loads(proc.stdout)
    assert out["match"] is True and len(out["steps"]) == 3
    assert out["max_abs_diff"]["grad"] < out["tolerance"]["atol"]["grad"]


@pytest.mark.parametrize("command", COMMANDS)
def test_every_command_explains_its_options(command):
    out = run(command, "--help").stdout
    assert out.startswith(f"usage: jscaler {command}")
    options = re.findall(r"^  (--[\w-]+)", out, flags=re.M)
    assert options, out
    for opt in options:  # every option has a help text on its line or the next
        assert re.search(rf"^  {opt}[^\n]*\S[^\n]*\n|^  {opt}.*\n {{10,}}\S", out, re.M), opt


@pytest.mark.parametrize("background", [False, True], ids=["sync", "async"])
def test_keep_checkpoints_deletes_all_but_the_newest_and_the_save_time_is_reported(
    tmp_path, background
):
    ck = tmp_path / "ck"
    proc = run(
        "train", "--model", "mlp-tiny", "--steps", "6", "--checkpoint-dir", str(ck),
        "--checkpoint-every", "2", "--keep-checkpoints", "2",
        *(["--async-checkpoints"] if background else []),
    )  # fmt: skip
    assert sorted(p.name for p in ck.iterdir()) == ["4", "6"]
    assert re.search(r"checkpoint: .*/6 \(3 saves, [\d.]+ s, \d+% of the run's", proc.stdout)
