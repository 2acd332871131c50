"""``jscaler.parallelize``: model + loss + optimizer + example batch + plan -> Trainer.

Every run goes trace -> plan -> validate -> agree -> preflight -> lower -> run
(:mod:`jscaler.runtime.builder`); nothing bypasses the plan, and nothing runs before the
plan has been validated for the devices given.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import optax

from jscaler.cost.cluster import Cluster
from jscaler.errors import TraceError
from jscaler.plan.plan import Plan
from jscaler.plan.schedule import Schedule
from jscaler.runtime.builder import Planner, Space
from jscaler.runtime.trainer import Trainer

__all__ = ["parallelize"]


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
) -> Trainer:
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
      A :class:`Trainer` (for a pipeline plan too: its Program is the pipeline's):
      ``trainer.step(batch)`` returns ``{"loss", "grad_norm"}``; ``eval(batch)`` the loss
      without an update; ``save(dir)`` / ``restore(dir)`` checkpoints; ``export()`` the
      gathered parameters. A batch of another shape re-plans (from the space) and compiles
      once more; each shape's step is cached.

    Raises:
      TraceError: the loss does not return a scalar float, or the optimizer is not an
        optax GradientTransformation.
      PlanError: the plan does not fit the graph or the devices, or the batch does not
        split into the micro-batches.
      OutOfMemoryError: the plan is predicted not to fit the devices' memory.

    Example (``megatron`` comes from the ``spaces`` package)::

        >>> trainer = jscaler.parallelize(model, gpt.loss, optax.adamw(3e-4), batch,
        ...                               devices=8, plan=megatron(tp=2, dp=4))
        >>> metrics = trainer.step(batch)
    """
    if not (
        callable(getattr(optimizer, "init", None)) and callable(getattr(optimizer, "update", None))
    ):
        hint = " (call it: optax.sgd(0.1), not optax.sgd)" if callable(optimizer) else ""
        raise TraceError(
            f"optimizer must be an optax GradientTransformation (with init and update); got "
            f"{type(optimizer).__name__} {optimizer!r:.80}{hint}"
        )
    planner = Planner(
        model, loss_fn, optimizer, plan, devices=devices, microbatches=microbatches,
        schedule=schedule, cluster=cluster, has_aux=has_aux,
    )  # fmt: skip
    return Trainer(planner, example_batch)
