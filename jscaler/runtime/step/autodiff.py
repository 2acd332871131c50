"""``jscaler.value_and_grad`` / ``jscaler.grad``: where a wrapped train step's loss is.

Outside :func:`jscaler.parallelize_step` they are ``jax.value_and_grad`` / ``jax.grad``
(``nnx.value_and_grad`` / ``nnx.grad`` when the differentiated argument is an nnx
Module), so a step written with them runs unchanged on one device. Inside, the step's
wrapper has installed a *handler*: the call captures the loss function as a jaxpr over
the differentiated argument's leaves, and hoists every traced value the loss closes over
(the batch, a step counter, ...) into an explicit input. The handler either records that
capture (to trace and plan the loss graph) or computes loss and gradients with the plan.
"""

from __future__ import annotations

import contextlib
import functools
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from jscaler.errors import TraceError
from jscaler.ir.scopes import module_scopes
from jscaler.ir.trace import key_names

__all__ = ["Captured", "capture", "grad", "handling", "value_and_grad"]

_active = threading.local()


@contextlib.contextmanager
def handling(handler: Callable[[Captured], Any]):
    """Within this context ``value_and_grad`` calls hand their capture to ``handler``,
    which returns ``(loss, aux, grads)``."""
    previous = getattr(_active, "handler", None)
    _active.handler = handler
    try:
        yield handler
    finally:
        _active.handler = previous


def value_and_grad(fun: Callable, argnums: int | tuple[int, ...] = 0, has_aux: bool = False):
    """``jax.value_and_grad`` that :func:`jscaler.parallelize_step` computes with its plan.

    Write it where a train step had ``jax.value_and_grad`` (or ``nnx.value_and_grad``).
    Outside a ``parallelize_step`` it is exactly that function. Inside, the loss runs
    under the step's plan, its gradients come back in the plan's gradient layouts, and
    with ``microbatches=`` the batch values the loss closes over are split into
    micro-batches whose gradients are accumulated here.

    Args:
      fun: the loss; returns a scalar float (``(loss, aux)`` with ``has_aux``).
      argnums: the argument to differentiate: a params pytree or an nnx Module (its
        ``nnx.Param`` variables, as ``nnx.value_and_grad`` does); a tuple of ints for
        several pytrees.
      has_aux: ``fun`` returns ``(loss, aux)``; under micro-batches each floating aux
        leaf is averaged over them.

    Returns:
      A function returning ``(loss, grads)``, or ``((loss, aux), grads)``.

    Example::

        def loss_fn(params):
            return mse(state.apply_fn({"params": params}, batch["x"]), batch["y"])

        loss, grads = jscaler.value_and_grad(loss_fn)(state.params)
    """

    @functools.wraps(fun)
    def wrapped(*args, **kwargs):
        handler = getattr(_active, "handler", None)
        if handler is None:
            vg = nnx.value_and_grad if _is_module(args, argnums) else jax.value_and_grad
            return vg(fun, argnums=argnums, has_aux=has_aux)(*args, **kwargs)
        loss, aux, grads = handler(capture(fun, argnums, has_aux, args, kwargs))
        return ((loss, aux), grads) if has_aux else (loss, grads)

    return wrapped


def grad(fun: Callable, argnums: int | tuple[int, ...] = 0, has_aux: bool = False):
    """``jax.grad`` that :func:`jscaler.parallelize_step` computes with its plan: as
    :func:`value_and_grad` without the loss; returns ``grads`` or ``(grads, aux)``.

    Example::

        grads = jscaler.grad(loss_fn)(state.params)
    """
    vg = value_and_grad(fun, argnums, has_aux)

    @functools.wraps(fun)
    def wrapped(*args, **kwargs):
        out, grads = vg(*args, **kwargs)
        return (grads, out[1]) if has_aux else grads

    return wrapped


def _is_module(args, argnums) -> bool:
    return (
        isinstance(argnums, int)
        and -len(args) <= argnums < len(args)
        and (isinstance(args[argnums], nnx.Module))
    )


@dataclass(frozen=True, eq=False)
class Captured:
    """The loss of one ``value_and_grad`` call as a jaxpr over explicit inputs.

    ``jaxpr`` reads, in order: the differentiated leaves (``params``), an nnx model's other
    variables (``state``), then the traced values the loss closes over (``extras``); its
    constvars are the concrete constants in ``consts``. It returns the loss, the aux
    leaves, then the model's other variables after the call.
    """

    kind: str  # "params" | "nnx"
    jaxpr: Any
    consts: list
    params: list
    params_def: Any
    param_names: list[str]
    state: list
    state_def: Any
    state_names: list[str]
    extras: list
    aux_def: Any  # None without has_aux
    n_aux: int
    model: Any  # the nnx Module differentiated, else None
    graphdef: Any

    def avals(self) -> list[jax.ShapeDtypeStruct]:
        return [_struct(v.aval) for v in self.jaxpr.invars]

    def out_avals(self) -> list[jax.ShapeDtypeStruct]:
        return [_struct(v.aval) for v in self.jaxpr.outvars]

    def finish(self, new_state: list) -> None:
        """An nnx model's other variables take their values after the loss (as
        ``nnx.value_and_grad`` leaves them)."""
        if self.model is not None and self.state:
            nnx.update(self.model, jax.tree_util.tree_unflatten(self.state_def, new_state))

    def unflatten(self, loss, aux: list, grads: list):
        """(loss, aux tree, grads tree) from flat values."""
        aux_tree = None if self.aux_def is None else jax.tree_util.tree_unflatten(self.aux_def, aux)
        return loss, aux_tree, jax.tree_util.tree_unflatten(self.params_def, grads)


