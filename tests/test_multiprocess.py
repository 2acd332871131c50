"""A pipeline whose stages live in different processes: ``jscaler launch`` starts two
processes of 4 CPU devices each, joined by jax.distributed on 127.0.0.1; stage 0 runs on
process 0's devices, stage 1 on process 1's, and the result matches one device."""

import subprocess
import sys

import pytest


@pytest.mark.parametrize(
    "plan, schedule",
    [("megatron(pp=2, dp=4)", "one_f_one_b"), ("megatron(tp=2, pp=2)", "zero_bubble")],
)
def test_two_processes_train_a_pipeline_equal_to_one_device(plan, schedule):
    cmd = [sys.executable, "-m", "jscaler.cli", "launch", "--nprocs", "2",
           "--devices-per-proc", "4", "--", "jscaler", "verify", "--model", "gpt-tiny",
           "--plan", plan, "--schedule", schedule]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, check=False)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "groups 0-3" in proc.stdout and "4-7" in proc.stdout
    assert "MATCH" in proc.stdout


def test_the_stacked_handoff_in_one_process(monkeypatch):
    """The multi-process update path (arrays assembled from the groups' shards, summed
    over the stacked pipe axis) run in one process: same numbers as one device."""
    import jscaler.runtime.pipeline as pipeline
    from schedules import interleaved_1f1b
    from spaces import megatron

    from test_pipeline import assert_pipeline_parity

    monkeypatch.setattr(pipeline, "_multi_process", lambda: True)
    trainer = assert_pipeline_parity("gpt-tiny", megatron(tp=2, pp=2), interleaved_1f1b, 4)
    assert type(trainer._handoff).__name__ == "Stacked"
    assert trainer._handoff.mesh.axis_names == ("pipe", "dp", "tp")


def test_a_launched_command_that_fails_reports_the_failure():
    cmd = [sys.executable, "-m", "jscaler.cli", "launch", "--nprocs", "2", "--",
           "jscaler", "verify", "--model", "no-such-model", "--plan", "dp"]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 2
    assert "no-such-model" in proc.stderr
