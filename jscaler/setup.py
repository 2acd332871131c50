"""Process-level JAX set-up that must happen before JAX initialises its backends.

The embedded default: with no accelerator, jscaler runs on N simulated CPU devices.
Compiled programs go to a persistent cache in the user's cache folder, so a repeated run
(tests, CI on the same machine) skips recompiles.
"""

from __future__ import annotations

import os
from pathlib import Path

__all__ = [
    "cache_dir",
    "cpu_processes",
    "distributed_timeouts",
    "enable_compilation_cache",
    "init_distributed",
    "use_cpu_devices",
]


def cache_dir() -> Path:
    """``$JSCALER_CACHE_DIR``, else ``$XDG_CACHE_HOME/jscaler``, else ``~/.cache/jscaler``."""
    if env := os.environ.get("JSCALER_CACHE_DIR"):
        return Path(env)
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "jscaler"


def use_cpu_devices(n: int) -> None:
    """Asks for ``n`` simulated CPU devices; call before JAX starts its backends."""
    flags = os.environ.get("XLA_FLAGS", "")
    flag = "--xla_force_host_platform_device_count"
    flags = " ".join(f for f in flags.split() if not f.startswith(flag))
    os.environ["XLA_FLAGS"] = f"{flags} {flag}={n}".strip()
    import jax

    jax.config.update("jax_num_cpu_devices", n)


def enable_compilation_cache() -> bool:
    """Turns on JAX's persistent compilation cache under :func:`cache_dir`; returns
    whether it did.

    Not in a multi-process run on CPU devices (``jscaler launch``): under jaxlib 0.12.1 an
    executable read back from the cache by several processes deadlocks in its first gloo
    all-reduce (every device thread waits in ``gloo::allreduce``; a cold cache, or the
    cache off, trains; 0.12.0.1 did not hang). Call after :func:`init_distributed`.
    """
    import jax

    if cpu_processes():
        jax.config.update("jax_enable_compilation_cache", False)
        return False
    path = cache_dir() / "xla"
    path.mkdir(parents=True, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", str(path))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    return True


def cpu_processes() -> bool:
    """Whether this process is one of several of a run on simulated CPU devices
    (``jscaler launch`` sets ``JSCALER_COORDINATOR`` and gives each process CPU devices)."""
    return (
        "JSCALER_COORDINATOR" in os.environ
        and int(os.environ.get("JSCALER_NUM_PROCESSES", "1")) > 1
    )


def init_distributed() -> bool:
    """Joins a multi-process run; call before JAX starts its backends.

    ``jscaler launch`` sets ``JSCALER_COORDINATOR`` (host:port), ``JSCALER_NUM_PROCESSES``,
    ``JSCALER_PROCESS_ID``, ``JSCALER_LOCAL_DEVICES`` and ``JSCALER_TRANSFER_ADDRESS`` (the
    socket cross-process ``device_put`` uses). On a cluster (SLURM, Open MPI) with more than
    one task, ``jax.distributed.initialize()`` finds the same from the environment.
    Returns True when this process is one of several.
    """
    import jax

    env = os.environ
    if "JSCALER_COORDINATOR" in env:
        use_cpu_devices(int(env.get("JSCALER_LOCAL_DEVICES", "1")))
        if addr := env.get("JSCALER_TRANSFER_ADDRESS"):
            jax.config.update("jax_cross_host_transfer_socket_address", addr)
        me, n = int(env["JSCALER_PROCESS_ID"]), int(env["JSCALER_NUM_PROCESSES"])
        timeouts = distributed_timeouts()
        extra = {}
        if me == 0:  # the service in a child, so that it outlives this process
            extra["coordinator_bind_address"] = _own_service(env["JSCALER_COORDINATOR"], n)
        jax.distributed.initialize(
            env["JSCALER_COORDINATOR"], num_processes=n, process_id=me, **timeouts, **extra
        )
        _watch_peers()
        return True
    tasks = env.get("SLURM_NTASKS") or env.get("OMPI_COMM_WORLD_SIZE")
    if tasks and int(tasks) > 1:
        jax.distributed.initialize(**distributed_timeouts())
        _watch_peers()
        return True
    return False


def _own_service(address: str, n: int) -> str:
    """Starts jax.distributed's coordination service for ``address`` in a child process
    (:mod:`jscaler.runtime.coordinator`) and returns a free local address for the idle
    service ``jax.distributed.initialize`` insists on starting in process 0."""
    import atexit

    from jscaler.launch import free_port
    from jscaler.runtime import coordinator

    heartbeat = int(os.environ.get("JSCALER_HEARTBEAT_TIMEOUT", "60"))
    shutdown = int(os.environ.get("JSCALER_SHUTDOWN_TIMEOUT", "300"))
    grace = float(os.environ.get("JSCALER_PEER_TIMEOUT", "20")) + 15
    child = coordinator.start(address, n, heartbeat, shutdown, grace)
    atexit.register(coordinator.stop, child)  # after the peer watch's exit hook (LIFO)
    return f"127.0.0.1:{free_port()}"


def _watch_peers() -> None:
    """Starts :class:`jscaler.runtime.peers.PeerWatch` over jax.distributed's client
    (without starting JAX's backends)."""
    from jax._src.distributed import global_state as state

    from jscaler.runtime.peers import PeerWatch

    PeerWatch.start(state.client, state.process_id, state.num_processes)


def distributed_timeouts() -> dict[str, int]:
    """Bounded timeouts for ``jax.distributed.initialize``, so a dead process stops the rest.

    A process that stops sending heartbeats for ``$JSCALER_HEARTBEAT_TIMEOUT`` seconds
    (default 60; jax's own default is 100) is declared dead by the coordination service,
    which then terminates every other process instead of letting it wait in a collective
    forever. ``$JSCALER_INIT_TIMEOUT`` (default 300) bounds the wait for all processes to
    join, ``$JSCALER_SHUTDOWN_TIMEOUT`` (default 300) the wait at exit for the slowest
    process to finish (a dead one fails that barrier at the heartbeat timeout). Only the
    keyword arguments this jax's ``initialize`` accepts are returned.
    """
    import inspect

    import jax

    heartbeat = int(os.environ.get("JSCALER_HEARTBEAT_TIMEOUT", "60"))
    wanted = {
        "heartbeat_timeout_seconds": heartbeat,
        "shutdown_timeout_seconds": int(os.environ.get("JSCALER_SHUTDOWN_TIMEOUT", "300")),
        "initialization_timeout": int(os.environ.get("JSCALER_INIT_TIMEOUT", "300")),
    }
    accepted = inspect.signature(jax.distributed.initialize).parameters
    return {k: v for k, v in wanted.items() if k in accepted}
