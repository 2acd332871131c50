"""``jscaler launch``: start N local processes of one command as one JAX program.

Each process gets ``--devices-per-proc`` simulated CPU devices and joins the run through
``jax.distributed.initialize`` on 127.0.0.1 (the environment :func:`jscaler._setup.
init_distributed` reads). Process 0's output is shown as it comes; the others' is shown,
prefixed, if they fail. The exit status is the first non-zero one (all are stopped when one
fails).
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time

__all__ = ["launch"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(command: list[str], nprocs: int, devices_per_proc: int, timeout: float | None = None):
    """Runs ``command`` in ``nprocs`` processes; returns the exit status."""
    if not command:
        raise SystemExit("jscaler launch: give the command after --, e.g. -- jscaler train ...")
    if command[0] == "jscaler":  # the console script of this same installation
        command = [sys.executable, "-m", "jscaler.cli", *command[1:]]
    coordinator = f"127.0.0.1:{_free_port()}"
    procs = []
    for i in range(nprocs):
        env = dict(os.environ)
        env.pop("XLA_FLAGS", None)
        env.update(
            JSCALER_COORDINATOR=coordinator,
            JSCALER_NUM_PROCESSES=str(nprocs),
            JSCALER_PROCESS_ID=str(i),
            JSCALER_LOCAL_DEVICES=str(devices_per_proc),
            JSCALER_TRANSFER_ADDRESS=f"127.0.0.1:{_free_port()}",
        )
        out = None if i == 0 else subprocess.PIPE
        procs.append(
            subprocess.Popen(command, env=env, stdout=out, stderr=subprocess.STDOUT, text=True)
        )
    start = time.monotonic()
    status = 0
    while procs and any(p.poll() is None for p in procs):
        failed = [p for p in procs if p.poll() not in (None, 0)]
        late = timeout is not None and time.monotonic() - start > timeout
        if failed or late:
            status = failed[0].returncode if failed else 124
            break
        time.sleep(0.2)
    for p in procs:
        if p.poll() is None:
            p.kill()
        p.wait()
    for i, p in enumerate(procs):
        status = status or p.returncode
        if i and p.returncode not in (0, None) and p.stdout is not None:
            for line in p.stdout.read().splitlines()[-40:]:
                print(f"[process {i}] {line}", file=sys.stderr)
    return status
