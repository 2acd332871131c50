"""``intra_op``: the searched plan as a space (Alpa's intra-operator pass on one mesh)."""

from __future__ import annotations

from dataclasses import dataclass

from jscaler.cost.cluster import Cluster
from jscaler.errors import PlanError
from jscaler.ir.graph import Graph
from jscaler.plan.mesh import MeshSpec
from jscaler.plan.plan import Plan
from jscaler.search.ilp import solve, to_plan
from jscaler.search.problem import build_problem

__all__ = ["IntraOp", "intra_op"]


@dataclass(frozen=True)
class IntraOp:
    mesh: tuple = ()  # ((axis, size), ...); () = one axis over every device
    cluster: str | Cluster = "cpu"
    capacity: float | None = None  # bytes per device; None = the cluster's memory
    dtype: str = "fp32"
    optimizer_slots: int = 0
    time_limit: float = 10.0

    def __call__(self, graph: Graph, n_devices: int) -> Plan:
        axes = dict(self.mesh) if self.mesh else {"d": n_devices}
        mesh = MeshSpec.create(**axes)
        if mesh.size != n_devices:
            raise PlanError(
                f"intra_op(mesh={axes}) spans {mesh.size} devices; {n_devices} were given"
            )
        problem = build_problem(
            graph,
            mesh,
            self.cluster,
            dtype=self.dtype,
            capacity=self.capacity if self.capacity is not None else _memory(self.cluster),
            optimizer_slots=self.optimizer_slots,
        )
        sol = solve(problem, time_limit=self.time_limit)
        shape = ", ".join(f"{a}={s}" for a, s in mesh.axes)
        plan = to_plan(problem, sol, name=f"intra_op({shape})")
        plan.__dict__["search"] = (problem, sol)  # for explain / the CLI
        return plan


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
) -> IntraOp:
    """The plan the op-trans + op-assign ILP picks on ``mesh`` (``{"dp": 2, "tp": 4}``;
    default one axis over every device), for ``cluster``, under ``capacity`` bytes per
    device (default the cluster's memory)."""
    return IntraOp(
        tuple((mesh or {}).items()), cluster, capacity, dtype, optimizer_slots, time_limit
    )
