"""What the randomised-plan tests (``test_random_*.py``) share: the run's seed, their
hypothesis settings, the per-plan time limit, and the check that a plan trains one SGD
step equal to one device or raises a :class:`jscaler.JscalerError`.

Every run draws new plans: the seed is ``JSCALER_RANDOM_SEED``, which ``conftest.py``
sets from the UTC time when it is not given (the same value in every xdist worker and in
the processes tests start) and prints in pytest's header. A failure names the seed, how
to replay it, and the plan's JSON.

Per-plan limits: ``JSCALER_RANDOM_PLAN_SECONDS`` (default 60) for drawing, building,
compiling and running one plan; a plan over it fails the test after the run, naming the
plan. One over 5x that (a hang) prints the plan and every thread's stack and ends the
process.
"""

from __future__ import annotations

import faulthandler
import os
import sys
import threading
import time
from dataclasses import dataclass, field

import jax
from hypothesis import HealthCheck, Phase, event, note, seed, settings
from hypothesis.errors import HypothesisException

import jscaler
from jscaler.report import explain
from jscaler.runtime.reference import compare, trainer_steps

SEED = int(os.environ.get("JSCALER_RANDOM_SEED") or time.strftime("%Y%m%d", time.gmtime()))
LIMIT_S = float(os.environ.get("JSCALER_RANDOM_PLAN_SECONDS", "60"))
HANG_S = 5 * LIMIT_S


def no_cache_writes():
    """For a module fixture: the one-off programs of random plans are compiled without
    writing them to the persistent cache. In one cold CI run, XLA's CPU
    ``executable.serialize()`` (called by JAX's ``put_executable_and_time`` when it writes
    a cache entry) crashed a worker with a segfault on one of them (jax 0.12.0.1; the
    same example passed on a rerun). Reading the cache, and every other test's writes,
    are unchanged."""
    key = "jax_persistent_cache_min_compile_time_secs"
    old = getattr(jax.config, key)
    jax.config.update(key, 1e9)
    yield
    jax.config.update(key, old)


def examples(var: str, default: int) -> int:
    """The number of plans a test draws: env ``var``, else ``default``."""
    return int(os.environ.get(var, str(default)))


def randomised(n: int):
    """Decorator for a ``@given`` test: ``n`` new examples a run from :data:`SEED`, none
    stored, no shrinking (one example is a compile: the seed and the plan's JSON replay a
    failure instead)."""

    def wrap(test):
        return seed(SEED)(
            settings(
                max_examples=n,
                deadline=None,
                database=None,
                derandomize=False,
                phases=(Phase.explicit, Phase.generate),
                suppress_health_check=[
                    HealthCheck.function_scoped_fixture,
                    HealthCheck.too_slow,
                    HealthCheck.data_too_large,
                    HealthCheck.filter_too_much,
                ],
            )(test)
        )

    return wrap


def replay_hint(test: str) -> str:
    return (
        f"seed {SEED}; replay with JSCALER_RANDOM_SEED={SEED} and the same example count: "
        f"pytest {test}"
    )


def plan_text(plan) -> str:
    """A plan's JSON (a pipeline plan's: its groups' plans, cuts and schedule)."""
    if plan is None:
        return "(no plan yet)"
    if hasattr(plan, "to_json"):
        return plan.to_json()
    if hasattr(plan, "describe"):
        import json

        return json.dumps(plan.describe(), indent=1, default=str)
    return repr(plan)


@dataclass
class Clock:
    """Times each plan of one test; :meth:`check` fails the test naming the plans that
    took longer than ``limit`` seconds."""

    test: str
    limit: float = LIMIT_S
    slow: list[str] = field(default_factory=list, repr=False)
    times: list[float] = field(default_factory=list, repr=False)
    capture: object = field(default=None, repr=False)  # pytest's, suspended to report a hang

    def check(self) -> None:
        assert not self.slow, (
            f"{len(self.slow)} plan(s) took over {self.limit:g} s each to build, compile "
            f"and run ({replay_hint(self.test)}):\n" + "\n\n".join(self.slow[:3])
        )


