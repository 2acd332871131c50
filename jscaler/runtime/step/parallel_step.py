"""``@jscaler.parallelize_step``: parallelise an existing train step without rewriting it.

The step keeps its code; ``jax.value_and_grad`` becomes :func:`jscaler.value_and_grad`,
which marks the loss. Once per new argument structure and shape the wrapper

1. runs the step abstractly (at micro-batch shape) with ``value_and_grad`` recording:
   the loss as a graph over the differentiated parameters and the traced values it
   closes over. Those computed from the batch argument, with the batch on axis 0, are
   the graph's batch inputs; the others (a step counter, a key) are replicated inputs;
2. plans that graph (a space, a Plan, ``"dp"``, ``"auto"``), validates and lowers it;
3. jits the whole step once: parameters in the plan's storage layouts, optimizer state
   (leaves whose path ends with a parameter's path and shape) in its update layout, the
   batch in the plan's batch layouts, everything else replicated. In that program
   ``value_and_grad`` runs the loss with the plan (``Lowered.forward``) and JAX autodiff,
   accumulating over micro-batches; the user's update and metrics follow by GSPMD, and the
   new state leaves in the layouts it came in (same path, shape and dtype).

nnx Modules and Optimizers passed as arguments are updated in place, as ``nnx.jit`` does.

A pipeline plan cannot run as one program; :mod:`jscaler.runtime.step.pipeline` splits
the step at ``value_and_grad`` instead (Alpa's two-part step).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from types import MappingProxyType

import jax
import jax.numpy as jnp
from flax import nnx

from jscaler.errors import PlanError, TraceError
from jscaler.plan.kind import AnyPlan
from jscaler.runtime.builder import prepare, resolve_devices, resolve_plan
from jscaler.runtime.step.layouts import place
from jscaler.runtime.step.pipeline import compile_pipeline
from jscaler.runtime.step.record import (
    Traced,
    arg_name,
    aux_avals,
    aval_key,
    loss_graph,
    mutables,
    record,
    struct,
)
from jscaler.runtime.step.spmd import compile_spmd

__all__ = ["ParallelStep", "parallelize_step"]


def parallelize_step(
    fn: Callable | None = None,
    *,
    plan="dp",
    devices=None,
    microbatches: int = 1,
    schedule=None,
    batch_argnum: int = -1,
    donate: bool = True,
):
    """Parallelises an existing training step according to a plan.

    The step keeps its single-device code, with :func:`jscaler.value_and_grad` (or
    :func:`jscaler.grad`) where it had ``jax.value_and_grad``. It is traced, planned and
    compiled once per new argument structure and shapes, then runs as one jitted SPMD
    program.

    Under a pipeline plan (``megatron(pp=2, dp=4)``) the step runs in two parts, as Alpa
    splits it: the loss and its gradients on the pipeline's stages, ``microbatches``
    micro-batches walked by ``schedule``, outside jit; then the whole step in one jit over
    every pipeline device, with ``value_and_grad`` returning those loss and gradients, so
    the update is the step's own. Parameters and optimizer state stay split over every
    pipeline device (each stage receives its parameters from them every step).

    Args:
      fn: ``step(*args)``; ``args[batch_argnum]`` is the batch (each leaf split on axis 0),
        the others the training state: a ``flax.training.train_state.TrainState`` (return
        the new one), or an nnx Module and ``nnx.Optimizer`` (updated in place).
      plan: a space (``spaces.megatron(tp=2, dp=4)``), a :class:`Plan`, a plan's JSON
        path, ``"dp"`` (default) or ``"auto"``, applied to the graph of the loss; a
        pipeline plan (``megatron(pp=2)``) as above.
      devices: None (all), an int (the first N of ``jax.devices()``), or a list.
      microbatches: gradient accumulation inside ``value_and_grad``: the batch values the
        loss closes over are split on axis 0 and their gradients summed (loss and
        floating aux averaged); a pipeline's micro-batches.
      schedule: for a pipeline plan, a function ``(groups, microbatches) -> Schedule``
        from ``schedules`` or a :class:`Schedule` (default the plan's own, else
        ``one_f_one_b``), as :func:`jscaler.parallelize` takes it.
      batch_argnum: which positional argument is the batch (default the last).
      donate: donate the state arguments' buffers (the arrays passed in are consumed).

    Returns:
      A :class:`ParallelStep`, called like ``fn``.

    Constraints: the loss is found by its one ``value_and_grad`` call per step, made at
    the step's top level (not inside ``jax.lax.scan``/``vmap`` or your own ``jax.jit``);
    values it closes over that come from the batch keep the batch on axis 0. Under a
    pipeline, the loss may not update model state (an nnx model's non-parameter
    variables: BatchNorm statistics) nor return aux; both raise :class:`PlanError`.

    Example::

        @jscaler.parallelize_step(plan=megatron(tp=2, dp=4), devices=8)
        def train_step(state, batch):
            def loss_fn(params):
                return mse(state.apply_fn({"params": params}, batch["x"]), batch["y"])

            loss, grads = jscaler.value_and_grad(loss_fn)(state.params)
            return state.apply_gradients(grads=grads), {"loss": loss}

        state, metrics = train_step(state, batch)
    """
    if isinstance(microbatches, bool) or not isinstance(microbatches, int) or microbatches < 1:
        raise PlanError(f"microbatches must be a positive int, got {microbatches!r}")

    def wrap(f):
        return ParallelStep(f, plan, devices, microbatches, schedule, batch_argnum, donate)

    return wrap if fn is None else wrap(fn)


class ParallelStep:
    """A train step run under a plan. Made by :func:`parallelize_step`.

    Attributes:
      compiles: how many argument signatures have been traced, planned and compiled.
    """

    def __init__(self, fn, plan, devices, microbatches, schedule, batch_argnum, donate):
        functools.update_wrapper(self, fn)
        self._fn = fn
        self._space = plan
        self._devices_arg = devices
        self._m = microbatches
        self._schedule = schedule
        self._batch_argnum = batch_argnum
        self._donate = donate
        self._cache: dict = {}
        self.compiles = 0

    def __call__(self, *args, **kwargs):
        if kwargs:
            raise TypeError(
                f"a parallelize_step step takes positional arguments only; got "
                f"{sorted(kwargs)} by keyword"
            )
        leaves, entry = self._entry(args)
        placed = [place(x, s) for x, s in zip(leaves, entry.in_shardings)]
        out, new = entry.run(placed)
        for i, start, end, sub in entry.mutable:  # nnx objects: updated in place
            nnx.update(args[i], nnx.state(jax.tree_util.tree_unflatten(sub, new[start:end])))
        return out

    @property
    def programs(self) -> Mapping:
        """The compiled step per argument signature (an SPMD or a pipeline entry, each with
        its ``plan``)."""
        return MappingProxyType(self._cache)

    def plan(self, *args) -> AnyPlan:
        """The validated plan the step runs for these arguments (traced if new)."""
        return self._entry(args)[1].plan

    def _entry(self, args):
        """The arguments' leaves and the program for their structure and shapes."""
        leaves, tdef = jax.tree_util.tree_flatten(args)
        key = (tdef, tuple(aval_key(x) for x in leaves))
        entry = self._cache.get(key)
        if entry is None:
            entry = self._cache[key] = self._compile(args, tdef)
            self.compiles += 1
        return leaves, entry

    # ---- tracing and planning --------------------------------------------------------

    def _compile(self, args: tuple, tdef):
        devices = resolve_devices(self._devices_arg)
        bi = self._batch_argnum
        if not -len(args) <= bi < len(args):
            raise TraceError(
                f"batch_argnum={bi}, but the step was called with {len(args)} arguments"
            )
        bi %= len(args)
        if getattr(self._space, "precision", "fp32") != "fp32":
            raise PlanError(
                "parallelize_step runs the step in the dtypes it is written in; drop the "
                "space's precision= (cast inside your loss instead) or use jscaler.parallelize"
            )
        pairs = jax.tree_util.tree_flatten_with_path(args)[0]
        paths = [p for p, _ in pairs]
        owner = [p[0].idx for p in paths]  # the argument each leaf belongs to
        full = [struct(x) for _, x in pairs]
        micro = self._micro(full, owner, bi, paths)
        cap, graph, src, out_shape = self._trace(tdef, micro, owner, bi, paths)
        plan = resolve_plan(self._space, graph, len(devices))
        if self._m > 1:  # the results at the full batch's shape
            out_shape = record(self._fn, tdef, full, owner, bi)[3]
        traced = Traced(
            self._fn, tdef, tuple(full), tuple(micro), tuple(paths), tuple(owner), bi,
            out_shape, mutables(args, owner), cap, graph, tuple(src), self._m, self._donate,
        )  # fmt: skip
        ready = prepare(plan, devices, microbatches=self._m, schedule=self._schedule)
        # Alpa's two-part step under a pipeline (see jscaler.runtime.step.pipeline)
        return (compile_pipeline if plan.is_pipeline else compile_spmd)(traced, ready)

    def _micro(self, full, owner, bi, paths) -> list:
        """The argument shapes with batch leaves at micro-batch size."""
        m, micro = self._m, list(full)
        for k, s in enumerate(full):
            if owner[k] != bi or s.ndim == 0 or m == 1:
                continue
            if s.shape[0] % m:
                raise PlanError(
                    f"batch leaf {arg_name(self._fn, bi, paths[k])} has shape "
                    f"{tuple(s.shape)}: its axis 0 must split into {m} micro-batches; "
                    f"use a batch size divisible by {m}"
                )
            micro[k] = jax.ShapeDtypeStruct((s.shape[0] // m, *s.shape[1:]), s.dtype)
        return micro

    def _trace(self, tdef, micro, owner, bi, paths):
        """The capture of the loss at micro-batch shape, its graph, the argument leaf each
        graph input is (or None) and the step's result shapes. A value the loss closes
        over is a batch input when it is computed from the batch and has as many rows as
        a batch leaf."""
        cap, src, from_batch, out_shape = record(self._fn, tdef, micro, owner, bi)
        if self._m > 1 and any(not jnp.issubdtype(a.dtype, jnp.floating) for a in aux_avals(cap)):
            raise TraceError(
                f"with microbatches={self._m} the loss's aux is averaged over micro-batches, "
                f"so its leaves must be floating; got {[str(a.dtype) for a in aux_avals(cap)]}"
            )
        n_ps = len(cap.params) + len(cap.state)
        rows = {s.shape[0] for k, s in enumerate(micro) if owner[k] == bi and s.ndim}
        roles, names = [], []
        for j, aval in enumerate(cap.avals()[n_ps:]):
            batchy = from_batch[n_ps + j] and aval.ndim >= 1 and aval.shape[0] in rows
            roles.append("batch" if batchy else "state")
            k = src[n_ps + j]
            names.append(
                arg_name(self._fn, owner[k], paths[k]) if k is not None else f"closure/{j}"
            )
        return cap, loss_graph(cap, roles, names), src, out_shape
