"""Test set-up: 8 simulated CPU devices and the persistent compilation cache.

This runs before any test module imports JAX's backends.
"""

import os
import time

from jscaler.setup import enable_compilation_cache, use_cpu_devices

N_DEVICES = 8
use_cpu_devices(N_DEVICES)
enable_compilation_cache()


def pytest_configure(config):
    """The randomised tests' seed (tests/randomised.py): new every run unless given. Set
    here, before xdist starts its workers, so that they (and the processes tests start)
    inherit the same one."""
    os.environ.setdefault("JSCALER_RANDOM_SEED", time.strftime("%Y%m%d%H%M%S", time.gmtime()))


def pytest_report_header(config):
    seed = os.environ["JSCALER_RANDOM_SEED"]
    return f"random plans: JSCALER_RANDOM_SEED={seed} (set it to replay this run's plans)"
