"""Finding the loss in a train step: running it abstractly with ``value_and_grad``
recording what the loss reads, and turning that into the loss's graph.

Also the pure form of a step (a function of its leaves that returns its result and the
nnx objects' new leaves), which both the SPMD and the pipeline step jit.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any

import jax
import jax.extend.core as jcore
import jax.numpy as jnp
from flax import nnx

from jscaler.errors import TraceError
from jscaler.ir.build import Builder
from jscaler.ir.graph import Graph
from jscaler.ir.trace import Signature, key_names
from jscaler.runtime.step.autodiff import Captured, handling

__all__ = [
    "Traced",
    "NOT_CALLED",
    "NOT_TOP_LEVEL",
    "Recorder",
    "arg_name",
    "aux_avals",
    "aval_key",
    "dependents",
    "loss_graph",
    "mutables",
    "pure_step",
    "record",
    "struct",
]


@dataclass(frozen=True, eq=False)
class Traced:
    """A step traced for one argument signature: what both the SPMD and the pipeline
    compilers need.

    Attributes:
      fn, tdef: the user's step and its arguments' structure.
      full, micro: the argument leaves' shapes, and with batch leaves at micro-batch size.
      paths, owner: each leaf's path, and the argument it belongs to.
      batch_argnum: which argument is the batch.
      out_shape: the step's results' shapes (at the full batch).
      mut: the nnx objects updated in place (:func:`mutables`).
      cap, graph, src: the loss's capture, its graph, the argument leaf each graph input
        is (or None).
      microbatches, donate: as ``parallelize_step`` was given.
    """

    fn: Any
    tdef: Any
    full: tuple
    micro: tuple
    paths: tuple
    owner: tuple
    batch_argnum: int
    out_shape: Any
    mut: tuple
    cap: Captured
    graph: Graph
    src: tuple
    microbatches: int
    donate: bool

    def donated(self, returned: set) -> tuple:
        """The argument leaves to donate: what comes back (the state returned, the nnx
        objects), never the batch."""
        if not self.donate:
            return ()
        mutated = self.mut[1]
        return tuple(
            k for k in sorted(returned | set(mutated)) if self.owner[k] != self.batch_argnum
        )


NOT_CALLED = (
    "the step never called jscaler.value_and_grad (or jscaler.grad): write "
    "jscaler.value_and_grad where you had jax.value_and_grad, so parallelize_step knows "
    "which function is the loss"
)
NOT_TOP_LEVEL = (
    "jscaler.value_and_grad must be called at the top level of the step, not inside "
    "jax.lax.scan, vmap, cond or a jax.jit of your own (parallelize_step jits the whole step "
    "and accumulates micro-batches itself: pass microbatches=)"
)


def mutables(args, owner):
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


def pure_step(fn, tdef, n_leaves: int, mut_args, make_handler):
    """The step as a function of its leaves (then ``make_handler``'s arguments): returns
    its result and the nnx objects' leaves; ``value_and_grad`` calls the handler."""

    def pure(*flat):
        a = jax.tree_util.tree_unflatten(tdef, flat[:n_leaves])
        handler = make_handler(*flat[n_leaves:])
        with handling(handler):
            out = fn(*a)
        if handler.calls == 0:
            raise TraceError(NOT_CALLED)
        return out, [x for i in mut_args for x in jax.tree_util.tree_leaves(a[i])]

    return pure


class Recorder:
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


def record(fn, tdef, avals, owner, bi):
    """Runs the step abstractly with value_and_grad recording. Returns the capture, the
    argument leaf each recorded input is (or None), whether it depends on the batch, and
    the step's output shapes."""
    recorder = Recorder()

    def probe(*leaves):
        with handling(recorder):
            out = fn(*jax.tree_util.tree_unflatten(tdef, leaves))
        cap = recorder.captured
        if cap is None:
            raise TraceError(NOT_CALLED)
        return out, [*cap.params, *cap.state, *cap.extras]

    try:
        closed, shape = jax.make_jaxpr(probe, return_shape=True)(*avals)
    except jax.errors.UnexpectedTracerError as e:
        raise TraceError(NOT_TOP_LEVEL) from e
    jaxpr = closed.jaxpr
    n_out = len(jax.tree_util.tree_leaves(shape[0]))
    recorded = jaxpr.outvars[n_out:]
    if any(isinstance(c, jax.core.Tracer) for c in closed.consts):  # escaped an inner trace
        raise TraceError(NOT_TOP_LEVEL)
    index = {v: k for k, v in enumerate(jaxpr.invars)}
    batch_vars = {v for k, v in enumerate(jaxpr.invars) if owner[k] == bi}
    dependent = dependents(jaxpr, batch_vars)
    src = [index.get(v) if isinstance(v, jcore.Var) else None for v in recorded]
    from_batch = [isinstance(v, jcore.Var) and v in dependent for v in recorded]
    return recorder.captured, src, from_batch, shape[0]


def dependents(jaxpr, sources: set) -> set:
    """The variables of ``jaxpr`` computed from ``sources`` (an equation's outputs depend on
    all of its inputs)."""
    dep = set(sources)
    for eqn in jaxpr.eqns:
        if any(isinstance(v, jcore.Var) and v in dep for v in eqn.invars):
            dep.update(eqn.outvars)
    return dep


def loss_graph(cap: Captured, extra_roles, extra_names):
    roles = ["param"] * len(cap.params) + ["state"] * len(cap.state) + extra_roles
    names = cap.param_names + cap.state_names + extra_names
    b = Builder(strict=True)
    ins = [b.new_tensor(v.aval, r, n) for v, r, n in zip(cap.jaxpr.invars, roles, names)]
    outs = b.convert(cap.jaxpr, cap.consts, ins)
    extras_def = jax.tree_util.tree_structure(list(range(len(extra_roles))))
    sig = Signature(cap.kind, cap.graphdef, cap.params_def, cap.state_def, extras_def)
    return b.graph(ins, outs, sig)


def aux_avals(cap: Captured):
    return cap.out_avals()[1 : 1 + cap.n_aux]


def struct(x) -> jax.ShapeDtypeStruct:
    if isinstance(x, jax.ShapeDtypeStruct):
        return x
    aval = jax.typeof(x)
    return jax.ShapeDtypeStruct(aval.shape, aval.dtype, weak_type=aval.weak_type)


def aval_key(x) -> tuple:
    s = struct(x)
    return (tuple(s.shape), str(s.dtype), bool(s.weak_type))


def arg_name(fn, i: int, path) -> str:
    try:
        names = list(inspect.signature(fn).parameters)
    except (TypeError, ValueError):
        names = []
    head = names[i] if i < len(names) else f"arg{i}"
    return "/".join([head, *key_names(path[1:])])
