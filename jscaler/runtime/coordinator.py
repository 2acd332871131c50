"""jax.distributed's coordination service in a process of its own.

``jax.distributed.initialize`` runs the coordination service inside process 0. When that
process dies, every other process loses the service, and jax's client terminates it at
once from a C++ thread (SIGABRT, a stack trace, no word of which process went away).
``jscaler launch``-style runs (``JSCALER_COORDINATOR``) therefore start the service in a
small child of process 0 instead (:func:`start`), in jax's recoverable mode, where the
death of one process is not propagated as a fatal error to the others: the survivors keep
their connection to the service, notice the dead process through
:mod:`jscaler.runtime.peers` and stop with a DistributedError naming it.

The child watches a pipe from process 0. Process 0 writes ``done`` to it at a normal exit
(once every other process has exited too): the child stops 5 s later, when the others'
last calls to the service are over. If the pipe closes without it, process 0 died: the
child stays for ``GRACE`` seconds (``JSCALER_PEER_TIMEOUT`` + 15), long enough for the
other processes to notice and stop. Its output goes nowhere (a pipe it inherited would
keep whoever reads process 0's output waiting for it). Run as ``python -m
jscaler.runtime.coordinator ADDRESS NUM_PROCESSES HEARTBEAT SHUTDOWN GRACE``.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

from jscaler.errors import DistributedError

__all__ = ["start", "stop"]


def start(address: str, num_processes: int, heartbeat: int, shutdown: int, grace: float):
    """Starts the service on ``address`` (host:port) in a child process and returns it
    once the port accepts connections (at most 60 s)."""
    cmd = [sys.executable, "-m", "jscaler.runtime.coordinator", address,
           str(num_processes), str(heartbeat), str(shutdown), str(grace)]  # fmt: skip
    quiet = subprocess.DEVNULL
    child = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=quiet, stderr=quiet, text=True)
    host, port = address.rsplit(":", 1)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if child.poll() is not None:
            raise DistributedError(
                f"the coordination service for {address} exited at start (status "
                f"{child.returncode}); is the port in use? Pick another JSCALER_COORDINATOR."
            )
        try:
            socket.create_connection((host, int(port)), timeout=1).close()
            return child
        except OSError:
            time.sleep(0.05)
    child.kill()
    raise DistributedError(f"the coordination service did not listen on {address} within 60 s")


def _serve(address: str, num_processes: int, heartbeat: int, shutdown: int, grace: float):
    from jax._src.lib import _jax

    service = _jax.get_distributed_runtime_service(
        "[::]:" + address.rsplit(":", 1)[1],
        num_processes,
        heartbeat_timeout=heartbeat,
        shutdown_timeout=shutdown,
        recoverable=True,
    )
    said = sys.stdin.readline()  # blocks until process 0 says done, or dies
    time.sleep(5 if said.strip() == "done" else grace)
    del service


def stop(child) -> None:
    """Process 0's normal exit: the service stops a few seconds from now."""
    try:
        child.stdin.write("done\n")
        child.stdin.close()
    except OSError:
        pass


if __name__ == "__main__":
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a Ctrl-C to the group: process 0 decides
    address, n, heartbeat, shutdown, grace = sys.argv[1:6]
    _serve(address, int(n), int(heartbeat), int(shutdown), float(grace))
    os._exit(0)  # the service's threads are not joined; nothing is left to flush
