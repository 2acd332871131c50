"""Process-level JAX set-up that must happen before JAX initialises its backends.

The embedded default: with no accelerator, jscaler runs on N simulated CPU devices.
Compiled programs go to a persistent cache in the user's cache folder, so a repeated run
(tests, CI on the same machine) skips recompiles.
"""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["cache_dir", "use_cpu_devices", "enable_compilation_cache"]


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


def enable_compilation_cache() -> None:
    """Turns on JAX's persistent compilation cache under :func:`cache_dir`."""
    import jax

    path = cache_dir() / "xla"
    path.mkdir(parents=True, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", str(path))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
