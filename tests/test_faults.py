"""Faults a long run meets, each injected for real: a save killed with SIGKILL at several
points, flipped bytes in a saved array file, a read-only and a full disk (small tmpfs
mounts when the tests run as root, a refused write otherwise), and a process of a
multi-process run that dies or falls silent, with and without ``jscaler launch``.

What must hold: nothing is lost (the newest complete step restores and the run goes on
exactly as an uninterrupted one), nothing wrong is restored silently, and every failure
ends in one jscaler error that names what went wrong, in bounded time."""

import contextlib
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

import numpy as np
import optax
import pytest
from test_checkpoint import array_files, host, mlp_batch, saved_mlp_steps
from test_cli import run
from test_multiprocess import WORKER, finish, start_workers

import jscaler
import models
from jscaler.runtime import checkpoint

ROOT = Path(__file__).parents[1]


def mlp_trainer():
    spec = models.get("mlp-tiny")
    return jscaler.parallelize(spec.init(0), spec.loss, optax.sgd(0.1), mlp_batch(0), devices=8)


# ---- kill -9 during a save ----------------------------------------------------------------

# Trains mlp-tiny (SGD, dp over 8 devices) saving after every step; during the save of
# step 3 it kills itself with SIGKILL at the point named by argv[2].
KILLED = """
import os, signal, sys
from jscaler.setup import enable_compilation_cache, use_cpu_devices
use_cpu_devices(8)
enable_compilation_cache()
import optax, orbax.checkpoint as ocp
import jscaler, models

def die(*args, **kwargs):
    os.kill(os.getpid(), signal.SIGKILL)

async def die_async(*args, **kwargs):
    die()

spec = models.get("mlp-tiny")
trainer = jscaler.parallelize(spec.init(0), spec.loss, optax.sgd(0.1), spec.batch(16, 0),
                              devices=8)
for step in range(5):
    print("loss", step + 1, float(trainer.step(spec.batch(16, step))["loss"]), flush=True)
    if trainer.step_count == 3:
        point = sys.argv[2]
        if point == "arrays":  # as the array data starts to be written
            ocp.StandardCheckpointHandler.async_save = die_async
        elif point == "metadata":  # arrays written, jscaler's metadata not yet
            ocp.JsonCheckpointHandler.async_save = die_async
        elif point == "rename":  # everything written, not yet renamed to its step
            ocp.CompositeCheckpointHandler.finalize = die
    trainer.save(sys.argv[1])
    if trainer.step_count == 3 and sys.argv[2] == "after":  # complete on disk
        die()
"""


@pytest.fixture(scope="module")
def uninterrupted():
    """mlp-tiny's parameters after each of 5 SGD steps, and each step's loss."""
    trainer, params, losses = mlp_trainer(), {}, {}
    for step in range(5):
        losses[step + 1] = float(trainer.step(mlp_batch(step))["loss"])
        params[step + 1] = host(trainer.params)
    return params, losses


@pytest.mark.parametrize("point", ["arrays", "metadata", "rename", "after"])
def test_a_save_killed_at_any_point_resumes_from_the_newest_complete_step(
    tmp_path, point, uninterrupted
):
    params, losses = uninterrupted
    done = subprocess.run([sys.executable, "-c", KILLED, str(tmp_path), point], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)  # fmt: skip
    assert done.returncode == -signal.SIGKILL, done.stderr[-3000:]
    said = dict(re.findall(r"loss (\d) ([\d.e-]+)", done.stdout))
    assert {int(k): float(v) for k, v in said.items()} == {k: losses[k] for k in (1, 2, 3)}
    complete = 3 if point == "after" else 2
    steps = sorted(p.name for p in tmp_path.iterdir() if p.name.isdigit())
    assert steps == [str(s) for s in range(1, complete + 1)]
    leftovers = [p.name for p in tmp_path.iterdir() if not p.name.isdigit()]
    assert all(name.startswith("3.orbax-checkpoint-tmp") for name in leftovers), leftovers

    trainer = mlp_trainer()
    with warnings_allowed(leftovers):
        assert trainer.restore(tmp_path) == complete
    for x, y in zip(host(trainer.params), params[complete]):
        np.testing.assert_array_equal(x, y)
    for step in range(complete, 5):  # resumed: the uninterrupted run's losses, bit for bit
        assert float(trainer.step(mlp_batch(step))["loss"]) == losses[step + 1]
        trainer.save(tmp_path)  # the leftover temporary folder is no obstacle
    for x, y in zip(host(trainer.params), params[5]):
        np.testing.assert_array_equal(x, y)
    assert sorted(int(p.name) for p in tmp_path.iterdir() if p.name.isdigit()) == [1, 2, 3, 4, 5]


