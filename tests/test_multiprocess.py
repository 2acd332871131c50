"""A pipeline whose stages live in different processes: ``jscaler launch`` starts two
processes of 4 CPU devices each, joined by jax.distributed on 127.0.0.1; stage 0 runs on
process 0's devices, stage 1 on process 1's, and the result matches one device.

Robustness (tests/mp_worker.py is the process they start): processes that derive
different plans stop with a DistributedError. A process that dies or falls silent:
tests/test_faults.py."""

import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

import jscaler


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


def test_data_parallel_across_two_processes_twice_on_one_compilation_cache(tmp_path):
    """Gradients all-reduced across processes (gloo), the second run after the first has
    filled the cache: under jaxlib 0.12.1 an executable read back from the persistent
    cache by both processes hung in its first all-reduce, so multi-process CPU runs keep
    the cache off (jscaler.setup.enable_compilation_cache)."""
    env = dict(os.environ, JSCALER_CACHE_DIR=str(tmp_path))
    cmd = [sys.executable, "-m", "jscaler.cli", "launch", "--nprocs", "2",
           "--devices-per-proc", "4", "--timeout", "150", "--", "jscaler", "train",
           "--model", "gpt-tiny", "--steps", "2"]  # fmt: skip
    for run in range(2):
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
        out = proc.stdout[-3000:] + proc.stderr[-3000:]
        assert proc.returncode == 0, f"run {run}: exit {proc.returncode}\n{out}"
        assert "plan dp(dp=8) on 8 devices" in proc.stdout
        assert "loss 6.1301 -> 5.8908 in 2 steps" in proc.stdout, out


def test_multi_process_cpu_runs_keep_the_compilation_cache_off(monkeypatch):
    from jscaler import setup

    monkeypatch.setenv("JSCALER_COORDINATOR", "127.0.0.1:1")
    monkeypatch.setenv("JSCALER_NUM_PROCESSES", "2")
    assert setup.cpu_processes()
    monkeypatch.setenv("JSCALER_NUM_PROCESSES", "1")
    assert not setup.cpu_processes()
    monkeypatch.delenv("JSCALER_COORDINATOR")
    assert not setup.cpu_processes()


def test_the_stacked_handoff_in_one_process(monkeypatch):
    """The multi-process update path (arrays assembled from the groups' shards, summed
    over the stacked pipe axis) run in one process: same numbers as one device."""
    import jscaler.runtime.pipeline as pipeline
    from schedules import interleaved_1f1b
    from spaces import megatron

    from test_pipeline import assert_pipeline_parity

    monkeypatch.setattr(pipeline, "multi_process", lambda: True)
    trainer = assert_pipeline_parity("gpt-tiny", megatron(tp=2, pp=2), interleaved_1f1b, 4)
    handoff = trainer.program.driver.handoff
    assert type(handoff).__name__ == "Stacked"
    assert handoff.mesh.axis_names == ("pipe", "dp", "tp")


def test_a_launched_command_that_fails_reports_the_failure():
    cmd = [sys.executable, "-m", "jscaler.cli", "launch", "--nprocs", "2", "--",
           "jscaler", "verify", "--model", "no-such-model", "--plan", "dp"]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 2
    assert "no-such-model" in proc.stderr


# ---- robustness: plan agreement, and a process that dies ---------------------------------

WORKER = Path(__file__).with_name("mp_worker.py")


def start_workers(mode: str, steps: int = 5, nprocs: int = 2, transfer_ports=None):
    """``nprocs`` processes of tests/mp_worker.py joined as ``jscaler launch`` would join
    them, but started here (as SLURM would), with a 10 s heartbeat; output to files.
    ``transfer_ports``: {process: port} for their cross-process transfers (default a
    free port each)."""
    from jscaler.launch import free_port

    coordinator = f"127.0.0.1:{free_port()}"
    procs = []
    for i in range(nprocs):
        env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
        env.update(
            JSCALER_COORDINATOR=coordinator,
            JSCALER_NUM_PROCESSES=str(nprocs),
            JSCALER_PROCESS_ID=str(i),
            JSCALER_LOCAL_DEVICES="2",
            JSCALER_TRANSFER_ADDRESS=f"127.0.0.1:{(transfer_ports or {}).get(i) or free_port()}",
            JSCALER_HEARTBEAT_TIMEOUT="10",
        )
        log = tempfile.TemporaryFile("w+")
        cmd = [sys.executable, str(WORKER), mode, str(steps)]
        procs.append((subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT), log))
    return procs


