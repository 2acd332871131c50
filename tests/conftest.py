"""Test set-up: 8 simulated CPU devices, the persistent compilation cache, and the slice
of the slow tests a run takes.

This runs before any test module imports JAX's backends.

Slow tests (``@pytest.mark.slow``, and the ids listed in ``tests/slow.txt``: the full
parity matrix, the other cases of each parametrised test) are split into 7 slices, the
listed ones by their measured seconds, the others by a hash of their id; a plain
``pytest`` run takes the slice of the day (UTC date), so every slow test runs at least
once in any 7 consecutive days. ``JSCALER_SLOW=all`` runs every slow test,
``JSCALER_SLOW=none`` none, ``JSCALER_SLOW=K`` slice K (0-6, to replay a day); an
explicit ``-m`` expression (``-m slow``, ``-m "not slow"``) is left alone.
"""

import datetime
import hashlib
import json
import os
import tempfile
import time
from pathlib import Path

import pytest

from jscaler.setup import enable_compilation_cache, use_cpu_devices

N_DEVICES = 8
use_cpu_devices(N_DEVICES)
enable_compilation_cache()


SLICES = 7


def pytest_configure(config):
    """The randomised tests' seed (tests/randomised.py): new every run unless given; the
    slow slice: the day's unless given. Set here, before xdist starts its workers, so that
    they (and the processes tests start) inherit the same ones."""
    os.environ.setdefault("JSCALER_RANDOM_SEED", time.strftime("%Y%m%d%H%M%S", time.gmtime()))
    today = datetime.datetime.now(datetime.UTC).date().toordinal() % SLICES
    if not os.environ.get("JSCALER_SLOW"):
        os.environ["JSCALER_SLOW"] = str(today)
    if "JSCALER_SLOW_REPORT" not in os.environ:  # where the workers say what they kept
        fd, path = tempfile.mkstemp(prefix="jscaler-slow-", suffix=".json")
        os.close(fd)
        os.environ["JSCALER_SLOW_REPORT"] = path
        _made.append(path)


_made: list[str] = []  # the report file this process made (the controller's)


def pytest_unconfigure(config):
    for path in _made:
        Path(path).unlink(missing_ok=True)


def pytest_report_header(config):
    seed = os.environ["JSCALER_RANDOM_SEED"]
    lines = [f"random plans and variants: JSCALER_RANDOM_SEED={seed} (set it to replay this run)"]
    if config.option.markexpr:
        lines.append(f"slow tests: as -m {config.option.markexpr!r} selects")
    else:
        lines.append(f"slow tests: JSCALER_SLOW={os.environ['JSCALER_SLOW']} ({_slow_rule()})")
    return lines


def _slow_rule() -> str:
    value = os.environ["JSCALER_SLOW"]
    if value == "all":
        return "every slow test"
    if value == "none":
        return "no slow test"
    return f"slice {_slice()} of 0-{SLICES - 1}, the UTC day's unless set; 'all' runs every one"


def _slice() -> int:
    value = os.environ["JSCALER_SLOW"]
    if not value.isdigit() or int(value) >= SLICES:
        raise pytest.UsageError(f"JSCALER_SLOW={value!r}: use all, none, or a slice 0-{SLICES - 1}")
    return int(value)


def slice_of(nodeid: str, listed: dict[str, int]) -> int:
    """The slice a slow test belongs to: its slice in ``tests/slow.txt``, else a stable
    hash of its id."""
    if nodeid in listed:
        return listed[nodeid]
    return int(hashlib.sha256(nodeid.encode()).hexdigest(), 16) % SLICES


SLOW_LIST = Path(__file__).with_name("slow.txt")


def slow_listed() -> dict[str, int]:
    """Test id -> slice for the ids ``tests/slow.txt`` marks slow (``<id>  # <seconds>``,
    the seconds measured): each goes to the slice with the fewest seconds so far, longest
    first, so the 7 slices take about equal time."""
    timed = []
    for line in SLOW_LIST.read_text().splitlines():
        nodeid, _, note = line.partition("#")
        if nodeid.strip():
            seconds = note.strip().removesuffix("s").strip()
            timed.append((-float(seconds or 0), nodeid.strip()))
    load, slices = [0.0] * SLICES, {}
    for neg, nodeid in sorted(timed):
        k = load.index(min(load))
        slices[nodeid], load[k] = k, load[k] - neg
    return slices


@pytest.hookimpl(tryfirst=True)  # before pytest's own -m selection reads the markers
def pytest_collection_modifyitems(config, items):
    listed = slow_listed()
    for it in items:
        if it.nodeid in listed:
            it.add_marker(pytest.mark.slow)
    if config.args_source == pytest.Config.ArgsSource.TESTPATHS:  # the whole suite
        missing = sorted(set(listed) - {it.nodeid for it in items})
        if missing:
            raise pytest.UsageError(
                f"tests/slow.txt names {len(missing)} tests that do not exist (renamed or "
                f"removed?): {missing[:5]}; update the file"
            )
    if config.option.markexpr or os.environ["JSCALER_SLOW"] == "all":
        return
    slow = [it for it in items if it.get_closest_marker("slow")]
    keep = set() if os.environ["JSCALER_SLOW"] == "none" else {_slice()}
    dropped = [it for it in slow if slice_of(it.nodeid, listed) not in keep]
    if dropped:
        gone = {id(it) for it in dropped}
        items[:] = [it for it in items if id(it) not in gone]
        config.hook.pytest_deselected(items=dropped)
    kept = sorted({it.nodeid for it in slow} - {it.nodeid for it in dropped})
    report = {"slow": len(slow), "kept": kept}
    Path(os.environ["JSCALER_SLOW_REPORT"]).write_text(json.dumps(report))


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    path = Path(os.environ.get("JSCALER_SLOW_REPORT", ""))
    if config.option.markexpr or os.environ["JSCALER_SLOW"] == "all" or not path.is_file():
        return
    try:
        report = json.loads(path.read_text())
    except ValueError:  # nothing collected
        return
    kept = report["kept"]
    terminalreporter.write_line(
        f"slow slice JSCALER_SLOW={os.environ['JSCALER_SLOW']}: {len(kept)} of "
        f"{report['slow']} slow tests ran (JSCALER_SLOW=all or -m slow: all of them)"
    )
    for nodeid in kept:
        terminalreporter.write_line(f"  {nodeid}")
