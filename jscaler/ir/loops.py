"""``lax.while_loop`` in a loss: a loop whose trip count is fixed becomes a scan.

JAX cannot differentiate a ``while`` in reverse mode, even one that always runs the same
number of times (``while i < 3``). When the values that decide the loop's exit (the
carries its condition reads, and what they are computed from) are known at trace time,
the trip count is known too: :func:`static_trip_count` runs just that part of the loop
(every other carry dead-code eliminated), and :func:`while_as_scan` rewrites the
equation as a ``scan`` of that length, which the graph keeps as a loop op and JAX
differentiates. A loop whose exit depends on computed values keeps its ``while``; trace
refuses it when gradients flow through it (:func:`jscaler.trace`).
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.extend.core
import numpy as np

from jscaler.errors import UnsupportedOpError

__all__ = ["MAX_TRIPS", "refuse_dynamic_loops", "static_trip_count", "while_as_scan"]

MAX_TRIPS = 100_000  # a loop still running after this many trips is treated as dynamic


def _prune(jaxpr, used_outputs):
    """(the equations ``used_outputs`` need, the inputs they read: a mask)."""
    needed = {v for v, u in zip(jaxpr.outvars, used_outputs) if u and not _is_literal(v)}
    kept = []
    for eqn in reversed(jaxpr.eqns):
        if any(o in needed for o in eqn.outvars):
            kept.append(eqn)
            needed.update(v for v in eqn.invars if not _is_literal(v))
    return kept[::-1], [v in needed for v in jaxpr.invars]


def _is_literal(v) -> bool:
    return isinstance(v, jax.extend.core.Literal)


def _used_inputs(jaxpr, used_outputs) -> list[bool]:
    return _prune(jaxpr, used_outputs)[1]


def static_trip_count(eqn, known: Callable[[int], object | None]) -> int | None:
    """The number of times a ``while`` equation's body runs, or None when it depends on
    values unknown at trace time.

    ``known(k)`` is the value of the equation's operand k when it is a constant (a
    literal or a closed-over constant), else None.
    """
    p = eqn.params
    n_cc, n_bc = p["cond_nconsts"], p["body_nconsts"]
    body, cond = p["body_jaxpr"].jaxpr, p["cond_jaxpr"].jaxpr
    n = len(eqn.outvars)
    cond_used = _used_inputs(cond, [True])
    deciding = {k for k in range(n) if cond_used[n_cc + k]}
    while True:  # the carries the deciding carries are computed from
        used = _used_inputs(body, [k in deciding for k in range(n)])
        grown = deciding | {k for k in range(n) if used[n_bc + k]}
        if grown == deciding:
            break
        deciding = grown
    cond_consts = [k for k in range(n_cc) if cond_used[k]]
    body_consts = [k for k in range(n_bc) if used[k]]
    operands = [*cond_consts, *(n_cc + k for k in body_consts)]
    operands += [n_cc + n_bc + k for k in sorted(deciding)]
    values = {k: known(k) for k in operands}
    if any(v is None for v in values.values()):
        return None
    cc = [values.get(k) for k in range(n_cc)]
    bc = [values.get(n_cc + k) for k in range(n_bc)]
    carry = [values.get(n_cc + n_bc + k) for k in range(n)]
    decide = [k in deciding for k in range(n)]
    test, step = _pruned(p["cond_jaxpr"], [True]), _pruned(p["body_jaxpr"], decide)
    trips = 0
    while trips <= MAX_TRIPS:
        (go,) = test(cc + carry)
        if not bool(go):
            return trips
        new = step(bc + carry)
        carry = [new[k] if k in deciding else None for k in range(n)]
        trips += 1
    return None


def _pruned(closed, used_outputs) -> Callable[[list], list]:
    """A function evaluating only the outputs ``used_outputs`` of a closed jaxpr (pruned
    once, run every trip); its argument may hold None for inputs they do not read."""
    jaxpr = closed.jaxpr
    eqns, _ = _prune(jaxpr, used_outputs)
    outvars = [v for v, u in zip(jaxpr.outvars, used_outputs) if u]
    pruned = jaxpr.replace(eqns=eqns, outvars=outvars, effects=jax.extend.core.no_effects)
    zeros = [np.zeros(v.aval.shape, v.aval.dtype) for v in jaxpr.invars]

    def run(args):
        args = [z if a is None else a for a, z in zip(args, zeros)]
        it = iter(jax.core.eval_jaxpr(pruned, closed.consts, *args))
        return [next(it) if u else None for u in used_outputs]

    return run


def while_as_scan(eqn, trips: int):
    """A closed jaxpr equal to the ``while`` equation, as a ``scan`` of ``trips`` steps."""
    p = eqn.params
    n_cc, n_bc = p["cond_nconsts"], p["body_nconsts"]
    body = p["body_jaxpr"]

    def loop(*operands):
        consts = operands[n_cc : n_cc + n_bc]
        init = operands[n_cc + n_bc :]

        def step(carry, _):
            return tuple(jax.core.eval_jaxpr(body.jaxpr, body.consts, *consts, *carry)), None

        out, _ = jax.lax.scan(step, tuple(init), None, length=trips)
        return list(out)

    avals = [jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype) for v in eqn.invars]
    return jax.make_jaxpr(loop)(*avals)


def refuse_dynamic_loops(graph) -> None:
    """Raises for a ``while`` op that gradients flow through: JAX has no reverse mode for
    it, and the user should hear so at trace time, naming the op, not on the first step.

    Gradients flow from trained parameters along every op but ``stop_gradient``; a loop
    over batch values alone is fine."""
    grads = {t for t in graph.inputs if graph.tensors[t].role == "param"}
    for op in graph.ops:
        if op.primitive == "stop_gradient" or not grads.intersection(op.tensor_inputs):
            continue
        if op.primitive == "while":
            raise UnsupportedOpError(
                f"lax.while_loop at module path {op.path or '<root>'!r} (op {op.id}): its "
                f"trip count depends on values computed at run time, and gradients flow "
                f"through it; reverse-mode needs a static trip count: use fori_loop with "
                f"Python int bounds or scan (a while_loop whose exit reads only constants "
                f"and counters is turned into a scan for you), or stop_gradient its inputs"
            )
        grads.update(op.outputs)