def capture(fun: Callable, argnums, has_aux: bool, args: tuple, kwargs: dict) -> Captured:
    """Traces ``fun`` over the differentiated argument and hoists what it closes over."""
    many = isinstance(argnums, tuple)
    nums = argnums if many else (argnums,)
    if not nums or not all(isinstance(i, int) and -len(args) <= i < len(args) for i in nums):
        raise TraceError(
            f"jscaler.value_and_grad: argnums={argnums!r} does not name an argument of the "
            f"{len(args)} the loss was called with"
        )
    diff = tuple(args[i] for i in nums) if many else args[argnums]

    def call(d):
        a = list(args)
        for i, x in zip(nums, d if many else (d,)):
            a[i] = x
        return fun(*a, **kwargs)

    graphdef, model = None, None
    if isinstance(diff, nnx.Module):
        kind, model = "nnx", diff
        graphdef, params, state = nnx.split(diff, nnx.Param, ...)
        p_leaves, p_names, p_def = _named_leaves(params)
        s_leaves, s_names, s_def = _named_leaves(state)

        def flat(*leaves):
            m = nnx.merge(
                graphdef,
                jax.tree_util.tree_unflatten(p_def, leaves[: len(p_leaves)]),
                jax.tree_util.tree_unflatten(s_def, leaves[len(p_leaves) :]),
            )
            with module_scopes(m):
                out = call(m)
            return out, jax.tree_util.tree_leaves(nnx.split(m, nnx.Param, ...)[2])

    else:
        if many and any(isinstance(x, nnx.Module) for x in diff):
            raise TraceError(
                "jscaler.value_and_grad differentiates one nnx Module (argnums an int); "
                "pass the model alone"
            )
        kind = "params"
        p_leaves, p_names, p_def = _named_leaves(diff)
        s_leaves, s_names, s_def = [], [], None

        def flat(*leaves):
            return call(jax.tree_util.tree_unflatten(p_def, leaves)), []

    shapes = {}

    def flat_out(*leaves):
        out, new_state = flat(*leaves)
        loss, aux = _split_out(out, has_aux)
        aux_leaves, shapes["aux_def"] = jax.tree_util.tree_flatten(aux)
        return [loss, *aux_leaves, *new_state]

    inputs = [_struct(jax.typeof(x)) for x in (*p_leaves, *s_leaves)]
    closed = jax.make_jaxpr(flat_out)(*inputs)
    loss = closed.jaxpr.outvars[0].aval
    if loss.shape != () or not jnp.issubdtype(loss.dtype, jnp.floating):
        raise TraceError(
            f"the loss given to jscaler.value_and_grad must return a scalar float; it "
            f"returned {loss.dtype}{list(loss.shape)}. Reduce it (e.g. .mean()) in the loss"
        )
    # traced values the loss closes over (from the step around it) become inputs; concrete
    # arrays stay constants of the graph
    hoisted = [isinstance(c, jax.core.Tracer) for c in closed.consts]
    jaxpr = closed.jaxpr
    cvars = [v for v, h in zip(jaxpr.constvars, hoisted) if not h]
    extra_vars = [v for v, h in zip(jaxpr.constvars, hoisted) if h]
    jaxpr = jaxpr.replace(constvars=cvars, invars=[*jaxpr.invars, *extra_vars])
    aux_def = shapes["aux_def"] if has_aux else None
    return Captured(
        kind,
        jaxpr,
        [c for c, h in zip(closed.consts, hoisted) if not h],
        list(p_leaves),
        p_def,
        p_names,
        list(s_leaves),
        s_def,
        s_names,
        [c for c, h in zip(closed.consts, hoisted) if h],
        aux_def,
        aux_def.num_leaves if aux_def is not None else 0,
        model,
        graphdef,
    )


def _split_out(out, has_aux: bool):
    if not has_aux:
        return out, None
    if not (isinstance(out, (tuple, list)) and len(out) == 2):
        raise TraceError(
            "jscaler.value_and_grad(..., has_aux=True): the loss must return a pair "
            f"(loss, aux); it returned {type(out).__name__}"
        )
    return out[0], out[1]


def _named_leaves(tree):
    pairs, tdef = jax.tree_util.tree_flatten_with_path(tree)
    return [x for _, x in pairs], ["/".join(key_names(p)) for p, _ in pairs], tdef


def _struct(aval) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(aval.shape, aval.dtype, weak_type=getattr(aval, "weak_type", False))