def warnings_allowed(leftovers):
    """A leftover temporary folder is reported by restore (a warning naming it)."""
    if not leftovers:
        return contextlib.nullcontext()
    return pytest.warns(UserWarning, match=re.escape(leftovers[0]))


# ---- flipped bytes ------------------------------------------------------------------------


# tensorstore's reads still in flight when a damaged one fails call back into a closed loop
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
def test_flipped_bytes_are_caught_or_harmless_never_restored_silently(tmp_path):
    """One byte flipped in every array file of the newest step, at each of 8 offsets in
    turn. The arrays are stored compressed, so a flip may land in index data (unreadable),
    in the data (a checksum differs) or in bytes nothing reads; whichever, restore either
    skips the step with a warning and restores the older one exactly, or restores the
    newest exactly: never other values."""
    saved = saved_mlp_steps(tmp_path, 2)
    files = array_files(tmp_path / "2")
    originals = {f: f.read_bytes() for f in files}
    outcomes = []
    for fraction in np.linspace(0.05, 0.95, 8):
        for f, data in originals.items():
            at = int(len(data) * fraction)
            f.write_bytes(data[:at] + bytes([data[at] ^ 0xFF]) + data[at + 1 :])
        trainer = mlp_trainer()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            step = trainer.restore(tmp_path)
        said = " | ".join(str(w.message) for w in caught)
        if step == 1:
            assert "2" in said and ("damaged on disk" in said or "cannot be read" in said), said
        for x, y in zip(host(trainer.params), saved[step]):
            np.testing.assert_array_equal(x, y)
        outcomes.append(step)
    for f, data in originals.items():
        f.write_bytes(data)
    print(f"flipped bytes: restored steps {outcomes} (1: step 2 skipped)")
    assert outcomes.count(1) >= 4, f"most flips must be caught: restored steps {outcomes}"


# ---- read-only and full disks ---------------------------------------------------------------


@contextlib.contextmanager
def small_disk(size: str, read_only: bool = False):
    """A tmpfs of ``size`` (mounted read-only if asked), when the tests may mount (root
    with CAP_SYS_ADMIN: CI and this project's machines). Otherwise a read-only one is a
    folder without write permission (which only root ignores), and a small one skips."""
    where = Path(tempfile.mkdtemp())
    opts = f"size={size}" + (",ro" if read_only else "")
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", opts, "tmpfs", str(where)],
                             capture_output=True, check=False)  # fmt: skip
    if mounted.returncode != 0:
        if read_only and os.geteuid() != 0:  # without root, permissions refuse the writes
            where.chmod(0o555)
            try:
                yield where
            finally:
                where.chmod(0o755)
                where.rmdir()
            return
        where.rmdir()
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.decode().strip()}")
    try:
        yield where
    finally:
        subprocess.run(["umount", str(where)], check=False)
        where.rmdir()


def test_a_read_only_checkpoint_directory_stops_the_run_before_any_training():
    with small_disk("1m", read_only=True) as disk:
        proc = run("train", "--model", "mlp-tiny", "--steps", "3", "--checkpoint-dir",
                   str(disk / "ck"), check=False)  # fmt: skip
    assert proc.returncode == 2, proc.stderr
    why = ("Read-only file system", "Permission denied")  # a mount, or a folder's mode
    assert any(w in proc.stderr for w in why) and str(disk / "ck") in proc.stderr
    assert "loss" not in proc.stdout and "step/s" not in proc.stderr  # nothing trained


