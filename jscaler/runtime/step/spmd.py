"""``parallelize_step`` under a single-program plan: the whole step as one jitted program.

:func:`compile_spmd` lowers the plan and jits the step: parameters in the plan's storage
layouts, optimizer state in its update layout, the batch in its batch layouts
(:mod:`jscaler.runtime.step.layouts`). The loss inside runs with the plan:

Inside the jitted step, :func:`jscaler.value_and_grad` hands its capture to a
:class:`StepRunner`: the captured inputs (parameters, an nnx model's other variables, the
traced values the loss closes over) are laid out as the plan stores them, the loss runs
as ``Lowered.forward`` under JAX autodiff, and the gradients leave in the plan's gradient
then update layouts, as :class:`jscaler.Trainer` lays them out. With micro-batches, the
batch inputs are split on axis 0 (locally to each data-parallel shard) and scanned over.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import jax
from jax.sharding import NamedSharding, PartitionSpec

from jscaler.compile.lower import Lowered
from jscaler.errors import TraceError
from jscaler.plan.plan import Plan
from jscaler.runtime.batch import accumulate
from jscaler.runtime.builder import Prepared
from jscaler.runtime.step.autodiff import Captured
from jscaler.runtime.step.layouts import followers, in_shardings, out_shardings
from jscaler.runtime.step.record import Traced, pure_step

__all__ = ["Planned", "SpmdEntry", "StepRunner", "check_captured", "compile_spmd"]


@dataclass(frozen=True, eq=False)
class Planned:
    """What a step was planned with: the lowered plan, the micro-batch count, the loss
    graph's input and output shapes (at micro-batch shape) and the roles of the values the
    loss closes over (``batch``: split on axis 0; ``state``: whole)."""

    low: Lowered
    microbatches: int
    in_avals: list
    out_avals: list
    extra_roles: list[str]
    n_aux: int


def once_per_step(calls: int) -> int:
    """``calls + 1``; a TraceError on a second ``value_and_grad`` call in one step."""
    if calls:
        raise TraceError(
            "jscaler.value_and_grad was called twice in one step; parallelize_step plans "
            "one loss per step: compute all loss terms in one function"
        )
    return calls + 1


class StepRunner:
    """The handler ``value_and_grad`` calls inside the jitted step (once per step)."""

    def __init__(self, planned: Planned):
        self.planned = planned
        self.calls = 0

    def __call__(self, cap: Captured):
        self.calls = once_per_step(self.calls)
        p, low, m = self.planned, self.planned.low, self.planned.microbatches
        vals = [*cap.params, *cap.state, *cap.extras]
        check_captured(p.in_avals, p.extra_roles, m, cap, vals)
        shard = low.input_shardings()
        vals = [jax.lax.with_sharding_constraint(v, s) for v, s in zip(vals, shard)]
        n_p, n_s = len(cap.params), len(cap.state)
        params, state, extras = vals[:n_p], vals[n_p : n_p + n_s], vals[n_p + n_s :]
        g = low.plan.pgraph.graph
        ids = [t for t in g.inputs if g.tensors[t].role == "param"]
        grad_sh = [low.sharding(low.grad[t]) for t in ids]
        n_aux = p.n_aux

        def one(params, state, extras):
            outs = low.forward(*params, *state, *extras)
            return outs[0], (list(outs[1 : 1 + n_aux]), list(outs[1 + n_aux :]))

        vg = jax.value_and_grad(one, has_aux=True)

        def reduce(gs):
            return [jax.lax.with_sharding_constraint(x, s) for x, s in zip(gs, grad_sh)]

        loss, aux, state, grads = accumulate(
            vg, params, state, extras,
            m=m, batch=[j for j, r in enumerate(p.extra_roles) if r == "batch"],
            shardings=shard[n_p + n_s :], reduce=reduce, loss_dtype=p.out_avals[0].dtype,
            aux_avals=p.out_avals[1 : 1 + n_aux],
        )  # fmt: skip
        grads = [
            jax.lax.with_sharding_constraint(x, low.sharding(low.update[t]))
            for x, t in zip(grads, ids)
        ]
        cap.finish(state)
        return cap.unflatten(loss, aux, grads)


def check_captured(in_avals, extra_roles, microbatches: int, cap: Captured, vals) -> None:
    """The values captured now are those planned (``in_avals``; the ``batch`` ones
    ``microbatches`` times as many rows)."""
    n_ps = len(cap.params) + len(cap.state)
    if len(vals) != len(in_avals):
        raise TraceError(
            f"the loss reads {len(vals) - n_ps} traced values from the step when run but "
            f"{len(in_avals) - n_ps} when it was planned; its closure must not depend on "
            f"the batch size"
        )
    roles = ["param"] * n_ps + extra_roles
    for k, (v, want, role) in enumerate(zip(vals, in_avals, roles)):
        shape = tuple(want.shape)
        if role == "batch":
            shape = (shape[0] * microbatches, *shape[1:])
        if tuple(v.shape) != shape or v.dtype != want.dtype:
            what = "a parameter" if k < len(cap.params) else f"input {k - n_ps}"
            raise TraceError(
                f"the loss's {what} is {v.dtype}{list(v.shape)} when run but was planned as "
                f"{want.dtype}{list(shape)}; values it closes over that come from the batch "
                f"must keep the batch on axis 0"
            )


@dataclass(frozen=True, eq=False)
class SpmdEntry:
    """The compiled step for one argument signature."""

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


def compile_spmd(t: Traced, ready: Prepared) -> SpmdEntry:
    """The step ``t`` as one jitted program under the checked single-program plan."""
    cap, graph = t.cap, t.graph
    low = ready.lowered
    roles = [graph.tensors[x].role for x in graph.inputs][len(cap.params) + len(cap.state) :]
    planned = Planned(low, t.microbatches, cap.avals(), cap.out_avals(), roles, cap.n_aux)
    in_sh = in_shardings(low, cap, t.src, t.micro, t.paths, t.owner, t.batch_argnum)
    rep = NamedSharding(low.mesh, PartitionSpec())
    out_sh, returned = out_shardings(followers(low, cap), rep, t.out_shape, t.paths, t.full, in_sh)
    mut_args, mutated, mutable = t.mut
    pure = pure_step(t.fn, t.tdef, len(t.full), mut_args, lambda: StepRunner(planned))
    jitted = jax.jit(
        pure,
        in_shardings=tuple(in_sh),
        out_shardings=(out_sh, [in_sh[k] for k in mutated]),
        donate_argnums=t.donated(returned),
    )
    return SpmdEntry(planned, jitted, tuple(in_sh), tuple(mutable))
