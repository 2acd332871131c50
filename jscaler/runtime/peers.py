"""A watch over the other processes of a multi-process run.

A process blocked in a collective with a peer that died may wait a long time: gloo reports
a closed connection at once, but a peer that hangs (stopped, swapping, its host gone)
keeps its connections open, and jax.distributed's own heartbeat ends such a wait with a
SIGABRT from a C++ thread that says nothing of which process went away.

:class:`PeerWatch` is a daemon thread that beats once a second: it writes a counter under
``jscaler/alive/<process>`` in jax.distributed's key-value store and reads everybody
else's. A process whose counter has not moved for ``JSCALER_PEER_TIMEOUT`` seconds
(default 20), or a store that cannot be reached for as long, is gone: the watch prints a
DistributedError naming that process (its id, pid and host) and ends this process with
exit status 2, wherever its main thread is blocked. A process that finishes normally
marks itself ``exited`` first (an ``atexit`` hook), so it is never reported; process 0
also waits there (at most ``JSCALER_SHUTDOWN_TIMEOUT`` s) until every other process has
exited or is gone, so the service outlives every client's last call. A process ended by
an uncaught exception marks itself ``failed: <the exception>`` instead, and the others
report it at their next beat: a peer waiting on it in something that never fails (a
cross-process transfer it would have served) would otherwise wait forever.
"""

from __future__ import annotations

import atexit
import json
import os
import socket
import sys
import threading
import time

from jscaler.errors import DistributedError

__all__ = ["PeerWatch", "current"]

_PREFIX = "jscaler/alive/"
_EXITED = "exited"
_FAILED = "failed: "
_watch: PeerWatch | None = None


def current() -> PeerWatch | None:
    """The running watch of this process, if any."""
    return _watch


class PeerWatch:
    """Beats, and watches the others' beats; see the module docstring."""

    def __init__(self, client, me: int, n: int, timeout: float, interval: float = 1.0):
        self.client, self.me, self.n = client, me, n
        self.timeout, self.interval = timeout, interval
        self._stop = threading.Event()
        self._beat = 0
        self._seen: dict[int, tuple[str, float]] = {}  # process -> (value, when it changed)
        self._exited: set[int] = set()
        self._store_ok = time.monotonic()
        info = {"pid": os.getpid(), "host": socket.gethostname()}
        client.key_value_set(f"{_PREFIX}info/{me}", json.dumps(info), allow_overwrite=True)
        self._thread = threading.Thread(target=self._run, name="jscaler-peer-watch", daemon=True)

    @classmethod
    def start(cls, client, me: int, n: int) -> PeerWatch:
        """Starts the process's watch (once) and its exit hook."""
        global _watch
        timeout = float(os.environ.get("JSCALER_PEER_TIMEOUT", "20"))
        _watch = cls(client, me, n, timeout)
        _watch._thread.start()
        atexit.register(_watch.finish)  # runs before jax's own shutdown hook (LIFO)
        return _watch

    # ---- the thread ------------------------------------------------------------------

    def _run(self):
        while not self._stop.wait(self.interval):
            gone = self.check(time.monotonic())
            if gone is not None:
                _report_and_exit(gone)

    def check(self, now: float, publish: bool = True) -> str | None:
        """One beat: publishes this process's counter (unless ``publish`` is False),
        reads the others'; a message naming the process that went away, or None."""
        self._beat += 1
        key = f"{_PREFIX}{self.me}"
        try:
            if publish:
                self.client.key_value_set(key, str(self._beat), allow_overwrite=True)
            entries = dict(self.client.key_value_dir_get(_PREFIX))
        except Exception as e:  # jax raises its runtime error type; any failure counts
            if now - self._store_ok > self.timeout:
                return self._message(0, f"jax.distributed's store is unreachable ({e})")
            return None
        self._store_ok = now
        for pid in range(self.n):
            if pid == self.me:
                continue
            value = entries.get(f"{_PREFIX}{pid}", "")
            if value == _EXITED:
                self._exited.add(pid)
                continue
            if value.startswith(_FAILED):
                return self._message(pid, f"it ended on {value.removeprefix(_FAILED)}")
            old = self._seen.get(pid)
            if old is None or old[0] != value:
                self._seen[pid] = (value, now)
            elif now - old[1] > self.timeout:
                return self._message(pid, f"its heartbeat stopped {now - old[1]:.0f} s ago")
        return None

    def _message(self, pid: int, why: str) -> str:
        who = f"process {pid}"
        try:
            info = json.loads(self.client.key_value_try_get(f"{_PREFIX}info/{pid}"))
            who += f" (pid {info['pid']} on {info['host']})"
        except Exception:  # the store may be what is gone
            pass
        if pid == 0:
            who += ", which started the coordination service,"
        return (
            f"process {self.me} of {self.n}: {who} went away: {why} (JSCALER_PEER_TIMEOUT="
            f"{self.timeout:g}). It was killed, crashed, ran out of memory, is stopped, or "
            f"its host is unreachable; look in its log for the first error. Stopping this "
            f"process too (exit status 2); restart the run from the last checkpoint."
        )

    # ---- normal exit -----------------------------------------------------------------

    def finish(self):
        """Marks this process exited (or failed, when an uncaught exception ends it);
        process 0 waits for the others (bounded)."""
        self._stop.set()
        mark = _EXITED
        if (exc := getattr(sys, "last_exc", None)) is not None:  # set before atexit runs
            mark = _FAILED + f"{type(exc).__name__}: {exc}".splitlines()[0][:200]
        try:
            self.client.key_value_set(f"{_PREFIX}{self.me}", mark, allow_overwrite=True)
        except Exception:
            return
        if self.me != 0:
            return
        deadline = time.monotonic() + float(os.environ.get("JSCALER_SHUTDOWN_TIMEOUT", "300"))
        while time.monotonic() < deadline:
            if self.check(time.monotonic(), publish=False) is not None:
                return
            if len(self._exited) == self.n - 1:
                return
            time.sleep(self.interval)

    def wait_for_gone(self, seconds: float) -> list[int]:
        """Blocks up to ``seconds`` while the watch looks for a process that went away
        (the watch ends this process if it finds one); returns early with the processes
        that exited on their own (an error of theirs), else returns []."""
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            if self._exited:
                return sorted(self._exited)
            time.sleep(0.2)
        return []


_STDERR = os.dup(2)  # the terminal, even while a checkpoint save holds descriptor 2


def _report_and_exit(message: str):
    sys.stdout.flush()
    os.write(_STDERR, f"jscaler: error: {DistributedError(message)}\n".encode())
    os._exit(2)