def test_a_full_disk_stops_the_run_at_the_save_that_does_not_fit(tmp_path):
    """Room for one checkpoint by the estimate at the start; later saves fill the disk.
    The save that does not fit is refused before it writes (exit 2, one message naming
    its step); a resume on that disk is refused before training; the earlier steps,
    copied to a disk with room, resume."""
    with small_disk("1300k") as disk:
        ck = disk / "ck"
        args = ["train", "--model", "mlp-tiny", "--checkpoint-every", "1", "--devices", "2"]
        proc = run(*args, "--steps", "30", "--checkpoint-dir", str(ck), check=False)
        assert proc.returncode == 2, proc.stderr
        (line,) = [s for s in proc.stderr.splitlines() if "error:" in s]
        stopped = int(re.search(r"cannot save step (\d+)", line)[1])
        assert "MB free and one checkpoint needs about" in line
        assert "Traceback" not in proc.stderr and len(proc.stderr.splitlines()) < 10
        steps = sorted(int(p.name) for p in ck.iterdir())
        assert steps == list(range(1, stopped)) and stopped > 1
        again = run(*args, "--steps", "30", "--checkpoint-dir", str(ck), "--resume", check=False)
        assert again.returncode == 2 and "MB free" in again.stderr, again.stderr
        assert "step/s" not in again.stderr  # refused before training
        shutil.copytree(ck, tmp_path / "ck")
    resumed = run(*args, "--steps", str(stopped), "--checkpoint-dir", str(tmp_path / "ck"),
                  "--resume")  # fmt: skip
    assert f"(step {stopped - 1})" in resumed.stdout, resumed.stdout


# tensorstore's writes still in flight when one fails call back into a closed loop
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
def test_a_write_that_fails_midway_names_its_step_and_leaves_the_others(monkeypatch, capfd):
    """The free-space estimate says yes (forced here), the disk then fills mid-write:
    one CheckpointError naming the step, the partial folder removed, no tracebacks from
    orbax's or tensorstore's threads, earlier steps intact."""
    monkeypatch.setattr(checkpoint, "disk_bytes", lambda tree: 0)
    # a save of mlp-tiny takes ~136 KiB of tmpfs pages (16 files); 200k left one save a
    # 64 KiB margin, which a loaded CI machine once overran (the first save failed, so
    # nothing was left to restore): room for two saves and a half, the disk fills by ~4
    with small_disk("450k") as disk:
        trainer = mlp_trainer()
        failed = None
        for step in range(20):
            trainer.step(mlp_batch(step))
            try:
                trainer.save(disk)
            except jscaler.CheckpointError as e:
                failed = (trainer.step_count, str(e))
                break
        assert failed is not None, "the disk never filled"
        step, message = failed
        assert step >= 3, f"only {step - 1} save(s) fit before the disk filled: {message}"
        assert f"cannot save step {step}" in message and "No space left on device" in message
        assert sorted(int(p.name) for p in disk.iterdir()) == list(range(1, step))
        err = capfd.readouterr().err
        assert "Traceback" not in err and len(err.splitlines()) < 6, err[-3000:]
        again = mlp_trainer()
        assert again.restore(disk) == step - 1


# ---- a process that dies or falls silent ------------------------------------------------------

PLANS = {"dp": "", "pipeline": "megatron(pp=2, dp=2)"}


@pytest.mark.parametrize(
    "mode, plan, timeout",
    [
        ("die", "dp", None),  # jscaler's defaults: a 20 s peer watch
        ("die", "pipeline", "8"),
        ("die0", "dp", "8"),  # the process that started the coordination service
        pytest.param("hang", "dp", "8", marks=pytest.mark.slow),  # stopped, connections open
    ],
)
def test_without_the_launcher_a_survivor_names_the_process_that_went_away(
    monkeypatch, mode, plan, timeout
):
    """Two processes started as SLURM would (no launcher); one is killed (or stopped)
    after its first step. The other exits with status 2 within 60 s of it, with one
    DistributedError naming the process, its pid and host; no SIGABRT, no C++ trace."""
    monkeypatch.setenv("JSCALER_TEST_PLAN", PLANS[plan])
    if timeout is None:
        monkeypatch.delenv("JSCALER_PEER_TIMEOUT", raising=False)
    else:
        monkeypatch.setenv("JSCALER_PEER_TIMEOUT", timeout)
    victim = 0 if mode == "die0" else 1
    procs = start_workers(mode)
    try:
        deadline = time.monotonic() + 240
        while procs[victim][0].poll() is None and not stopped(procs[victim][0]):
            if time.monotonic() > deadline:
                pytest.fail(f"the victim never reached its first step in 240 s\n{_logs(procs)}")
            time.sleep(0.1)
        gone = time.monotonic()
        status, out = finish(*procs[1 - victim], timeout=90)
        took = time.monotonic() - gone
    finally:
        for proc, _ in procs:
            proc.kill()
            proc.wait()
    pid = procs[victim][0].pid
    assert status == 2, out[-3000:]
    assert took < 60, f"{took:.1f} s"
    assert f"process {victim} (pid {pid} on " in out and "went away" in out, out[-3000:]
    assert "jscaler: error:" in out and "Check failure stack trace" not in out
    print(f"{mode} under {plan}: the survivor exited {took:.1f} s after process {victim}")


