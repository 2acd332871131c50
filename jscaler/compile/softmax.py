"""A softmax traced as ops, differentiated by softmax's own rule.

``jax.nn.softmax`` is a ``custom_jvp`` whose rule needs only its output: ``dy = y * (dx -
sum(y * dx))``, so one device-sized array per softmax is kept for the backward. The trace
inlines its body (``exp(x - max) / sum(exp(x - max))``: :mod:`jscaler.ir.control`) so that
a plan can split its ops (a vocabulary-parallel loss, attention by heads); differentiated
op by op, that body keeps ``exp(x - max)`` as well as the output, one more array the size
of the attention scores per layer than the user's program keeps.

:func:`softmax_outputs` finds, in a plan graph, each division that completes a softmax
(``u / broadcast(sum(u, axes))`` with ``u = exp(x - c)`` and ``c`` constant along
``axes``); the lowering passes its output through :func:`with_softmax_rule`, which gives
it softmax's derivative with respect to ``x``. The values are the op-by-op ones; the
chain's own derivative is left unused, so XLA drops what it would have kept.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jscaler.ir.graph import Graph, Literal, Op

__all__ = ["softmax_chains", "softmax_outputs", "with_softmax_rule"]


def softmax_outputs(graph: Graph) -> dict[int, tuple[int, tuple[int, ...]]]:
    """Division op id -> (the softmax's input tensor ``x``, its axes) for every division
    of ``graph`` that completes a softmax."""
    return {k: (x, axes) for k, (x, axes, _) in softmax_chains(graph).items()}


def softmax_chains(graph: Graph) -> dict[int, tuple[int, tuple[int, ...], frozenset[int]]]:
    """As :func:`softmax_outputs`, with the ids of the ops from ``x`` to the division
    (the subtraction, exp, sum, its broadcast and the division), whose derivatives the
    softmax's rule replaces (once per graph)."""
    return graph.memo((softmax_chains,), lambda: _chains(graph))


def _chains(graph: Graph) -> dict:
    out = {}
    for op in graph.ops:
        if op.primitive != "div" or len(op.inputs) != 2:
            continue
        found = _match(graph, op)
        if found is not None:
            out[op.id] = found
    return out


def _producer(graph: Graph, x, primitive: str) -> Op | None:
    if isinstance(x, Literal):
        return None
    op = graph.producer(x)
    return op if op is not None and op.primitive == primitive else None


def _constant_along(graph: Graph, x, axes: tuple[int, ...]) -> bool:
    """``x`` is a literal, or a broadcast whose result varies along none of ``axes``."""
    if isinstance(x, Literal):
        return True
    b = _producer(graph, x, "broadcast_in_dim")
    if b is None:
        return False
    src = graph.tensors[b.inputs[0]].shape if not isinstance(b.inputs[0], Literal) else ()
    dims = b.eqn.params["broadcast_dimensions"]
    # an axis of the result varies only where an operand axis of size > 1 maps to it
    return not any(d in axes and src[i] != 1 for i, d in enumerate(dims))


def _match(graph: Graph, div: Op):
    u, denom = div.inputs
    exp = _producer(graph, u, "exp")
    sub = exp and _producer(graph, exp.inputs[0], "sub")
    b = _producer(graph, denom, "broadcast_in_dim")
    total = b and _producer(graph, b.inputs[0], "reduce_sum")
    if not (exp and sub and total) or total.inputs[0] != u:
        return None
    axes = tuple(total.eqn.params["axes"])
    x, shift = sub.inputs
    if isinstance(x, Literal) or not _constant_along(graph, shift, axes):
        return None
    if not _constant_along(graph, denom, axes):
        return None
    shape = graph.tensors[x].shape
    if graph.tensors[div.outputs[0]].shape != shape or graph.tensors[u].shape != shape:
        return None
    return x, axes, frozenset({sub.id, exp.id, total.id, b.id, div.id})


@functools.partial(jax.custom_jvp, nondiff_argnums=(2,))
def with_softmax_rule(x, y, axes):
    """``y`` (= softmax(x) over ``axes``, computed by the caller) with softmax's
    derivative with respect to ``x``; ``y``'s own derivative is not used."""
    del x, axes
    return y


@with_softmax_rule.defjvp
def _softmax_jvp(axes, primals, tangents):
    x, y = primals
    dx, _ = tangents
    del x
    y = jax.lax.stop_gradient(y)
    return y, y * (dx - jnp.sum(y * dx, axis=axes, keepdims=True))