def timed(request):
    """For a fixture ``clock`` of a test module: yields the test's :class:`Clock` and, after
    the test, fails it (at teardown) if a plan was slow."""
    clock = Clock(request.node.nodeid)
    clock.capture = request.config.pluginmanager.getplugin("capturemanager")
    yield clock
    if clock.times:
        times = sorted(clock.times)
        print(
            f"{len(times)} plans, median {times[len(times) // 2]:.1f} s, slowest {times[-1]:.1f} s"
        )
    clock.check()


class Watch:
    """Context for one plan: times it against ``clock`` and, past :data:`HANG_S`, prints
    what is running and every thread's stack and ends the process (a hang fails loudly
    instead of stalling CI). ``what`` is updated as the plan gets built."""

    def __init__(self, clock: Clock):
        self.clock, self.what, self.plan = clock, "", None
        self.label = ""  # prefixes the outcome's event: the space, the schedule

    def __enter__(self):
        self.t0 = time.monotonic()
        self.timer = threading.Timer(HANG_S, self._hung)
        self.timer.daemon = True
        self.timer.start()
        # if the GIL is held the timer cannot run; faulthandler's thread can
        faulthandler.dump_traceback_later(HANG_S + 60, exit=True)
        return self

    def _hung(self):
        if self.clock.capture is not None:  # else the report goes to pytest's capture, lost
            self.clock.capture.suspend_global_capture(in_=True)
        sys.__stderr__.write(
            f"\n{self.clock.test}: a plan ran over {HANG_S:g} s ({replay_hint(self.clock.test)})"
            f"\n{self.what}\n{plan_text(self.plan)}\n"
        )
        faulthandler.dump_traceback(sys.__stderr__, all_threads=True)
        sys.__stderr__.flush()
        os._exit(70)

    def __exit__(self, *exc):
        faulthandler.cancel_dump_traceback_later()
        self.timer.cancel()
        took = time.monotonic() - self.t0
        self.clock.times.append(took)
        if took > self.clock.limit:
            self.clock.slow.append(f"{took:.0f} s: {self.what}\n{plan_text(self.plan)}")
        return False


def expect_error_or_parity(watch: Watch, build, batches, ref) -> str:
    """Builds a trainer with ``build()`` and trains ``batches`` (one SGD step each); the
    result must equal ``ref`` (:func:`reference_steps`), or building or training raises a
    JscalerError. Anything else fails, naming the seed and the plan. Returns the
    outcome (prefixed by ``watch.label``), also recorded as a hypothesis event."""
    where = f"{watch.what}\n{replay_hint(watch.clock.test)}"
    try:
        trainer = build()
        got = trainer_steps(trainer, batches)
    except HypothesisException:
        raise  # hypothesis's own control flow (drawing)
    except jscaler.JscalerError as e:
        assert str(e), f"a {type(e).__name__} must say what is wrong; {where}"
        outcome = f"{watch.label}{type(e).__name__}"
    except Exception as e:  # the test's point: nothing but JscalerError, named
        raise AssertionError(
            f"{type(e).__name__} (not a JscalerError): {e}\n{where}\n{plan_text(watch.plan)}"
        ) from e
    else:
        mm = compare(got, ref[: len(got)])
        if not mm.ok:
            detail = explain(trainer.plan) if hasattr(trainer.plan, "trees") else ""
            raise AssertionError(
                "\n".join(
                    [
                        "differs from one device:",
                        *mm.lines[:10],
                        where,
                        detail,
                        plan_text(watch.plan),
                    ]  # fmt: skip
                )
            )
        outcome = f"{watch.label}ran and matched"
    event(outcome)
    note(f"{where}\n{plan_text(watch.plan)}")
    if len(jax.live_arrays()) > 10_000:
        jax.clear_caches()
    return outcome
