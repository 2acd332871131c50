"""What ``plan="auto"`` tries: the engine's own candidates and those other packages register.

A :class:`Candidate` is a named space (``(graph, n_devices) -> plan``) with what the search
needs to prune it unplanned: the least number of ways it splits the model state, and how
many pipeline stages it has (its bubble). The engine's own (:func:`builtin_candidates`):

- data parallelism;
- the op-trans / op-assign ILP (:func:`intra_op`: each op's split and each parameter's ZeRO
  stage) on one axis over the devices (and, with ``ilp_meshes="all"``, on every two-axis
  mesh whose inner axis fits a node); with every repeated layer recomputed, tried only
  when the plan without does not fit;
- pipelines of 2 and 4 stage groups running that ILP's plan on their devices, the layers cut
  by Alpa's stage DP (:func:`slice_stages`) for the micro-batch count being tried (the two
  smallest counts offered from the group count up: each count is a new ILP).

Packages add theirs with :func:`register_candidates` (``import spaces`` registers every
space's settings: Megatron's tp x pp, the ZeRO stages, DeepSpeed, Ulysses and ring, coshard,
interlaced, 3F1B) and pipeline schedules with :func:`register_schedule` (``import
schedules``: GPipe, interleaved 1F1B, zero-bubble), tried on every pipeline candidate
beside 1F1B and the plan's own.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from jscaler.cost.cluster import Cluster, get_cluster
from jscaler.errors import PlanError
from jscaler.ir.chunk import chunk_loops
from jscaler.ir.graph import Graph
from jscaler.plan.helpers import data_parallel
from jscaler.plan.pipeline import PipelinePlan, StageGroup
from jscaler.search.auto import intra_op
from jscaler.search.stages import slice_stages

__all__ = [
    "Candidate",
    "StagedILP",
    "builtin_candidates",
    "mesh_shapes",
    "register_candidates",
    "register_schedule",
    "registered_candidates",
    "registered_schedules",
    "tuned",
]


@dataclass(frozen=True)
class Candidate:
    """A point of the search: ``space(graph, n_devices)`` makes its plan.

    Attributes:
      name: how it is written (``megatron(tp=2, pp=2)``), unique in a search.
      space: the space making the plan.
      state_shards: the least number of ways the plan splits the model state (parameters,
        gradients, optimizer state), for pruning before planning; 0: unknown.
      stages: its pipeline groups (1: none), for the bubble in its lower bound.
      microbatches: the micro-batch count it runs (None: the search tries those offered).
      fallback_of: tried only when the candidate of this name does not fit.
      counts: at most this many of the micro-batch counts offered (0: every one); a
        pipeline whose planning is costly (an ILP per count) tries fewer.
      recompute: the fraction of repeated layers it recomputes (as the spaces' knob), so
        its lower bound counts their forward twice.
    """

    name: str
    space: Callable
    state_shards: int = 0
    stages: int = 1
    microbatches: int | None = None
    fallback_of: str | None = None
    counts: int = 0
    recompute: float = 0


_CANDIDATES: list[Callable[[Graph, int], Iterable[Candidate]]] = []
_SCHEDULES: dict[str, Callable] = {}


def register_candidates(make: Callable[[Graph, int], Iterable[Candidate]]):
    """Adds ``make(graph, n_devices) -> [Candidate]`` to every later ``plan="auto"``
    search; returns ``make`` (usable as a decorator). Registering the same function twice
    adds it once."""
    if make not in _CANDIDATES:
        _CANDIDATES.append(make)
    return make


def register_schedule(name: str, schedule: Callable) -> None:
    """Adds ``schedule(groups, microbatches) -> Schedule`` under ``name`` to the schedules
    every pipeline candidate of a later search is tried with."""
    _SCHEDULES[name] = schedule


def registered_candidates(graph: Graph, n_devices: int) -> list[Candidate]:
    return [c for make in _CANDIDATES for c in make(graph, n_devices)]


def registered_schedules() -> dict[str, Callable]:
    return dict(sorted(_SCHEDULES.items()))


def mesh_shapes(n: int, node: int, two_axes: bool = True) -> list[dict]:
    """One axis over ``n`` devices, then (``two_axes``) every ``{"dp": n // k, "tp": k}``
    with both axes above 1 and the inner axis ``k`` within a node of ``node`` devices."""
    shapes = [{"d": n}]
    for k in range(2, min(n, node) + 1 if two_axes else 0):
        if n % k == 0 and n // k > 1:
            shapes.append({"dp": n // k, "tp": k})
    return shapes


@dataclass(frozen=True)
class StagedILP:
    """A pipeline of ``pp`` groups of consecutive devices, each running the ILP's plan for
    its devices; the layers cut by Alpa's stage DP for ``microbatches``."""

    pp: int
    cluster: str | Cluster = "cpu"
    capacity: float | None = None
    dtype: str = "fp32"
    optimizer_slots: int = 0
    microbatches: int = 1
    time_limit: float = 10.0
    cache: bool = True

    def __call__(self, graph: Graph, n_devices: int) -> PipelinePlan:
        graph = chunk_loops(graph, self.pp)  # a scanned stack: a scan per chunk of layers
        if n_devices % self.pp or len(graph.layers()) < self.pp:
            raise PlanError(
                f"a {self.pp}-stage pipeline needs a device count divisible by {self.pp} and "
                f"at least {self.pp} repeated layers; got {n_devices} devices and "
                f"{len(graph.layers())} layers"
            )
        size = n_devices // self.pp
        # a stage holds about 1/pp of the model: the ILP bounds the whole graph's memory
        capacity = self.pp * (self.capacity or get_cluster(self.cluster).memory)
        inner = intra_op(
            None, self.cluster, capacity, self.dtype, self.optimizer_slots, self.time_limit,
            self.cache,
        )(graph, size)  # fmt: skip
        cuts = slice_stages(graph, inner, self.pp, self.microbatches, self.cluster, self.dtype)
        groups = [StageGroup(tuple(range(k * size, (k + 1) * size)), inner) for k in range(self.pp)]
        name = f"pipeline(pp={self.pp}, {inner.name})"
        return PipelinePlan(tuple(groups), name=name, cuts=cuts, solved=inner.solved)


def builtin_candidates(
    graph: Graph,
    n_devices: int,
    cluster: str | Cluster = "cpu",
    *,
    time_limit: float = 10.0,
    cache: bool = True,
    ilp_meshes: str = "one",
) -> list[Candidate]:
    """The engine's candidates (see the module doc); the search sets their cluster,
    capacity, dtype, optimizer slots and micro-batches (:func:`tuned`). ``ilp_meshes``:
    ``"one"`` runs the ILP on one axis over the devices (two-axis meshes are searched
    through the registered spaces' tp x dp settings), ``"all"`` on every two-axis mesh too
    (its problem grows with the strategies per op: on swin-tiny at 8 devices a two-axis
    problem takes seconds to build and often does not solve within its time limit)."""
    if ilp_meshes not in ("one", "all"):
        raise PlanError(f"ilp_meshes must be 'one' or 'all', got {ilp_meshes!r}")
    n = n_devices
    out = [Candidate("data_parallel", data_parallel, state_shards=1)]
    layered = bool(graph.layers())
    node = get_cluster(cluster).devices_per_node
    for mesh in mesh_shapes(n, node, ilp_meshes == "all") if n > 1 else [{"d": 1}]:
        shape = ", ".join(f"{a}={s}" for a, s in mesh.items())
        space = intra_op(mesh, cluster, time_limit=time_limit, cache=cache)
        out.append(Candidate(f"intra_op({shape})", space, state_shards=n))
        if layered:
            out.append(
                Candidate(
                    f"intra_op({shape}, recompute=1)",
                    dataclasses.replace(space, recompute=1),
                    state_shards=n,
                    fallback_of=f"intra_op({shape})",
                    recompute=1,
                )
            )
    for pp in (2, 4):
        if n % pp == 0 and len(graph.layers()) >= pp:
            space = StagedILP(pp, cluster, time_limit=time_limit, cache=cache)
            out.append(Candidate(f"pipeline(pp={pp}, intra_op)", space, n, pp, counts=2))
    return out


def tuned(space, **knobs):
    """``space`` with each knob it has as a dataclass field set (``cluster``, ``capacity``,
    ``dtype``, ``optimizer_slots``, ``microbatches``); others are left as they are."""
    if not dataclasses.is_dataclass(space):
        return space
    names = {f.name for f in dataclasses.fields(space)}
    changes = {k: v for k, v in knobs.items() if k in names}
    return dataclasses.replace(space, **changes) if changes else space
