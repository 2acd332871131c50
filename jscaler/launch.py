"""``jscaler launch``: start N local processes of one command as one JAX program.

Each process gets ``--devices-per-proc`` simulated CPU devices and joins the run through
``jax.distributed.initialize`` on 127.0.0.1 (the environment :func:`jscaler.setup.
init_distributed` reads). Process 0's output is shown as it comes; the others' is shown,
prefixed, if they fail. When one exits non-zero or is killed by a signal, the launcher
says which on stderr (``jscaler launch: process 1 died (signal SIGKILL); stopping the other
processes``) and kills the rest; the exit status is the first failure's (128 + N for
signal N).
"""

from __future__ import annotations

import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

__all__ = ["launch"]


def free_port() -> int:
    """A TCP port on 127.0.0.1 free now (for a coordinator or transfer address), below
    the kernel's ephemeral range when it can: the process that binds it does so seconds
    later, and meanwhile any outgoing connection on the machine may take a port of that
    range (gloo's do; a worker whose transfer port was taken fails at its first
    cross-process copy)."""
    try:
        low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        low = 0
    rng = random.Random()  # not the user's seeded global generator
    for _ in range(64 if low > 20000 else 0):
        port = rng.randrange(10000, low)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _death(returncode: int) -> str:
    """``died (signal SIGKILL)`` for a negative return code, else ``exited with status N``."""
    if returncode < 0:
        try:
            name = signal.Signals(-returncode).name
        except ValueError:
            name = str(-returncode)
        return f"died (signal {name})"
    return f"exited with status {returncode}"


def _exit_status(returncode: int) -> int:
    """A shell's exit status: 128 + N for a process killed by signal N."""
    return 128 - returncode if returncode < 0 else returncode


def launch(command: list[str], nprocs: int, devices_per_proc: int, timeout: float | None = None):
    """Runs ``command`` in ``nprocs`` processes; returns the exit status."""
    if not command:
        raise SystemExit("jscaler launch: give the command after --, e.g. -- jscaler train ...")
    if command[0] == "jscaler":  # the console script of this same installation
        command = [sys.executable, "-m", "jscaler.cli", *command[1:]]
    coordinator = f"127.0.0.1:{free_port()}"
    procs, logs = [], []
    for i in range(nprocs):
        env = dict(os.environ)
        env.pop("XLA_FLAGS", None)
        env.update(
            JSCALER_COORDINATOR=coordinator,
            JSCALER_NUM_PROCESSES=str(nprocs),
            JSCALER_PROCESS_ID=str(i),
            JSCALER_LOCAL_DEVICES=str(devices_per_proc),
            JSCALER_TRANSFER_ADDRESS=f"127.0.0.1:{free_port()}",
        )
        # a file, not a pipe: a pipe nobody reads fills up and blocks a chatty process
        logs.append(None if i == 0 else tempfile.TemporaryFile("w+"))
        procs.append(
            subprocess.Popen(command, env=env, stdout=logs[i], stderr=subprocess.STDOUT, text=True)
        )
    start = time.monotonic()
    status = 0
    while procs:
        failed = [p for p in procs if p.poll() not in (None, 0)]
        late = timeout is not None and time.monotonic() - start > timeout
        if failed or late:
            status = _exit_status(failed[0].returncode) if failed else 124
            why = (
                f"process {procs.index(failed[0])} {_death(failed[0].returncode)}"
                if failed
                else f"timed out after {timeout:g} s"
            )
            if any(p.poll() is None for p in procs):
                why += "; stopping the other processes"
            print(f"jscaler launch: {why}", file=sys.stderr, flush=True)
            break
        if all(p.poll() is not None for p in procs):
            break
        time.sleep(0.2)
    for p in procs:
        if p.poll() is None:
            p.kill()
        p.wait()
    for i, (p, log) in enumerate(zip(procs, logs)):
        status = status or _exit_status(p.returncode)
        if p.returncode not in (0, None) and log is not None:
            log.seek(0)
            for line in log.read().splitlines()[-40:]:
                print(f"[process {i}] {line}", file=sys.stderr)
    return status
