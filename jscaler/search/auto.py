"""``intra_op``: the searched plan as a space (Alpa's intra-operator pass on one mesh).

Searched plans are cached as plan JSON under ``<cache_dir>/plans/``, keyed by the graph's
fingerprint, the mesh, the cluster spec and the search's knobs: the same inputs load the
same plan on every host without solving again (``cache=False`` always solves). Files are
written atomically (temporary file, then rename), so a killed run leaves none half-made.

Inside :func:`shared_solves` (one joint search), an ``intra_op`` given the same graph
object, mesh and knobs as an earlier one returns that plan without solving again (Alpa's
one-stage plan is the engine's ILP with recompute).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass

from jscaler.cost.cluster import Cluster
from jscaler.errors import PlanError
from jscaler.ir.graph import Graph
from jscaler.plan.helpers import recompute_layers
from jscaler.plan.mesh import MeshSpec
from jscaler.plan.plan import Plan
from jscaler.search.collect import fewer_collections
from jscaler.search.ilp import solve, to_plan
from jscaler.search.problem import build_problem

__all__ = ["IntraOp", "intra_op", "shared_solves", "write_atomically"]

# (graph id, mesh, knobs) -> (graph, plan) while a shared_solves() block runs
_SOLVED: ContextVar[dict | None] = ContextVar("jscaler_intra_op_solved", default=None)


@contextmanager
def shared_solves() -> Iterator[None]:
    """Within it, an ``intra_op`` on the same graph object, mesh and knobs as an earlier
    one (cache or not) returns the earlier plan instead of solving the same problem again."""
    token = _SOLVED.set({})
    try:
        yield
    finally:
        _SOLVED.reset(token)


@dataclass(frozen=True)
class IntraOp:
    mesh: tuple = ()  # ((axis, size), ...); () = one axis over every device
    cluster: str | Cluster = "cpu"
    capacity: float | None = None  # bytes per device; None = the cluster's memory
    dtype: str = "fp32"
    optimizer_slots: int = 0
    time_limit: float = 10.0
    cache: bool = True
    recompute: float = 0

    def __call__(self, graph: Graph, n_devices: int) -> Plan:
        axes = dict(self.mesh) if self.mesh else {"d": n_devices}
        mesh = MeshSpec.create(**axes)
        if mesh.size != n_devices:
            raise PlanError(
                f"intra_op(mesh={axes}) spans {mesh.size} devices; {n_devices} were given"
            )
        solved = _SOLVED.get()
        key = (id(graph), mesh, dataclasses.replace(self, mesh=(), cache=False))
        if solved is not None and key in solved:
            return solved[key][1]
        plan = self._solve(graph, mesh)
        if solved is not None:
            solved[key] = (graph, plan)  # the graph kept alive: its id stays its own
        return plan

    def _solve(self, graph: Graph, mesh: MeshSpec) -> Plan:
        path = self._cache_path(graph, mesh) if self.cache else None
        if path is not None and path.is_file():
            try:
                return Plan.from_json(path.read_text(), graph, f"cached plan {path}")
            except (PlanError, ValueError, KeyError, TypeError):
                pass  # unreadable or stale: solve again and overwrite it
        with fewer_collections():
            problem = build_problem(
                graph,
                mesh,
                self.cluster,
                dtype=self.dtype,
                capacity=self.capacity if self.capacity is not None else _memory(self.cluster),
                optimizer_slots=self.optimizer_slots,
                recompute=self.recompute,
                fail_fast=True,
            )
            sol = solve(problem, time_limit=self.time_limit)
        shape = ", ".join(f"{a}={s}" for a, s in mesh.axes)
        plan = to_plan(problem, sol, name=f"intra_op({shape})")
        # solved: for explain and the CLI (not written: a plan loaded from the file has none)
        plan = recompute_layers(plan, self.recompute).evolve(name=plan.name, solved=(problem, sol))
        if path is not None:
            write_atomically(path, plan.to_json())
        return plan

    def _cache_path(self, graph: Graph, mesh: MeshSpec):
        from jscaler.cost.cluster import get_cluster
        from jscaler.plan.plan import PLAN_FORMAT, graph_fingerprint
        from jscaler.setup import cache_dir

        cluster = dataclasses.asdict(get_cluster(self.cluster))
        key = json.dumps(
            [
                graph_fingerprint(graph), mesh.to_json(), cluster, self.capacity, self.dtype,
                self.optimizer_slots, self.time_limit, self.recompute, SEARCH_VERSION,
                PLAN_FORMAT,
            ],
            sort_keys=True,
            default=str,
        )  # fmt: skip
        return (
            cache_dir() / "plans" / f"intra_op-{hashlib.sha256(key.encode()).hexdigest()[:24]}.json"
        )


SEARCH_VERSION = 11  # bump when the problem or the solver changes what a search returns


def write_atomically(path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-", suffix=".json")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise


def _memory(cluster) -> float:
    from jscaler.cost.cluster import get_cluster

    return get_cluster(cluster).memory


def intra_op(
    mesh: dict | None = None,
    cluster: str | Cluster = "cpu",
    capacity: float | None = None,
    dtype: str = "fp32",
    optimizer_slots: int = 0,
    time_limit: float = 10.0,
    cache: bool = True,
    recompute: float = 0,
) -> IntraOp:
    """The plan the op-trans + op-assign ILP picks on ``mesh`` (``{"dp": 2, "tp": 4}``;
    default one axis over every device), for ``cluster``, under ``capacity`` bytes per
    device (default the cluster's memory); ``recompute``: the fraction of repeated layers
    checkpointed (the search costs it, the plan carries it). ``cache``: load and store the
    searched plan under the user cache folder (keyed by graph, mesh, cluster and these
    knobs)."""
    return IntraOp(
        tuple((mesh or {}).items()), cluster, capacity, dtype, optimizer_slots, time_limit,
        cache, recompute,
    )  # fmt: skip
