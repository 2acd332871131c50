"""``parallelize_step`` under a pipeline plan: Alpa's two-part step.

A pipeline's stages are separate programs on separate device groups, so the step cannot
be one jitted program. :func:`jscaler.value_and_grad` marks where it splits:

A. (MPMD, outside jit) the values the loss reads are computed from the step's arguments
   (a small jitted *prelude*: the step run up to its ``value_and_grad`` call, the rest
   dropped by XLA); each stage receives its parameters from them, and the pipeline
   runtime (:class:`jscaler.runtime.pipeline.StageDriver`) runs
   the schedule over the micro-batches, returning the mean loss and the gradients on the
   update mesh of every pipeline device;
B. (one jit over every pipeline device) the user's step runs as written, its
   ``value_and_grad`` returning those loss and gradients, so the optimizer update,
   metrics and ``TrainState`` bookkeeping are the user's own. Parameters and optimizer
   state stay in the update layout (split over every pipeline device, as a
   pipeline program's master parameters): nothing is gathered to one device.

As under ``jscaler.parallelize``, the loss may not update model state (an nnx model's
non-parameter variables, e.g. BatchNorm statistics), nor return aux.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from jscaler.errors import PlanError, TraceError
from jscaler.plan.pipeline import PipelinePlan
from jscaler.runtime.builder import Prepared
from jscaler.runtime.pipeline import StageDriver
from jscaler.runtime.step.autodiff import Captured, handling
from jscaler.runtime.step.layouts import follow, out_shardings
from jscaler.runtime.step.record import NOT_CALLED, Recorder, Traced, pure_step
from jscaler.runtime.step.spmd import check_captured, once_per_step

__all__ = ["PipelineEntry", "compile_pipeline"]


class _Given:
    """The handler ``value_and_grad`` calls in part B: the loss and gradients of part A
    (the gradients summed over the stages reading each parameter)."""

    def __init__(self, handoff, loss, contributions):
        self.handoff, self.loss, self.contributions = handoff, loss, contributions
        self.calls = 0

    def __call__(self, cap: Captured):
        self.calls = once_per_step(self.calls)
        h = self.handoff
        grads = [
            jax.lax.with_sharding_constraint(h.reduce(parts).astype(p.dtype), sh)
            for parts, p, sh in zip(self.contributions, cap.params, h.master)
        ]
        return cap.unflatten(self.loss.astype(cap.out_avals()[0].dtype), [], grads)


@dataclass(frozen=True, eq=False)
class PipelineEntry:
    """The compiled two-part step for one argument signature."""

    plan: PipelinePlan
    driver: StageDriver
    prelude: Any  # placed leaves -> (params in the update layout, extras, stacked params)
    jitted: Any  # placed leaves, loss, contributions -> (result, nnx objects' leaves)
    in_shardings: tuple
    mutable: tuple
    extra_ids: tuple  # the graph input each value the loss closes over is
    extra_roles: tuple

    def run(self, placed: list):
        params, extras, stacked = self.prelude(*placed)
        handoff = self.driver.handoff
        stage_params = handoff.stage_params(params, stacked)
        host = [np.asarray(x.addressable_data(0)) for x in extras]  # replicated
        state, batch = {}, {}
        for t, role, x in zip(self.extra_ids, self.extra_roles, host):
            (batch if role == "batch" else state)[t] = x
        loss, grads = self.driver.run(stage_params, self.driver.stage_state(state), batch)
        contributions = handoff.gradients(grads)
        loss = jax.device_put(np.float32(loss), handoff.rep)
        return self.jitted(*placed, loss, contributions)


def compile_pipeline(t: Traced, ready: Prepared) -> PipelineEntry:
    """The two-part step of ``t`` under the checked pipeline plan."""
    plan, cap, graph = ready.plan, t.cap, t.graph
    if cap.n_aux:
        raise PlanError(
            f"the plan {plan.name or ''!r} is a pipeline, and its stages return the loss "
            f"alone: drop has_aux=True from jscaler.value_and_grad (compute the aux after "
            f"it in the step), or use a plan without pp"
        )
    if cap.state:
        raise PlanError(
            f"the plan {plan.name or ''!r} is a pipeline, which trains models without "
            f"mutable state; the loss's model has {len(cap.state)} non-parameter "
            f"variable(s) (e.g. {cap.state_names[0]!r}: BatchNorm statistics, RNG counts). "
            f"Use a plan without pp"
        )
    driver = StageDriver(graph, plan, ready.schedule, list(ready.devices))
    handoff = driver.handoff
    src, owner, bi, full, paths = t.src, t.owner, t.batch_argnum, t.full, t.paths
    n_p = len(cap.params)
    ids = list(graph.inputs[n_p:])
    roles = [graph.tensors[t].role for t in ids]
    # part B's layouts: parameters and their optimizer state as the update stores them
    layouts = {
        tuple(name.split("/")): (tuple(a.shape), sh)
        for name, a, sh in zip(cap.param_names, cap.avals(), handoff.master)
    }
    in_sh = []
    for k, s in enumerate(full):
        if k in src[:n_p]:
            in_sh.append(handoff.master[src.index(k)])
        elif owner[k] == bi:
            in_sh.append(_rows(handoff, s))
        else:
            in_sh.append(follow(layouts, paths[k][1:], s, handoff.rep))
    out_sh, returned = out_shardings(layouts, handoff.rep, t.out_shape, paths, full, in_sh)
    mut_args, mutated, mutable = t.mut
    fn, tdef, n, m = t.fn, t.tdef, len(full), t.microbatches
    in_avals, extra_roles = cap.avals(), roles

    def prelude(*leaves):
        recorder = Recorder()
        with handling(recorder):
            fn(*jax.tree_util.tree_unflatten(tdef, leaves))
        got = recorder.captured
        if got is None:
            raise TraceError(NOT_CALLED)
        vals = [*got.params, *got.state, *got.extras]
        check_captured(in_avals, extra_roles, m, got, vals)
        return vals[:n_p], vals[n_p:], handoff.broadcast(vals[:n_p])

    pure = pure_step(fn, tdef, n, mut_args, lambda loss, parts: _Given(handoff, loss, parts))
    return PipelineEntry(
        plan,
        driver,
        jax.jit(
            prelude,
            in_shardings=tuple(in_sh),
            out_shardings=(list(handoff.master), [handoff.rep] * len(ids), None),
        ),
        jax.jit(
            pure,
            in_shardings=(*in_sh, handoff.rep, None),
            out_shardings=(out_sh, [in_sh[k] for k in mutated]),
            donate_argnums=t.donated(returned),
        ),
        tuple(in_sh),
        mutable,
        tuple(ids),
        tuple(roles),
    )


def _rows(handoff, s) -> NamedSharding:
    """A batch leaf in part B: split on axis 0 over every pipeline device where it
    divides, else replicated."""
    mesh = handoff.mesh
    if s.ndim and s.shape[0] % mesh.size == 0:
        axes = mesh.axis_names
        return NamedSharding(mesh, PartitionSpec(axes if len(axes) > 1 else axes[0]))
    return handoff.rep
