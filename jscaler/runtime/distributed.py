"""Agreement between the processes of a multi-process run.

Every process of a run traces the model and derives its plan on its own (nothing is
broadcast), so all of them must arrive at the same plan for the same graph; if one
does not, the processes lower different programs and hang or compute garbage in their
first collective. :func:`check_plan_agreement` hashes what each process is about to run
and compares the hashes through jax.distributed's key-value store before anything is
compiled, turning that silent divergence into a :class:`~jscaler.errors.DistributedError`.

When a process dies mid-run, the others' next collective fails (gloo on CPU reports the
closed connection at once), or, if they are not in one or the dead peer's connections
stay open, :class:`jscaler.runtime.peers.PeerWatch` finds it within
``JSCALER_PEER_TIMEOUT`` seconds. :func:`peer_failures_as_errors` wraps a trainer's
``step`` so the first case reads as a DistributedError too: it gives the watch the time
to name the process that went away, and says that a peer is gone if it cannot.

Environment:
  ``JSCALER_AGREEMENT_TIMEOUT``: seconds a process waits for the others' hashes (default
  300; a slow plan search on one host counts against it).
"""

from __future__ import annotations

import functools
import hashlib
import itertools
import json
import os

import jax

from jscaler.errors import DistributedError
from jscaler.plan.kind import AnyPlan
from jscaler.plan.schedule import Schedule
from jscaler.runtime import peers
from jscaler.version import __version__

__all__ = ["check_plan_agreement", "peer_failures_as_errors", "plan_digest"]

_calls = itertools.count()  # one key namespace per parallelize call, same order everywhere

_CAUSES = (
    "likely causes: different jscaler or jax versions on the hosts, different code or "
    "command-line arguments, a plan that depends on the process (jax.process_index(), a "
    "local file), or a nondeterministic space (unseeded random choices, a search with a "
    "wall-clock limit); derive the plan identically everywhere, or save it once "
    "(Plan.to_json) and pass the same file to every process"
)


def plan_digest(plan: AnyPlan, schedule: Schedule | None = None, devices=()) -> str:
    """A stable hash of what a process will run: the plan's description (its JSON, which
    carries the graph fingerprint; for a pipeline every group's devices and plan and the
    cuts), the schedule's name, placement, micro-batches and block order, and the device
    ids."""
    data = plan.describe()
    if schedule is not None:
        data["schedule"] = {
            "name": schedule.name,
            "placement": list(schedule.placement),
            "microbatches": schedule.microbatches,
            "whole": list(schedule.whole),
            "blocks": [[str(b) for b in g] for g in schedule.groups],
        }
    data["devices"] = [int(getattr(d, "id", d)) for d in devices]
    text = json.dumps(data, sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def check_plan_agreement(plan: AnyPlan, schedule: Schedule | None = None, devices=()) -> None:
    """Raises DistributedError unless every process is about to run the same plan.

    A no-op in a single-process run. Each process publishes its :func:`plan_digest`
    (with its plan's name and its jscaler and jax versions) under a per-call key of
    jax.distributed's key-value store, then reads every other process's entry, waiting
    at most ``JSCALER_AGREEMENT_TIMEOUT`` seconds. Every process raises the same error,
    so all of them stop.
    """
    if jax.process_count() == 1:
        return
    from jax._src.distributed import global_state

    client = global_state.client
    if client is None:  # multi-process without jax.distributed: nothing to talk through
        return
    me, n = jax.process_index(), jax.process_count()
    mine = {
        "digest": plan_digest(plan, schedule, devices),
        "plan": plan.name or type(plan).__name__,
        "jscaler": __version__,
        "jax": jax.__version__,
    }
    prefix = f"jscaler/plan_agreement/{next(_calls)}"
    client.key_value_set(f"{prefix}/{me}", json.dumps(mine))
    timeout = float(os.environ.get("JSCALER_AGREEMENT_TIMEOUT", "300"))
    entries = {me: mine}
    for pid in range(n):
        if pid == me:
            continue
        try:
            entries[pid] = json.loads(
                client.blocking_key_value_get(f"{prefix}/{pid}", int(timeout * 1000))
            )
        except Exception as e:  # jax raises its own XlaRuntimeError / JaxRuntimeError
            raise DistributedError(
                f"process {me}: process {pid} did not publish its plan hash within "
                f"{timeout:g} s (JSCALER_AGREEMENT_TIMEOUT); it is slower (a long plan "
                f"search), stuck, or dead. jax.distributed said: {e}"
            ) from e
    if len({e["digest"] for e in entries.values()}) > 1:
        raise DistributedError(_disagreement_message(me, entries))


def _disagreement_message(me: int, entries: dict[int, dict]) -> str:
    """Groups the processes by digest; names each group's processes, plan and versions."""
    by_digest: dict[str, list[int]] = {}
    for pid in sorted(entries):
        by_digest.setdefault(entries[pid]["digest"], []).append(pid)
    lines = [
        f"the {len(entries)} processes of this run derived {len(by_digest)} different plans "
        f"(seen from process {me}):"
    ]
    for digest, pids in by_digest.items():
        e = entries[pids[0]]
        lines.append(
            f"  processes {pids}: hash {digest}, plan {e['plan']!r} "
            f"(jscaler {e['jscaler']}, jax {e['jax']})"
        )
    lines.append(_CAUSES)
    return "\n".join(lines)


# What jax's runtime errors say when the process at the other end of a collective is gone.
_PEER_GONE = (
    "connection closed by peer",
    "connection reset",
    "broken pipe",
    "heartbeat",
    "coordination service",
    "gloo",
    "nccl",
)


def peer_failures_as_errors(step):
    """Decorates a trainer's ``step``: in a multi-process run, a jax runtime error that
    says a peer's connection is gone is re-raised as a DistributedError with a hint."""

    @functools.wraps(step)
    def wrapped(*args, **kwargs):
        try:
            return step(*args, **kwargs)
        except jax.errors.JaxRuntimeError as e:
            text = str(e)
            if jax.process_count() == 1 or not any(p in text.lower() for p in _PEER_GONE):
                raise
            exited = []
            if (watch := peers.current()) is not None:  # it names a dead one and exits
                exited = watch.wait_for_gone(watch.timeout + 5)
            if exited:
                raise DistributedError(
                    f"process {jax.process_index()} of {jax.process_count()}: a collective "
                    f"with the other processes failed because process(es) {exited} exited "
                    f"in the middle of the run; their own output says why. This process "
                    f"stops too. jax said: {text.splitlines()[0]}"
                ) from e
            raise DistributedError(
                f"process {jax.process_index()} of {jax.process_count()}: a collective with "
                f"the other processes failed, most likely because another process died "
                f"(killed, crashed, out of memory) or its host became unreachable; look in "
                f"the other processes' logs for the first error. This process stops too. "
                f"jax said: {text.splitlines()[0]}"
            ) from e

    return wrapped
