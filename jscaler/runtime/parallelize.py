"""``jscaler.parallelize``: model + loss + optimizer + example batch + plan -> Trainer.

Every run goes trace -> Plan -> validate -> lower -> run; nothing bypasses the plan, and
nothing runs before the plan has been validated for the devices given.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any, Protocol

import jax
import optax

from jscaler.compile.lower import lower
from jscaler.cost.cluster import Cluster, get_cluster
from jscaler.errors import PlanError, ScheduleError
from jscaler.ir.graph import Graph
from jscaler.ir.trace import trace
from jscaler.plan.helpers import data_parallel
from jscaler.plan.pipeline import PipelinePlan
from jscaler.plan.plan import Plan, graph_fingerprint
from jscaler.plan.schedule import Schedule, one_f_one_b
from jscaler.plan.validate import validate
from jscaler.runtime.distributed import check_plan_agreement
from jscaler.runtime.pipeline import PipelineTrainer
from jscaler.runtime.precision import compute_dtype, with_compute_dtype
from jscaler.runtime.preflight import check_memory, device_capacity, optimizer_slots, predict
from jscaler.runtime.trainer import Trainer

__all__ = ["Space", "parallelize", "resolve_devices", "resolve_schedule"]


class Space(Protocol):
    """A search space: given the traced graph and the device count, a concrete Plan (or,
    for pipelines, a PipelinePlan)."""

    def __call__(self, graph: Graph, n_devices: int) -> Plan | PipelinePlan: ...


def resolve_devices(devices) -> list:
    """None: all devices; an int: the first N; a list: those devices."""
    available = jax.devices()
    if devices is None:
        return list(available)
    if isinstance(devices, int) and not isinstance(devices, bool):
        if not 1 <= devices <= len(available):
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


def parallelize(
    model: Any,
    loss_fn: Callable,
    optimizer: optax.GradientTransformation,
    example_batch: Any,
    *,
    devices=None,
    plan: Space | Plan | str = "dp",
    microbatches: int = 1,
    schedule: Callable[[int, int], Schedule] | Schedule | None = None,
    cluster: str | Cluster | None = None,
    has_aux: bool = False,
) -> Trainer | PipelineTrainer:
    """Parallelises a training step over devices according to a plan.

    Args:
      model: an nnx Module (``loss_fn(model, batch)``; its Params are trained, its other
        variables carried as its code updates them), a params pytree
        (``loss_fn(params, batch)``), or with ``has_aux=True`` linen variables
        ``{"params": ..., "batch_stats": ...}``.
      loss_fn: returns a scalar float loss (with ``has_aux=True``: ``(loss,
        new_collections)``).
      optimizer: an optax GradientTransformation; its state is laid out like the
        parameters' update layout.
      example_batch: a batch of the global size the trainer will see (arrays or
        ``jax.ShapeDtypeStruct``); each leaf is split on axis 0.
      devices: None (all), an int (the first N of ``jax.devices()``), or a list.
      plan: a space (``megatron(tp=4)`` from ``spaces``), a concrete :class:`Plan`, the
        path of a plan's JSON, ``"dp"`` (data parallelism, the default), or ``"auto"``
        (searched: ``jscaler.search.intra_op()``, the op-trans/op-assign ILP on one mesh
        axis for the ``cpu`` cluster; pass ``intra_op(mesh=..., cluster=...)`` to choose).
      microbatches: gradient accumulation over this many micro-batches per step (the
        pipeline's micro-batches for a pipeline plan).
      schedule: for a pipeline plan (``megatron(pp=2)``): a function ``(groups,
        microbatches) -> Schedule`` from ``schedules`` (default :func:`one_f_one_b`) or
        a :class:`Schedule`.
        A space's ``precision="bf16"`` computes in bf16 (the loss traced with bf16
        parameters and floating batch leaves) while the trainer keeps fp32 master
        parameters and optimizer state.
      cluster: the machine the plan is for: a preset name (``"a100_80g"``, ``"h100_sxm"``,
        ``"dgx2_v100"``, ... see ``jscaler.CLUSTERS``) or a :class:`Cluster`. ``plan="auto"``
        searches for it, the cost model's memory estimate per device is checked against its
        memory before anything compiles (:class:`OutOfMemoryError` with the breakdown and
        plans to try), and the trainer's MFU is measured against its peak FLOP/s. Without
        it, the estimate is checked against the devices' own memory limit where the
        runtime reports one (GPUs, TPUs).
      has_aux: linen mutable collections: ``loss_fn(variables, batch)`` returns ``(loss,
        new_collections)``, e.g. from ``module.apply(variables, x, mutable=["batch_stats"])``.
        Only ``variables["params"]`` is trained; the other collections are carried as
        state, replaced by the returned ones each step (``trainer.variables`` holds all).

    Returns:
      A :class:`Trainer` (a :class:`PipelineTrainer` for a pipeline plan):
      ``trainer.step(batch)`` returns ``{"loss", "grad_norm"}``; ``eval(batch)`` the loss
      without an update; ``save(dir)`` / ``restore(dir)`` checkpoints; ``export()`` the
      gathered parameters. A batch of another shape re-plans (from the space) and compiles
      once more; each shape's step is cached.

    Raises:
      PlanError: the plan does not fit the graph or the devices, or the batch does not
        split into the micro-batches.
      OutOfMemoryError: the plan is predicted not to fit the devices' memory.

    Example (``megatron`` comes from the ``spaces`` package)::

        >>> trainer = jscaler.parallelize(model, gpt.loss, optax.adamw(3e-4), batch,
        ...                               devices=8, plan=megatron(tp=2, dp=4))
        >>> metrics = trainer.step(batch)
    """
    devices = resolve_devices(devices)
    if isinstance(microbatches, bool) or not isinstance(microbatches, int) or microbatches < 1:
        raise PlanError(f"microbatches must be a positive int, got {microbatches!r}")
    cluster = get_cluster(cluster) if cluster is not None else None
    precision = _precision_of(plan)

    def build(batch):
        """(graph, plan, batch shapes) for a batch of this shape."""
        shapes = batch_shapes(batch, microbatches)
        micro = [jax.ShapeDtypeStruct((s.shape[0] // microbatches, *s.shape[1:]), s.dtype)
                 for s in shapes]  # fmt: skip
        tdef = jax.tree_util.tree_structure(batch)
        traced_model, traced_batch = with_compute_dtype(
            model,
            jax.tree_util.tree_unflatten(tdef, micro),
            compute_dtype(precision),
            has_aux=has_aux,
        )
        graph = trace(loss_fn, traced_model, traced_batch, has_aux=has_aux)
        return graph, resolve_plan(plan, graph, len(devices), cluster), shapes

    graph, made, shapes = build(example_batch)
    sig = graph.signature
    slots = optimizer_slots(
        optimizer, jax.tree_util.tree_unflatten(sig.params_def, sig.split(model)[0])
    )
    capacity = cluster.memory if cluster is not None else device_capacity(devices)
    where = cluster.name if cluster is not None else f"{devices[0].device_kind} devices"
    if isinstance(made, PipelinePlan):

        def pipeline_for(graph, made):
            made.validate(len(devices))
            sched = resolve_schedule(schedule, made, microbatches)
            check_plan_agreement(made, sched, devices)  # multi-process: all run the same plan
            if capacity:
                est = predict(made, cluster or "cpu", microbatches=microbatches,
                              schedule=sched, precision=precision, slots=slots)  # fmt: skip
                check_memory(est, capacity, where)
            return sched

        def replan_pipeline(batch):
            """A new shape: trace and plan again (a concrete plan was made for one shape)."""
            if isinstance(plan, PipelinePlan):
                raise PlanError(
                    f"the plan {plan.name!r} was made for batch shapes "
                    f"{[tuple(s.shape) for s in shapes]}; a concrete PipelinePlan fixes the "
                    f"shapes, so pass a space (e.g. megatron(pp=2)) to re-plan for new shapes"
                )
            new_graph, new_plan, new_shapes = build(batch)
            return new_graph, new_plan, pipeline_for(new_graph, new_plan), new_shapes

        sched = pipeline_for(graph, made)
        trainer = PipelineTrainer(
            graph, made, sched, devices, optimizer, model, shapes, precision,
            replan=replan_pipeline,
        )  # fmt: skip
        trainer.cluster, trainer.optimizer_slots = cluster, slots
        return trainer
    if schedule is not None:
        raise PlanError(
            f"schedule= orders pipeline stages, but the plan {made.name or ''!r} has none; "
            f"use a plan with pp > 1 (e.g. megatron(pp=2)) or drop schedule="
        )

    def lowered_for(graph, made):
        validate(made, n_devices=len(devices))
        check_plan_agreement(made, None, devices)  # multi-process: all run the same plan
        if capacity:
            est = predict(made, cluster or "cpu", microbatches=microbatches,
                          precision=precision, slots=slots)  # fmt: skip
            check_memory(est, capacity, where)
        return lower(made, devices)

    def replan(batch):
        """A new shape: trace and plan again (a concrete Plan was made for one shape)."""
        if isinstance(plan, Plan):
            raise PlanError(
                f"the plan {plan.name!r} was made for batch shapes "
                f"{[tuple(s.shape) for s in shapes]}; a concrete Plan fixes the shapes, so "
                f"pass a space (e.g. megatron(tp=2)) to re-plan for new shapes"
            )
        new_graph, new_plan, new_shapes = build(batch)
        return new_graph, lowered_for(new_graph, new_plan), new_shapes

    return Trainer(
        graph, lowered_for(graph, made), optimizer, model, microbatches, shapes, precision,
        replan=replan, cluster=cluster, optimizer_slots=slots,
    )  # fmt: skip


def batch_shapes(batch, microbatches: int) -> list[jax.ShapeDtypeStruct]:
    """The batch leaves' shapes, each checked to split on axis 0 into the micro-batches."""
    shapes = [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in jax.tree_util.tree_leaves(batch)]
    for i, s in enumerate(shapes):
        if len(s.shape) == 0 or s.shape[0] % microbatches:
            raise PlanError(
                f"batch leaf {i} has shape {tuple(s.shape)}: its axis 0 must split into "
                f"{microbatches} micro-batches; use a batch size divisible by {microbatches}"
            )
    return shapes


