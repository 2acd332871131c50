"""The Program protocol: a plan compiled for one batch signature.

A program is what the :class:`~jscaler.runtime.trainer.Trainer` runs and what
:mod:`jscaler.runtime.builder` builds and caches per batch signature. It is a pure
function of a :class:`~jscaler.runtime.state.TrainState`: ``step`` takes one and returns
the next, so the trainer holds the state and the program holds only what was compiled.
Two implementations: :class:`~jscaler.runtime.spmd.SpmdProgram` (one jitted SPMD step
over every device) and :class:`~jscaler.runtime.pipeline.PipelineProgram` (stage
programs on device groups, a driver walking the schedule, one update).
"""

from __future__ import annotations

import math
from typing import Any, Protocol

import jax
import jax.numpy as jnp
import optax

from jscaler.cost.cluster import Cluster
from jscaler.cost.estimate import Estimate
from jscaler.errors import NonFiniteLossError
from jscaler.ir.graph import Graph
from jscaler.plan.kind import AnyPlan
from jscaler.runtime.state import TrainState

__all__ = [
    "Program",
    "check_finite",
    "guarded_update",
    "initial_state",
    "optimizer_shardings",
]


class Program(Protocol):
    """A plan compiled for one batch signature.

    Attributes:
      plan: the validated plan it runs (a :class:`Plan` or :class:`PipelinePlan`).
      graph: the traced graph, at micro-batch shape.
      batch_shapes: the global batch leaves' shapes it was made for.
      microbatches: micro-batches per step.
      precision: ``"fp32"`` or ``"bf16"`` (the compute dtype; the state stays fp32).
    """

    plan: AnyPlan
    graph: Graph
    batch_shapes: list[jax.ShapeDtypeStruct]
    microbatches: int
    precision: str

    def shardings(self) -> TrainState:
        """Where each array of the state lives: a TrainState of shardings (``None`` for a
        host copy)."""
        ...

    def init(self, params: list, model_state: list) -> TrainState:
        """The step-0 state from the model's parameter and state leaves (copied, never
        aliasing the caller's buffers), with the optimizer initialised."""
        ...

    def step(self, state: TrainState, batch) -> tuple[TrainState, dict[str, float]]:
        """One update: the next state and ``{"loss", "grad_norm"}`` (loss before it).
        A NaN or infinite loss or gradient norm, or an update that would leave a parameter
        or optimizer state entry NaN or infinite, applies nothing: the state returned holds
        the values passed in, bit for bit, at the same ``step`` (the caller raises, see
        :func:`check_finite`); the arrays passed in may be donated either way."""
        ...

    def step_and_grads(self, state: TrainState, batch) -> tuple[TrainState, dict, list]:
        """:meth:`step`, also returning the gradients it applied (leaves gathered to host
        arrays): what a check against one device compares, at the cost of one program
        instead of a step and a :meth:`value_and_grad` compiled apart."""
        ...

    def eval(self, state: TrainState, batch) -> dict[str, float]:
        """``{"loss"}`` on ``batch`` without an update."""
        ...

    def value_and_grad(self, state: TrainState, batch) -> tuple[float, list]:
        """The loss and the gradients' leaves, gathered to host arrays."""
        ...

    def compiled(self, state: TrainState, batch) -> Any:
        """The compiled step (``.as_text()``, ``.memory_analysis()``)."""
        ...

    def comm_table(self) -> Any:
        """The collectives the plan implies per step (a :class:`CommTable`)."""
        ...

    def estimate(self, cluster: str | Cluster, expert_skew: float = 1.0) -> Estimate:
        """The cost model's prediction of this step on ``cluster`` (``expert_skew``: a
        mixture-of-experts router's load imbalance, as :func:`jscaler.estimate` takes it)."""
        ...

    def timeline(self, path: str, cluster: str | Cluster) -> Estimate:
        """Writes the predicted step as a Chrome trace or PNG; returns the estimate."""
        ...

    def global_batch(self, local_batch) -> Any:
        """The global batch in the plan's batch layout, from this process's rows."""
        ...

    def local_rows(self, batch_size: int | None = None) -> tuple[int, int]:
        """The rows of a global batch this process's devices hold."""
        ...


