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

A pipeline plan cannot run as one program; :mod:`jscaler.runtime.step_pipeline` splits
the step at ``value_and_grad`` instead (Alpa's two-part step).
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import jax
import jax.extend.core as jcore
import jax.numpy as jnp
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from jscaler.compile.lower import Lowered, lower
from jscaler.errors import PlanError, TraceError
from jscaler.ir.build import Builder
from jscaler.ir.trace import Signature
from jscaler.plan.pipeline import PipelinePlan
from jscaler.plan.plan import Plan
from jscaler.plan.validate import validate
from jscaler.runtime.autodiff import Captured, handling, key_names
from jscaler.runtime.distributed import check_plan_agreement
from jscaler.runtime.parallelize import resolve_devices, resolve_plan
from jscaler.runtime.step_run import Planned, StepRunner

__all__ = ["ParallelStep", "parallelize_step"]

_NOT_CALLED = (
    "the step never called jscaler.value_and_grad (or jscaler.grad): write "
    "jscaler.value_and_grad where you had jax.value_and_grad, so parallelize_step knows "
    "which function is the loss"
)
_NOT_TOP_LEVEL = (
    "jscaler.value_and_grad must be called at the top level of the step, not inside "
    "jax.lax.scan, vmap, cond or a jax.jit of your own (parallelize_step jits the whole step "
    "and accumulates micro-batches itself: pass microbatches=)"
)


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


@dataclass(frozen=True, eq=False)
class _Compiled:
    planned: Planned
    jitted: Any
    in_shardings: tuple
    mutable: tuple[tuple[int, int, int, Any], ...]  # (arg, first leaf, end leaf, treedef)

    @property
    def plan(self) -> Plan:
        return self.planned.low.plan

    def run(self, placed: list):
        """(the step's result, the nnx objects' new leaves) from the placed leaves."""
        return self.jitted(*placed)


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
        placed = [_place(x, s) for x, s in zip(leaves, entry.in_shardings)]
        out, new = entry.run(placed)
        for i, start, end, sub in entry.mutable:  # nnx objects: updated in place
            nnx.update(args[i], nnx.state(jax.tree_util.tree_unflatten(sub, new[start:end])))
        return out

    def plan(self, *args) -> Plan | PipelinePlan:
        """The validated plan the step runs for these arguments (traced if new)."""
        return self._entry(args)[1].plan

    def _entry(self, args):
        """The arguments' leaves and the program for their structure and shapes."""
        leaves, tdef = jax.tree_util.tree_flatten(args)
        key = (tdef, tuple(_aval_key(x) for x in leaves))
        entry = self._cache.get(key)
        if entry is None:
            entry = self._cache[key] = self._compile(args, tdef)
            self.compiles += 1
        return leaves, entry

    # ---- tracing and planning --------------------------------------------------------

    def _compile(self, args: tuple, tdef) -> _Compiled:
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
        full = [_struct(x) for _, x in pairs]
        micro = self._micro(full, owner, bi, paths)
        cap, graph, src, out_shape = self._trace(tdef, micro, owner, bi, paths)
        plan = resolve_plan(self._space, graph, len(devices))
        mut_args, mutated, mutable = _mutables(args, owner)
        if self._m > 1:  # the results at the full batch's shape
            out_shape = _record(self._fn, tdef, full, owner, bi)[3]
        if isinstance(plan, PipelinePlan):  # Alpa's two-part step (see step_pipeline)
            from jscaler.runtime.step_pipeline import compile_pipeline

            return compile_pipeline(
                self, plan, devices, cap, graph, src, tdef, full, paths, owner, bi,
                out_shape, (mut_args, mutated, mutable),
            )  # fmt: skip
        if self._schedule is not None:
            raise PlanError(
                f"schedule= orders pipeline stages, but the plan {plan.name or ''!r} has none; "
                f"use a plan with pp > 1 (e.g. megatron(pp=2)) or drop schedule="
            )
        validate(plan, n_devices=len(devices))
        check_plan_agreement(plan, None, devices)  # multi-process: all run the same plan
        low = lower(plan, devices)
        roles = [graph.tensors[t].role for t in graph.inputs][len(cap.params) + len(cap.state) :]
        planned = Planned(low, self._m, cap.avals(), cap.out_avals(), roles, cap.n_aux)
        in_sh = _in_shardings(low, cap, src, micro, paths, owner, bi)
        rep = NamedSharding(low.mesh, PartitionSpec())
        out_sh, returned = _out_shardings(_followers(low, cap), rep, out_shape, paths, full, in_sh)
        pure = _pure(self._fn, tdef, len(full), mut_args, lambda: StepRunner(planned))
        # donate what comes back (the state returned, nnx objects), never the batch
        donated = [k for k in sorted(returned | set(mutated)) if owner[k] != bi]
        jitted = jax.jit(
            pure,
            in_shardings=tuple(in_sh),
            out_shardings=(out_sh, [in_sh[k] for k in mutated]),
            donate_argnums=tuple(donated) if self._donate else (),
        )
        return _Compiled(planned, jitted, tuple(in_sh), tuple(mutable))

    def _micro(self, full, owner, bi, paths) -> list:
        """The argument shapes with batch leaves at micro-batch size."""
        m, micro = self._m, list(full)
        for k, s in enumerate(full):
            if owner[k] != bi or s.ndim == 0 or m == 1:
                continue
            if s.shape[0] % m:
                raise PlanError(
                    f"batch leaf {_arg_name(self._fn, bi, paths[k])} has shape "
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
        cap, src, from_batch, out_shape = _record(self._fn, tdef, micro, owner, bi)
        if self._m > 1 and any(not jnp.issubdtype(a.dtype, jnp.floating) for a in _aux(cap)):
            raise TraceError(
                f"with microbatches={self._m} the loss's aux is averaged over micro-batches, "
                f"so its leaves must be floating; got {[str(a.dtype) for a in _aux(cap)]}"
            )
        n_ps = len(cap.params) + len(cap.state)
        rows = {s.shape[0] for k, s in enumerate(micro) if owner[k] == bi and s.ndim}
        roles, names = [], []
        for j, aval in enumerate(cap.avals()[n_ps:]):
            batchy = from_batch[n_ps + j] and aval.ndim >= 1 and aval.shape[0] in rows
            roles.append("batch" if batchy else "state")
            k = src[n_ps + j]
            names.append(
                _arg_name(self._fn, owner[k], paths[k]) if k is not None else f"closure/{j}"
            )
        return cap, _graph(cap, roles, names), src, out_shape


def _mutables(args, owner):
    """nnx objects are mutated in place: their leaves come back as a second result.
    Returns the arguments that are, their leaves' indices, and per argument (arg, first
    leaf, end leaf in that second result, treedef)."""
    mut_args = [i for i, a in enumerate(args) if isinstance(a, nnx.Pytree)]
    mutated = [k for k in range(len(owner)) if owner[k] in mut_args]
    mutable, at = [], 0
    for i in mut_args:
        n = owner.count(i)
        mutable.append((i, at, at + n, jax.tree_util.tree_structure(args[i])))
        at += n
    return mut_args, mutated, tuple(mutable)


def _pure(fn, tdef, n_leaves: int, mut_args, make_handler):
    """The step as a function of its leaves (then ``make_handler``'s arguments): returns
    its result and the nnx objects' leaves; ``value_and_grad`` calls the handler."""

    def pure(*flat):
        a = jax.tree_util.tree_unflatten(tdef, flat[:n_leaves])
        handler = make_handler(*flat[n_leaves:])
        with handling(handler):
            out = fn(*a)
        if handler.calls == 0:
            raise TraceError(_NOT_CALLED)
        return out, [x for i in mut_args for x in jax.tree_util.tree_leaves(a[i])]

    return pure


class _Recorder:
    def __init__(self):
        self.captured: Captured | None = None

    def __call__(self, cap: Captured):
        if self.captured is not None:
            raise TraceError(
                "jscaler.value_and_grad was called twice in one step; parallelize_step plans "
                "one loss per step: compute all loss terms in one function"
            )
        self.captured = cap
        outs = cap.out_avals()
        zeros = [jnp.zeros(a.shape, a.dtype) for a in outs[: 1 + cap.n_aux]]
        grads = [jnp.zeros_like(p) for p in cap.params]
        return cap.unflatten(zeros[0], zeros[1:], grads)


def _record(fn, tdef, avals, owner, bi):
    """Runs the step abstractly with value_and_grad recording. Returns the capture, the
    argument leaf each recorded input is (or None), whether it depends on the batch, and
    the step's output shapes."""
    recorder = _Recorder()

    def probe(*leaves):
        with handling(recorder):
            out = fn(*jax.tree_util.tree_unflatten(tdef, leaves))
        cap = recorder.captured
        if cap is None:
            raise TraceError(_NOT_CALLED)
        return out, [*cap.params, *cap.state, *cap.extras]

    try:
        closed, shape = jax.make_jaxpr(probe, return_shape=True)(*avals)
    except jax.errors.UnexpectedTracerError as e:
        raise TraceError(_NOT_TOP_LEVEL) from e
    jaxpr = closed.jaxpr
    n_out = len(jax.tree_util.tree_leaves(shape[0]))
    recorded = jaxpr.outvars[n_out:]
    if any(isinstance(c, jax.core.Tracer) for c in closed.consts):  # escaped an inner trace
        raise TraceError(_NOT_TOP_LEVEL)
    index = {v: k for k, v in enumerate(jaxpr.invars)}
    batch_vars = {v for k, v in enumerate(jaxpr.invars) if owner[k] == bi}
    dependent = _dependents(jaxpr, batch_vars)
    src = [index.get(v) if isinstance(v, jcore.Var) else None for v in recorded]
    from_batch = [isinstance(v, jcore.Var) and v in dependent for v in recorded]
    return recorder.captured, src, from_batch, shape[0]


def _dependents(jaxpr, sources: set) -> set:
    """The variables of ``jaxpr`` computed from ``sources`` (an equation's outputs depend on
    all of its inputs)."""
    dep = set(sources)
    for eqn in jaxpr.eqns:
        if any(isinstance(v, jcore.Var) and v in dep for v in eqn.invars):
            dep.update(eqn.outvars)
    return dep


def _graph(cap: Captured, extra_roles, extra_names):
    roles = ["param"] * len(cap.params) + ["state"] * len(cap.state) + extra_roles
    names = cap.param_names + cap.state_names + extra_names
    b = Builder(strict=True)
    ins = [b.new_tensor(v.aval, r, n) for v, r, n in zip(cap.jaxpr.invars, roles, names)]
    outs = b.convert(cap.jaxpr, cap.consts, ins)
    extras_def = jax.tree_util.tree_structure(list(range(len(extra_roles))))
    sig = Signature(cap.kind, cap.graphdef, cap.params_def, cap.state_def, extras_def)
    return b.graph(ins, outs, sig)


# ---- layouts of the step's arguments and results --------------------------------------


def _in_shardings(low: Lowered, cap: Captured, src, micro, paths, owner, bi) -> list:
    """Plan inputs in their storage layouts; optimizer-state-like leaves in their
    parameter's update layout; other batch leaves split on axis 0 as the plan splits batch
    inputs with as many rows (the loss may read them through a computation); everything
    else replicated."""
    stored = low.input_shardings()
    out: list = [None] * len(micro)
    for i, k in enumerate(src):
        if k is not None and out[k] is None:
            out[k] = stored[i]
    g = low.plan.pgraph.graph
    rows = {}
    for t, sh in zip(g.inputs, stored):
        shape = g.tensors[t].shape
        if g.tensors[t].role == "batch" and shape and sh.spec:
            rows.setdefault(shape[0], NamedSharding(low.mesh, PartitionSpec(sh.spec[0])))
    follow = _followers(low, cap)
    rep = NamedSharding(low.mesh, PartitionSpec())
    for k, s in enumerate(micro):
        if out[k] is not None:
            continue
        if owner[k] == bi:
            out[k] = rows.get(s.shape[0], rep) if s.ndim else rep
        else:
            out[k] = _follow(follow, paths[k][1:], s, rep)
    return out


def _out_shardings(follow: dict, rep, out_shape, arg_paths, full, in_sh):
    """A result at an argument's path (after the first step: ``(new_state, metrics)``
    returns the state at ``[0]``, as it came in) with its shape and dtype keeps that
    argument's layout; other results follow a parameter's update layout (``follow``, see
    :func:`_follow`) or replicate. Returns the shardings and the argument leaves returned
    so."""
    by_path = {tuple(key_names(p[1:])): k for k, p in enumerate(arg_paths)}
    pairs, tdef = jax.tree_util.tree_flatten_with_path(out_shape)
    shardings, returned = [], set()
    for path, s in pairs:
        names = key_names(path)
        k = by_path.get(tuple(names[1:]), by_path.get(tuple(names)))
        if k is not None and (full[k].shape, full[k].dtype) == (s.shape, s.dtype):
            shardings.append(in_sh[k])
            returned.add(k)
        else:
            shardings.append(_follow(follow, path, s, rep))
    return jax.tree_util.tree_unflatten(tdef, shardings), returned


def _followers(low: Lowered, cap: Captured) -> dict:
    g = low.plan.pgraph.graph
    ids = [t for t in g.inputs if g.tensors[t].role == "param"]
    return {
        tuple(name.split("/")): (tuple(g.tensors[t].shape), low.sharding(low.update[t]))
        for name, t in zip(cap.param_names, ids)
    }


def _follow(follow: dict, path, s, default):
    """The layout of the parameter whose path ends ``path`` with ``s``'s shape (an
    optimizer state leaf's), else ``default``; ``follow``: parameter path -> (shape,
    sharding)."""
    names = key_names(path)
    for start in range(len(names)):
        hit = follow.get(tuple(names[start:]))
        if hit is not None and hit[0] == tuple(s.shape):
            return hit[1]
    return default


def _place(x, sharding):
    """``x`` on ``sharding``: itself when it is there already (then donated, as
    ``jax.jit(donate_argnums=...)`` would), else a copy (never aliasing the caller's
    buffers, which stay valid)."""
    if not isinstance(x, jax.Array):
        return jax.device_put(x, sharding)
    if x.sharding == sharding:
        return x
    # device_put may alias a shard it need not move (even with may_alias=False)
    return jax.device_put(jnp.array(x, copy=True), sharding)


def _aux(cap: Captured):
    return cap.out_avals()[1 : 1 + cap.n_aux]


def _struct(x) -> jax.ShapeDtypeStruct:
    if isinstance(x, jax.ShapeDtypeStruct):
        return x
    aval = jax.typeof(x)
    return jax.ShapeDtypeStruct(aval.shape, aval.dtype, weak_type=aval.weak_type)


def _aval_key(x) -> tuple:
    s = _struct(x)
    return (tuple(s.shape), str(s.dtype), bool(s.weak_type))


def _arg_name(fn, i: int, path) -> str:
    try:
        names = list(inspect.signature(fn).parameters)
    except (TypeError, ValueError):
        names = []
    head = names[i] if i < len(names) else f"arg{i}"
    return "/".join([head, *key_names(path[1:])])
