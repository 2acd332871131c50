"""Checks dim annotations against what the ops compute, on real values.

An annotation is a promise about an op; this module tests the promise, so a wrong rule
(ours or one a user registered) fails loudly instead of producing a wrong plan:

* a ``''`` dim split n ways: output piece k depends only on input piece k. Replacing the
  other pieces of every input that carries the dim must leave output piece k unchanged.
* a ``'+'`` dim split n ways: the sum over k of the op applied to the inputs with every
  piece but k zeroed equals the op applied to the whole inputs.

Example::

    graph = jscaler.trace(loss, model, batch)
    jscaler.check_annotations(graph, model, batch)   # raises AnnotationError on a bad rule
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jscaler.errors import AnnotationError
from jscaler.ir.build import graph_of
from jscaler.ir.evaluate import evaluate
from jscaler.ir.graph import Graph, Literal, Op

__all__ = ["check_annotations", "check_fn", "check_op"]


def check_annotations(graph: Graph, model_or_params, batch, *, pieces: int = 2) -> int:
    """Checks every splittable dim of every annotated op of a traced graph.

    Returns the number of (op, dim) promises checked.
    """
    p_leaves, s_leaves = graph.signature.split(model_or_params)
    values = _all_values(graph, [*p_leaves, *s_leaves, *jax.tree_util.tree_leaves(batch)])
    checked = 0
    for op in graph.ops:
        if op.annotation is not None:
            ins = [x.value if isinstance(x, Literal) else values[x] for x in op.inputs]
            checked += check_op(op, ins, pieces=pieces)
    return checked


def check_fn(fn, *args, pieces: int = 2) -> int:
    """Checks the annotation of every op ``fn(*args)`` traces to (nested jits inlined).

    For rules on their own, outside a loss: ``check_fn(jnp.tile, x, (2, 1))``. Ops with no
    rule are skipped. Returns the number of (op, dim) promises checked.
    """
    leaves = jax.tree_util.tree_leaves(args)
    closed = jax.make_jaxpr(lambda *xs: fn(*jax.tree_util.tree_unflatten(
        jax.tree_util.tree_structure(args), xs)))(*leaves)  # fmt: skip
    graph = graph_of(closed.jaxpr, closed.consts, strict=False)
    values = _all_values(graph, leaves)
    checked = 0
    for op in graph.ops:
        if op.annotation is not None and op.outputs:
            ins = [x.value if isinstance(x, Literal) else values[x] for x in op.inputs]
            checked += check_op(op, ins, pieces=pieces)
    return checked


def _all_values(graph: Graph, flat_inputs) -> dict:
    sub = Graph(
        graph.tensors,
        graph.ops,
        graph.inputs,
        tuple(t for o in graph.ops for t in o.outputs),
        graph.consts,
    )
    env = dict(graph.consts)
    env.update(zip(graph.inputs, flat_inputs))
    env.update(zip(sub.outputs, evaluate(sub, *flat_inputs)))
    return env


def _run(op: Op, ins):
    params = op.eqn.primitive.get_bind_params(op.eqn.params)
    out = op.eqn.primitive.bind(*ins, **params)
    return [np.asarray(o) for o in (out if op.eqn.primitive.multiple_results else [out])]


def check_op(op: Op, ins, *, pieces: int = 2) -> int:
    """Checks the annotation of one op on input values ``ins``; returns promises checked."""
    ann = op.annotation
    avals = [v.aval for v in op.eqn.outvars]
    if any(jnp.issubdtype(jnp.asarray(x).dtype, jax.dtypes.prng_key) for x in ins) or any(
        jnp.issubdtype(getattr(a, "dtype", np.float32), jax.dtypes.prng_key) for a in avals
    ):
        return 0  # key arrays cannot be masked or perturbed elementwise
    ins = [np.asarray(x) for x in ins]
    full = _run(op, ins)
    checked = 0
    for d in ann.splittable():
        if ann.sizes[d] % pieces or ann.sizes[d] < pieces:
            continue
        in_axes = [_axis_of(t, d) for t in ann.inputs]
        out_axes = [_axis_of(t, d) for t in ann.outputs]
        if ann.kinds[d] == "+":
            _check_partial(op, ins, full, in_axes, d, pieces)
        else:
            for k in range(pieces):
                _check_split(op, ins, full, in_axes, out_axes, d, k, pieces)
        checked += 1
    return checked


def _axis_of(tensor_dims, d):
    return next((i for i, ax in enumerate(tensor_dims) if ax[0] == d), None)


def _piece_mask(shape, axis, k, n):
    size = shape[axis] // n
    idx = np.arange(shape[axis])
    keep = (idx >= k * size) & (idx < (k + 1) * size)
    return keep.reshape([-1 if i == axis else 1 for i in range(len(shape))])


def _other_values(x):
    """Different values of the same kind: reversed, then shifted, so domains stay valid."""
    flat = x.reshape(-1)
    other = np.roll(flat[::-1], 1).reshape(x.shape)
    if x.dtype == np.bool_:
        return ~x
    return other


def _check_split(op, ins, full, in_axes, out_axes, d, k, n):
    changed = [
        x if a is None else np.where(_piece_mask(x.shape, a, k, n), x, _other_values(x))
        for x, a in zip(ins, in_axes)
    ]
    got = _run(op, changed)
    for i, (a, f, g) in enumerate(zip(out_axes, full, got)):
        if a is None:
            continue
        m = np.broadcast_to(_piece_mask(f.shape, a, k, n), f.shape)
        if not _close(f[m], g[m]):
            raise AnnotationError(
                f"{op.where}: annotation {op.annotation} says dim {d!r} splits plainly, but "
                f"piece {k} of {n} of output {i} changed when only other pieces of the "
                f"inputs changed. Mark {d!r} '^' (or '+' if it is summed)."
            )


def _check_partial(op, ins, full, in_axes, d, n):
    total = None
    for j in range(n):
        zeroed = [
            x if a is None else np.where(_piece_mask(x.shape, a, j, n), x, np.zeros_like(x))
            for x, a in zip(ins, in_axes)
        ]
        out = _run(op, zeroed)
        total = out if total is None else [t + o for t, o in zip(total, out)]
    for i, (f, t) in enumerate(zip(full, total)):
        if not _close(f, t):
            raise AnnotationError(
                f"{op.where}: annotation {op.annotation} says dim {d!r} gives partial sums, "
                f"but the {n} partial results of output {i} do not add up to the whole. "
                f"Mark {d!r} '^'."
            )


def _close(a, b) -> bool:
    a, b = np.asarray(a), np.asarray(b)
    if a.dtype.kind in "fc":
        return bool(np.allclose(a, b, rtol=1e-4, atol=1e-5, equal_nan=True))
    return bool(np.array_equal(a, b))