def check_finite(loss: float, grad_norm: float, step: int, applied: bool = True) -> None:
    """Raises :class:`NonFiniteLossError` for a NaN or infinite loss or gradient norm, or an
    update that was not applied (``applied=False``: it would have made a parameter or an
    optimizer state entry NaN or infinite)."""
    if math.isfinite(loss) and math.isfinite(grad_norm) and applied:
        return
    if not math.isfinite(loss):
        what = f"the loss is {loss}"
    elif not math.isfinite(grad_norm):
        what = f"the gradient norm is {grad_norm}"
    else:
        what = "the update is not finite (it would make a parameter NaN or infinite)"
    raise NonFiniteLossError(
        f"step {step}: {what} (loss {loss}, gradient norm {grad_norm}); the update was not "
        f"applied, the parameters and optimizer state are those after step {step - 1}. "
        f"Lower the learning rate, clip gradients (optax.clip_by_global_norm), check the "
        f"batch for NaNs, or compute in fp32",
        step,
    )


def optimizer_shardings(optimizer: optax.GradientTransformation, master, param_shardings, rep):
    """Where the optimizer state lives: each per-parameter leaf (a moment) with its
    parameter's update sharding (``param_shardings``, a tree like the parameters), every
    other leaf (a step count) on ``rep``. ``master``: the parameters' tree of shapes."""
    return optax.tree_map_params(
        optimizer,
        lambda _, s: s,
        jax.eval_shape(optimizer.init, master),
        param_shardings,
        transform_non_params=lambda _: rep,
    )


def _all_finite(tree):
    leaves = [x for x in jax.tree_util.tree_leaves(tree) if jnp.issubdtype(x.dtype, jnp.inexact)]
    return jnp.all(jnp.stack([jnp.isfinite(x).all() for x in leaves])) if leaves else True


def guarded_update(
    optimizer: optax.GradientTransformation, params, grads, opt_state, ok, extra=((), ())
):
    """The optax update of ``params`` (a tree) by ``grads``, applied in place when ``ok``
    (a traced bool: the loss and gradient norm are finite) and the update leaves every
    parameter and optimizer state entry finite; otherwise nothing changes.

    No second copy of the parameters or optimizer state is kept: a first pass reduces the
    updated values to one finite flag (XLA fuses each leaf's update into its reduction, so
    nothing parameter-sized is stored), then ``lax.cond`` either runs the update over the
    (donated) buffers or passes them through. ``extra = (new, old)``: two more trees (the
    model state after the step and before), the new one taken under the same flag.
    Returns (parameters, optimizer state, the extra tree, applied: a traced bool)."""

    def updated(p, g, s):
        updates, new_opt = optimizer.update(g, s, p)
        return optax.apply_updates(p, updates), new_opt

    # the barriers keep the probe's fusions apart from the update's: shared, XLA stored
    # parameter-sized intermediates for both (gpt-small, dp, adamw: +62 MB of temporaries)
    barrier = jax.lax.optimization_barrier
    ok = ok & _all_finite(updated(*barrier((params, grads, opt_state))))
    ok, params, grads, opt_state = barrier((ok, params, grads, opt_state))
    new_extra, old_extra = extra
    return *jax.lax.cond(
        ok,
        lambda p, g, s, e, _: (*updated(p, g, s), e),
        lambda p, g, s, _, e: (p, s, e),
        params, grads, opt_state, new_extra, old_extra,
    ), ok  # fmt: skip


def initial_state(optimizer, params_def, params: list, shardings: TrainState, model_state: list):
    """The step-0 TrainState: copies of ``params`` on ``shardings.params`` (never aliasing
    the caller's buffers), the optimizer initialised on ``shardings.opt_state``, and
    ``model_state`` as the program keeps it."""
    placed = [jax.device_put(jnp.array(x, copy=True), s) for x, s in zip(params, shardings.params)]
    tree = jax.tree_util.tree_unflatten(params_def, placed)
    opt = jax.jit(optimizer.init, out_shardings=shardings.opt_state)(tree)
    return TrainState(placed, opt, model_state)
