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
        A NaN or infinite loss or gradient norm applies no update: the state returned
        holds the values passed in, at the same step (the caller raises, see
        :func:`check_finite`); the arrays passed in may be donated either way."""
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

    def estimate(self, cluster: str | Cluster) -> Estimate:
        """The cost model's prediction of this step on ``cluster``."""
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


def check_finite(loss: float, grad_norm: float, step: int) -> None:
    """Raises :class:`NonFiniteLossError` for a NaN or infinite loss or gradient norm."""
    if math.isfinite(loss) and math.isfinite(grad_norm):
        return
    what = "loss" if not math.isfinite(loss) else "gradient norm"
    raise NonFiniteLossError(
        f"step {step}: the {what} is {loss if what == 'loss' else grad_norm} (loss {loss}, "
        f"gradient norm {grad_norm}); the update was not applied, the parameters are those "
        f"after step {step - 1}. Lower the learning rate, clip gradients "
        f"(optax.clip_by_global_norm), check the batch for NaNs, or compute in fp32",
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


def guarded_update(optimizer: optax.GradientTransformation, params, grads, opt_state, ok):
    """The optax update of ``params`` (a tree) by ``grads``, applied where ``ok`` (a traced
    bool: the loss and gradient norm are finite) and the old parameters and optimizer
    state kept where not. Returns (new parameters, new optimizer state)."""
    updates, new_opt = optimizer.update(grads, opt_state, params)
    new = optax.apply_updates(params, updates)
    keep = lambda a, b: jax.tree_util.tree_map(lambda x, y: jnp.where(ok, x, y), a, b)  # noqa: E731
    return keep(new, params), keep(new_opt, opt_state)


def initial_state(optimizer, params_def, params: list, shardings: TrainState, model_state: list):
    """The step-0 TrainState: copies of ``params`` on ``shardings.params`` (never aliasing
    the caller's buffers), the optimizer initialised on ``shardings.opt_state``, and
    ``model_state`` as the program keeps it."""
    placed = [jax.device_put(jnp.array(x, copy=True), s) for x, s in zip(params, shardings.params)]
    tree = jax.tree_util.tree_unflatten(params_def, placed)
    opt = jax.jit(optimizer.init, out_shardings=shardings.opt_state)(tree)
    return TrainState(placed, opt, model_state)