def finish(proc, log, timeout: float) -> tuple[int, str]:
    """Waits at most ``timeout`` s (then kills it and fails); the exit status and output."""
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        log.seek(0)
        pytest.fail(f"process still running after {timeout:g} s:\n{log.read()[-3000:]}")
    log.seek(0)
    return proc.returncode, log.read()


def test_processes_that_derive_different_plans_stop_with_a_distributed_error():
    procs = start_workers("disagree")
    for proc, log in procs:
        status, out = finish(proc, log, timeout=120)
        assert status == 2, out[-3000:]
        assert "derived 2 different plans" in out, out[-3000:]
        assert "processes [0]: hash" in out and "processes [1]: hash" in out
        assert "'dp(dp=4)'" in out and "'megatron(tp=2, dp=2)'" in out
        assert "nondeterministic space" in out


def test_each_process_passing_only_its_rows_trains_as_the_global_batch():
    """Trainer.global_batch (jax.make_array_from_process_local_data) from each process's
    own rows gives the losses of every process passing the whole batch."""
    runs = {}
    for mode in ("agree", "local"):
        outs = [finish(proc, log, timeout=180) for proc, log in start_workers(mode, steps=3)]
        for status, out in outs:
            assert status == 0, out[-3000:]
        runs[mode] = re.findall(r"process 0 step \d loss ([\d.]+)", outs[0][1])
    assert len(runs["agree"]) == 3 and runs["local"] == runs["agree"]


def test_a_checkpoint_from_one_process_restores_across_two(tmp_path, monkeypatch):
    """Saved by one process under megatron(tp=4, dp=2) on 8 devices; restored by two
    processes of 2 devices under zero(stage=3) (parameters split across processes): the
    next steps' losses equal the uninterrupted run's."""
    import optax

    import jscaler
    import models
    from spaces import megatron

    spec = models.get("gpt-tiny")
    trainer = jscaler.parallelize(spec.init(0), spec.loss, optax.sgd(0.1), spec.batch(8, 0),
                                  devices=8, plan=megatron(tp=4, dp=2))  # fmt: skip
    for step in range(2):
        trainer.step(spec.batch(8, step))
    trainer.save(tmp_path)
    want = [trainer.step(spec.batch(8, step))["loss"] for step in (2, 3)]
    monkeypatch.setenv("JSCALER_TEST_CKPT", str(tmp_path))
    outs = [finish(proc, log, timeout=180) for proc, log in start_workers("restore", steps=2)]
    for status, out in outs:
        assert status == 0, out[-3000:]
    got = [float(x) for x in re.findall(r"process 0 step [23] loss ([\d.]+)", outs[0][1])]
    assert got == pytest.approx(want, rel=1e-5), (got, want)


def test_the_plan_digest_is_stable_and_tells_plans_apart():
    """Two derivations of one plan hash alike (traced twice, as two processes would);
    another plan, another schedule or other devices hash differently."""
    import jax

    import models
    from jscaler.plan.helpers import data_parallel
    from jscaler.runtime.distributed import check_plan_agreement, plan_digest
    from schedules import gpipe, one_f_one_b
    from spaces import megatron

    spec = models.get("gpt-tiny")

    def graph():
        return jscaler.trace(spec.loss, spec.init(0), spec.batch(spec.batch_size, 0))

    g1, g2 = graph(), graph()
    devices = jax.devices()
    assert plan_digest(data_parallel(g1, 8), None, devices) == plan_digest(
        data_parallel(g2, 8), None, devices
    )
    assert plan_digest(data_parallel(g1, 8)) != plan_digest(megatron(tp=2)(g1, 8))
    assert plan_digest(data_parallel(g1, 8), None, devices) != plan_digest(
        data_parallel(g1, 8), None, devices[::-1]
    )
    pipe1, pipe2 = megatron(pp=2, dp=4)(g1, 8), megatron(pp=2, dp=4)(g2, 8)
    assert plan_digest(pipe1, one_f_one_b(2, 4)) == plan_digest(pipe2, one_f_one_b(2, 4))
    assert plan_digest(pipe1, one_f_one_b(2, 4)) != plan_digest(pipe1, gpipe(2, 4))
    check_plan_agreement(pipe1, one_f_one_b(2, 4), devices)  # one process: nothing to ask


def test_free_ports_come_from_below_the_ephemeral_range():
    """A chosen port is bound seconds later; one from the kernel's ephemeral range may be
    taken meanwhile by any outgoing connection (a transfer port taken: its process fails
    at its first cross-process copy)."""
    from jscaler.launch import free_port

    low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    ports = [free_port() for _ in range(20)]
    assert all(10000 <= p < low for p in ports), (low, ports)
    assert len(set(ports)) > 10  # drawn at random, not one port for every caller
