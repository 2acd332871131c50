"""From a model, a loss and a plan (or a space) to Programs, one per batch signature.

The one way through the runtime::

    trace -> resolve the plan -> validate -> agree across processes -> memory preflight
          -> lower -> Program (compiled at its first step)

:func:`prepare` is the middle of it (validate, agree, preflight, lower), used by
:class:`Planner` (for :func:`jscaler.parallelize`) and by ``parallelize_step``;
:class:`Planner` caches one Program per batch signature and re-plans a new one from the
space it was given. The runtime tells plan kinds apart here and nowhere else
(:attr:`AnyPlan.is_pipeline`).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, Protocol

import jax
import optax

from jscaler.compile.lower import Lowered, lower
from jscaler.cost.cluster import Cluster, get_cluster
from jscaler.errors import PlanError, ScheduleError
from jscaler.ir.chunk import chunk_loops
from jscaler.ir.graph import Graph
from jscaler.ir.trace import trace
from jscaler.plan.helpers import data_parallel
from jscaler.plan.kind import AnyPlan
from jscaler.plan.plan import Plan, graph_fingerprint
from jscaler.plan.schedule import Schedule, one_f_one_b
from jscaler.plan.validate import validate
from jscaler.runtime.batch import batch_key, batch_shapes
from jscaler.runtime.distributed import check_plan_agreement
from jscaler.runtime.pipeline import PipelineProgram
from jscaler.runtime.precision import (
    compute_dtype,
    warn_if_not_computing_in,
    with_compute_dtype,
)
from jscaler.runtime.preflight import check_memory, device_capacity, optimizer_slots
from jscaler.runtime.program import Program
from jscaler.runtime.spmd import SpmdProgram
from jscaler.search.candidates import tuned
from jscaler.search.joint import Auto

__all__ = [
    "Planner",
    "Prepared",
    "Space",
    "prepare",
    "resolve_devices",
    "resolve_plan",
    "resolve_schedule",
]


class Space(Protocol):
    """A search space: given the traced graph and the device count, a concrete Plan (or,
    for pipelines, a PipelinePlan)."""

    def __call__(self, graph: Graph, n_devices: int) -> AnyPlan: ...


@dataclass(frozen=True)
class Prepared:
    """A plan checked for the devices: validated, agreed by every process, predicted to
    fit; lowered onto them (a single-program plan), or with its schedule (a pipeline,
    whose groups the :class:`StageDriver` lowers)."""

    plan: AnyPlan
    schedule: Schedule | None
    devices: tuple
    lowered: Lowered | None


def prepare(
    plan: AnyPlan,
    devices: list,
    *,
    microbatches: int,
    schedule=None,
    cluster: Cluster | None = None,
    precision: str = "fp32",
    slots: int = 0,
) -> Prepared:
    """Validates ``plan`` for ``devices`` (resolving a pipeline's ``schedule``), checks
    every process runs the same plan, refuses one predicted not to fit the devices'
    memory (``cluster``'s, else the devices' own limit where the runtime reports one),
    and lowers a single-program plan onto the devices."""
    if plan.is_pipeline:
        plan.validate(len(devices))
        sched = resolve_schedule(schedule, plan, microbatches)
        predict = PipelineProgram.predict
    else:
        if schedule is not None:
            raise PlanError(
                f"schedule= orders pipeline stages, but the plan {plan.name or ''!r} has "
                f"none; use a plan with pp > 1 (e.g. megatron(pp=2)) or drop schedule="
            )
        validate(plan, n_devices=len(devices))
        sched, predict = None, SpmdProgram.predict
    check_plan_agreement(plan, sched, devices)  # multi-process: all run the same plan
    capacity = cluster.memory if cluster is not None else device_capacity(devices)
    if capacity:
        est = predict(
            plan, cluster or "cpu", microbatches=microbatches, precision=precision,
            slots=slots, schedule=sched,
        )  # fmt: skip
        where = cluster.name if cluster is not None else f"{devices[0].device_kind} devices"
        check_memory(est, capacity, where)
    lowered = None if plan.is_pipeline else lower(plan, devices)
    return Prepared(plan, sched, tuple(devices), lowered)


class Planner:
    """Turns batches into Programs for one model, loss, optimizer and plan (or space):
    one Program per batch signature, built once and cached. A batch of a new signature is
    traced and planned again from the space (a concrete plan fixes the shapes: a new one
    raises :class:`PlanError`).

    Attributes:
      devices, microbatches, cluster, precision, slots: as resolved from the arguments.
      builds: how many Programs have been built.
    """

    def __init__(
        self,
        model: Any,
        loss_fn: Callable,
        optimizer: optax.GradientTransformation,
        plan,
        *,
        devices=None,
        microbatches: int = 1,
        schedule=None,
        cluster: str | Cluster | None = None,
        has_aux: bool = False,
    ):
        if isinstance(microbatches, bool) or not isinstance(microbatches, int) or microbatches < 1:
            raise PlanError(f"microbatches must be a positive int, got {microbatches!r}")
        self.devices = resolve_devices(devices)
        self.microbatches = microbatches
        self.cluster = get_cluster(cluster) if cluster is not None else None
        self.precision = precision_of(plan)
        self.optimizer = optimizer
        self.model, self.loss_fn, self.has_aux = model, loss_fn, has_aux
        self.space, self.schedule = plan, schedule
        self.slots = 0
        self.master: list[jax.ShapeDtypeStruct] = []
        self.builds = 0
        self._programs: dict[tuple, Program] = {}

    @property
    def programs(self) -> Mapping[tuple, Program]:
        """The Programs built so far, by batch signature (:func:`batch_key`)."""
        return MappingProxyType(self._programs)

    def program(self, batch) -> Program:
        """The Program for ``batch``'s signature (built on first sight)."""
        leaves = jax.tree_util.tree_leaves(batch)
        key = batch_key(leaves)
        made = self._programs.get(key)
        if made is None and self._programs:
            first = next(iter(self._programs.values()))
            tdef = jax.tree_util.tree_structure(batch)
            if tdef != first.graph.signature.batch_def:
                raise PlanError(
                    f"the batch has structure {tdef}; the trainer was made for "
                    f"{first.graph.signature.batch_def}"
                )
            _check_dtypes(batch, first.batch_shapes)
            if isinstance(self.space, AnyPlan):
                raise PlanError(
                    f"the plan {self.space.name!r} was made for batch shapes "
                    f"{[tuple(s.shape) for s in first.batch_shapes]}; a concrete "
                    f"{type(self.space).__name__} fixes the shapes, so pass a space (e.g. "
                    f"megatron(tp=2)) to re-plan for new shapes"
                )
        if made is None:
            made = self._programs[key] = self._build(batch)
            self.builds += 1
        return made

    def _trace(self, batch) -> tuple[Graph, list]:
        shapes = batch_shapes(batch, self.microbatches)
        m = self.microbatches
        micro = [jax.ShapeDtypeStruct((s.shape[0] // m, *s.shape[1:]), s.dtype) for s in shapes]
        tdef = jax.tree_util.tree_structure(batch)
        traced_model, traced_batch = with_compute_dtype(
            self.model,
            jax.tree_util.tree_unflatten(tdef, micro),
            compute_dtype(self.precision),
            has_aux=self.has_aux,
        )
        return trace(self.loss_fn, traced_model, traced_batch, has_aux=self.has_aux), shapes

    def _build(self, batch) -> Program:
        graph, shapes = self._trace(batch)
        warn_if_not_computing_in(graph, self.precision)
        if not self.master:  # the parameters as the trainer stores them
            sig = graph.signature
            params = sig.split(self.model)[0]
            self.master = [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in params]
            tree = jax.tree_util.tree_unflatten(sig.params_def, self.master)
            self.slots = optimizer_slots(self.optimizer, tree)
        space = self.space
        if (isinstance(space, str) and space == "auto") or isinstance(space, Auto):
            space = tuned(
                Auto() if isinstance(space, str) else space, microbatches=self.microbatches,
                optimizer_slots=self.slots, dtype=self.precision,
                **({"cluster": self.cluster} if self.cluster is not None else {}),
            )  # fmt: skip
        plan = resolve_plan(space, graph, len(self.devices), self.cluster)
        ready = prepare(
            plan, self.devices, microbatches=self.microbatches, schedule=self.schedule,
            cluster=self.cluster, precision=self.precision, slots=self.slots,
        )  # fmt: skip
        common = dict(batch_shapes=shapes, precision=self.precision, slots=self.slots)
        if plan.is_pipeline:
            # the plan's own graph: the traced one, or its rewrite with layers stacked
            # under a scan cut into one scan per stage (jscaler.ir.chunk_loops)
            return PipelineProgram(
                plan.graph,
                plan,
                ready.schedule,
                self.devices,
                self.optimizer,
                self.master,
                **common,
            )
        return SpmdProgram(
            graph,
            ready.lowered,
            self.optimizer,
            self.master,
            microbatches=self.microbatches,
            **common,
        )


def resolve_devices(devices) -> list:
    """None: all devices; an int: the first N; a list: those devices."""
    available = jax.devices()
    if devices is None:
        return list(available)
    if isinstance(devices, int) and not isinstance(devices, bool):
        if devices < 1:
            raise PlanError(f"devices={devices}: a plan needs at least 1 device")
        if devices > len(available):
            raise PlanError(
                f"devices={devices}, but {len(available)} devices exist "
                f"({available[0].platform}); set XLA_FLAGS=--xla_force_host_platform_"
                f"device_count=N for N simulated CPU devices"
            )
        return list(available[:devices])
    devices = list(devices)
    if not devices:
        raise PlanError("devices is an empty list")
    return devices


def resolve_schedule(schedule, plan, microbatches: int) -> Schedule:
    """The Schedule for the pipeline plan's device groups and ``microbatches``; a function
    is called with the number of groups that partition the devices. None: the plan's
    own (``PipelinePlan.schedule``), else ``one_f_one_b``."""
    if schedule is None:
        schedule = plan.schedule or one_f_one_b
    if callable(schedule) and not isinstance(schedule, Schedule):
        schedule = schedule(plan.pipeline_groups, microbatches)
    if not isinstance(schedule, Schedule):
        raise ScheduleError(
            f"schedule must be a Schedule or a function making one, got {schedule!r}"
        )
    if schedule.microbatches != microbatches:
        raise ScheduleError(
            f"schedule {schedule.name!r} runs {schedule.microbatches} micro-batches but "
            f"microbatches={microbatches}; pass the same count to both"
        )
    if tuple(schedule.whole) != tuple(plan.whole):
        raise ScheduleError(
            f"the plan {plan.name!r} has all-device groups {list(plan.whole)} and schedule "
            f"{schedule.name!r} {list(schedule.whole)}; an interlaced plan needs the "
            f"interlaced schedule (schedules.interlaced), a plain pipeline any other"
        )
    if plan.cuts is not None and len(plan.cuts) + 1 != schedule.stages:
        own = getattr(plan.schedule, "__name__", None)
        raise ScheduleError(
            f"the plan {plan.name!r} cuts the graph into {len(plan.cuts) + 1} stages but "
            f"schedule {schedule.name!r} runs {schedule.stages}"
            + (f"; use the plan's own schedule {own!r} (pass schedule=None)" if own else "")
        )
    return schedule  # checked by the StageDriver, which runs it


def precision_of(plan) -> str:
    """A space's ``precision`` knob; a plan computes in the dtype its graph was traced in."""
    if isinstance(plan, AnyPlan):
        dtypes = {t.dtype for t in plan.graph.params()}
        return "bf16" if dtypes == {"bfloat16"} else "fp32"
    return getattr(plan, "precision", "fp32")


def resolve_plan(plan, graph: Graph, n_devices: int, cluster: Cluster | None = None) -> AnyPlan:
    """A plan from a space, a plan, a JSON path, ``"dp"`` or ``"auto"`` (searched for
    ``cluster``, default ``cpu``)."""
    if isinstance(plan, AnyPlan):
        fp = graph_fingerprint(graph)
        if plan.is_pipeline:  # planned on this graph's scans cut into chunks, perhaps
            fps = {fp} | {
                graph_fingerprint(chunk_loops(graph, pp))
                for pp in {len(plan.groups), len(plan.groups) - len(plan.whole)}
            }
            if {p.fingerprint for p in plan.spmd_plans} <= fps:
                return plan
        for p in plan.spmd_plans:
            if p.fingerprint != fp:
                Plan.from_json(p.to_json(), graph, "the plan given")  # raises the mismatch
        return plan
    if isinstance(plan, str):
        if plan == "dp":
            return data_parallel(graph, n_devices)
        if plan == "auto":  # the joint search, for this machine's devices
            return Auto(cluster=cluster or "cpu")(graph, n_devices)
        if os.path.exists(plan):
            with open(plan) as f:
                return Plan.from_json(f.read(), graph, f"plan file {plan}")
        raise PlanError(
            f"plan={plan!r} is neither 'dp', 'auto' nor a plan JSON file; pass a space such as "
            f"spaces.megatron(tp=2) or a Plan"
        )
    if callable(plan):
        made = plan(graph, n_devices)
        if not isinstance(made, AnyPlan):
            raise PlanError(f"the space {plan!r} returned {type(made).__name__}, not a Plan")
        return made
    raise PlanError(f"plan must be a space, a Plan, a JSON path or 'dp'; got {plan!r}")


def _check_dtypes(batch, example) -> None:
    """A batch leaf whose dtype differs from the example batch's is refused by name: a new
    shape re-plans, a new dtype would re-trace the model on values it was not written for
    (an embedding indexed by floats)."""
    for (path, x), want in zip(jax.tree_util.tree_leaves_with_path(batch), example):
        got = jax.dtypes.canonicalize_dtype(x.dtype)
        if got != jax.dtypes.canonicalize_dtype(want.dtype):
            raise PlanError(
                f"batch leaf {jax.tree_util.keystr(path)} has dtype {got}; the example batch "
                f"the trainer was made with has {want.dtype}. Cast it "
                f"(e.g. x.astype({str(want.dtype)!r})), or make a trainer for the new dtype"
            )
