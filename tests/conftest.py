"""Test set-up: 8 simulated CPU devices and the persistent compilation cache.

This runs before any test module imports JAX's backends.
"""

from jscaler.setup import enable_compilation_cache, use_cpu_devices

N_DEVICES = 8
use_cpu_devices(N_DEVICES)
enable_compilation_cache()