def test_a_peer_ended_by_an_uncaught_error_is_named_not_waited_for(monkeypatch):
    """Process 0 of a pipeline across two processes cannot serve cross-process copies
    (its transfer port is taken: jax raises at its first copy, an error jscaler does not
    catch). Process 1, waiting for that copy, used to wait forever (the CI hang of
    [die-pipeline-8]); now it exits with status 2, naming process 0 and its error."""
    monkeypatch.setenv("JSCALER_TEST_PLAN", PLANS["pipeline"])
    monkeypatch.setenv("JSCALER_PEER_TIMEOUT", "20")
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        procs = start_workers("agree", steps=2, transfer_ports={0: taken.getsockname()[1]})
        try:
            s1, out1 = finish(*procs[1], timeout=240)
            s0, out0 = finish(*procs[0], timeout=60)  # process 0 waits for the others
        finally:
            for proc, _ in procs:
                proc.kill()
                proc.wait()
    assert s0 != 0 and "Address already in use" in out0, out0[-3000:]
    assert s1 == 2, out1[-3000:]
    assert "process 0 (pid" in out1 and "ended on JaxRuntimeError" in out1, out1[-3000:]
    assert "step 0" not in out1  # it never got its copy


def _logs(procs) -> str:
    """Each process's exit status (None: running) and the end of its output."""
    out = []
    for k, (proc, log) in enumerate(procs):
        log.seek(0)
        out.append(f"--- process {k}: status {proc.poll()}\n{log.read()[-8000:]}")
    return "\n".join(out)


def stopped(proc) -> bool:
    """Whether ``proc`` is stopped (SIGSTOP): state T in /proc."""
    try:
        return Path(f"/proc/{proc.pid}/stat").read_text().split()[2] == "T"
    except OSError:
        return False


def test_a_peer_that_exits_on_an_error_of_its_own_is_named_at_once(monkeypatch):
    """Process 1 exits (status 2) after its first step; it says so on the way out, so
    process 0's failed collective names it without waiting for the watch."""
    monkeypatch.setenv("JSCALER_PEER_TIMEOUT", "30")
    procs = start_workers("quit")
    (s1, out1), (s0, out0) = finish(*procs[1], timeout=240), finish(*procs[0], timeout=60)
    assert s1 == 2 and "process 1 gives up" in out1
    assert s0 == 2 and "because process(es) [1] exited in the middle of the run" in out0, out0


def test_the_launcher_reports_a_killed_process_and_stops_the_others():
    cmd = [sys.executable, "-m", "jscaler.cli", "launch", "--nprocs", "2",
           "--devices-per-proc", "2", "--", sys.executable, str(WORKER), "die", "5"]  # fmt: skip
    start = time.monotonic()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, check=False)
    assert time.monotonic() - start < 90
    assert proc.returncode == 128 + signal.SIGKILL, proc.stderr[-3000:]
    assert "jscaler launch: process 1 died (signal SIGKILL); stopping the other processes" in (
        proc.stderr
    )
    assert "[process 1] process 1 step 0" in proc.stderr


def test_a_normal_end_is_not_taken_for_a_dead_peer(monkeypatch):
    """The processes finish at different moments: the first to exit is marked exited,
    not reported gone, and both exit 0 with a 2 s watch."""
    monkeypatch.setenv("JSCALER_PEER_TIMEOUT", "2")
    outs = [finish(proc, log, timeout=180) for proc, log in start_workers("agree", steps=3)]
    for status, out in outs:
        assert status == 0, out[-3000:]
        assert "went away" not in out