def resolve_schedule(schedule, plan: PipelinePlan, microbatches: int) -> Schedule:
    """The Schedule for the plan's device groups and ``microbatches``; a function
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
    return schedule  # checked by the PipelineTrainer, which runs it


def _precision_of(plan) -> str:
    """A space's ``precision`` knob; a Plan computes in the dtype its graph was traced in."""
    if isinstance(plan, PipelinePlan):
        plan = plan.groups[0].plan
    if isinstance(plan, Plan):
        dtypes = {t.dtype for t in plan.graph.params()}
        return "bf16" if dtypes == {"bfloat16"} else "fp32"
    return getattr(plan, "precision", "fp32")


def resolve_plan(plan, graph: Graph, n_devices: int, cluster: Cluster | None = None) -> Plan:
    """A Plan from a space, a Plan, a JSON path, ``"dp"`` or ``"auto"`` (searched for
    ``cluster``, default ``cpu``)."""
    if isinstance(plan, PipelinePlan):
        fp = graph_fingerprint(graph)
        for g in plan.groups:
            if g.plan.fingerprint != fp:
                Plan.from_json(g.plan.to_json(), graph)  # raises the mismatch error
        return plan
    if isinstance(plan, Plan):
        if plan.fingerprint != graph_fingerprint(graph):
            return Plan.from_json(plan.to_json(), graph)  # raises the mismatch error
        return plan
    if isinstance(plan, str):
        if plan == "dp":
            return data_parallel(graph, n_devices)
        if plan == "auto":  # the ILP's plan on one mesh axis, for this machine's devices
            from jscaler.search import intra_op

            return intra_op(cluster=cluster or "cpu")(graph, n_devices)
        if os.path.exists(plan):
            with open(plan) as f:
                return Plan.from_json(f.read(), graph)
        raise PlanError(
            f"plan={plan!r} is neither 'dp', 'auto' nor a plan JSON file; pass a space such as "
            f"spaces.megatron(tp=2) or a Plan"
        )
    if callable(plan):
        made = plan(graph, n_devices)
        if not isinstance(made, (Plan, PipelinePlan)):
            raise PlanError(f"the space {plan!r} returned {type(made).__name__}, not a Plan")
        return made
    raise PlanError(f"plan must be a space, a Plan, a JSON path or 'dp'; got {plan!r}")
