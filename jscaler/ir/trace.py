"""``jscaler.trace``: a loss function over a model (or params) and a batch -> Graph."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from jscaler.errors import TraceError
from jscaler.ir.build import Builder
from jscaler.ir.graph import Graph
from jscaler.ir.scopes import module_scopes

__all__ = ["Signature", "trace"]


def _key_name(path) -> str:
    parts = []
    for k in path:
        if isinstance(k, jax.tree_util.GetAttrKey) and k.name == "value":
            continue  # nnx Variable's payload
        for attr in ("key", "name", "idx"):
            if hasattr(k, attr):
                parts.append(str(getattr(k, attr)))
                break
        else:
            parts.append(str(k))
    return "/".join(parts)


@dataclass(frozen=True, eq=False)
class Signature:
    """How the graph's flat inputs and outputs relate to ``loss_fn(model_or_params, batch)``.

    Inputs are: trained params, then (nnx) the model's other variables, then batch leaves.
    Outputs are: the loss, then (nnx) the other variables after the call.
    """

    kind: str  # "nnx" | "params"
    graphdef: Any
    params_def: Any
    state_def: Any
    batch_def: Any

    def split(self, model_or_params):
        """(params leaves, state leaves) of a model or params pytree, checked against the trace."""
        if self.kind == "nnx":
            if not isinstance(model_or_params, nnx.Module):
                raise TypeError(
                    f"this graph was traced from an nnx Module; got {type(model_or_params)}"
                )
            _, params, state = nnx.split(model_or_params, nnx.Param, ...)
            p_leaves, p_def = jax.tree_util.tree_flatten(params)
            s_leaves, s_def = jax.tree_util.tree_flatten(state)
            _check_def("model parameters", p_def, self.params_def)
            _check_def("model variables", s_def, self.state_def)
            return p_leaves, s_leaves
        leaves, tdef = jax.tree_util.tree_flatten(model_or_params)
        _check_def("params", tdef, self.params_def)
        return leaves, []

    def make_fn(self, graph: Graph) -> Callable:
        sig = self

        def fn(model_or_params, batch):
            p_leaves, s_leaves = sig.split(model_or_params)
            b_leaves, b_def = jax.tree_util.tree_flatten(batch)
            _check_def("batch", b_def, sig.batch_def)
            outs = graph.evaluate(*p_leaves, *s_leaves, *b_leaves)
            if sig.kind == "nnx" and s_leaves:
                new_state = jax.tree_util.tree_unflatten(sig.state_def, outs[1:])
                nnx.update(model_or_params, new_state)
            return outs[0]

        return fn


def _check_def(what: str, got, expected) -> None:
    if got != expected:
        raise TypeError(
            f"the {what} passed have a different structure from the traced ones:\n"
            f"  traced: {expected}\n  got:    {got}"
        )


def trace(loss_fn: Callable, model_or_params: Any, batch: Any, *, strict: bool = True) -> Graph:
    """Traces ``loss_fn(model_or_params, batch) -> scalar`` into a :class:`Graph`.

    Args:
      loss_fn: the user's loss. For an nnx model it is called as ``loss_fn(model, batch)``;
        for a params pytree (linen users close over ``module.apply``) as
        ``loss_fn(params, batch)``.
      model_or_params: a ``flax.nnx.Module`` or a pytree of arrays.
      batch: a pytree of arrays (abstract ``jax.ShapeDtypeStruct`` leaves work too).
      strict: raise :class:`UnsupportedOpError` for an op without a dim annotation; with
        False, such ops are kept with ``annotation=None`` and show in ``coverage()``.

    Returns:
      The graph of the forward computation. Param tensors are named by their pytree path.

    Example::

        graph = jscaler.trace(gpt.loss, model, batch)
        print(graph.select("blocks/0/attn/*").ops)
    """
    b_leaves, b_paths, b_def = _flatten_with_names(batch, "batch")
    if isinstance(model_or_params, nnx.Module):
        graphdef, params, state = nnx.split(model_or_params, nnx.Param, ...)
        p_leaves, p_names, p_def = _flatten_with_names(params, "")
        s_leaves, s_names, s_def = _flatten_with_names(state, "")
        sig = Signature("nnx", graphdef, p_def, s_def, b_def)
        n_p, n_s = len(p_leaves), len(s_leaves)

        def flat(*leaves):
            model = nnx.merge(
                graphdef,
                jax.tree_util.tree_unflatten(p_def, leaves[:n_p]),
                jax.tree_util.tree_unflatten(s_def, leaves[n_p : n_p + n_s]),
            )
            with module_scopes(model):
                loss = loss_fn(model, jax.tree_util.tree_unflatten(b_def, leaves[n_p + n_s :]))
            _, _, new_state = nnx.split(model, nnx.Param, ...)
            return (loss, *jax.tree_util.tree_leaves(new_state))

    else:
        p_leaves, p_names, p_def = _flatten_with_names(model_or_params, "")
        s_leaves, s_names = [], []
        sig = Signature("params", None, p_def, None, b_def)
        n_p = len(p_leaves)

        def flat(*leaves):
            params = jax.tree_util.tree_unflatten(p_def, leaves[:n_p])
            return (loss_fn(params, jax.tree_util.tree_unflatten(b_def, leaves[n_p:])),)

    avals = [
        _abstract(x, n) for x, n in zip(p_leaves + s_leaves + b_leaves, p_names + s_names + b_paths)
    ]
    closed, out_shape = jax.make_jaxpr(flat, return_shape=True)(*avals)
    loss_aval = out_shape[0]
    if loss_aval.shape != () or not jnp.issubdtype(loss_aval.dtype, jnp.floating):
        raise TraceError(
            f"loss_fn must return a scalar float loss; it returned {loss_aval.dtype}"
            f"{list(loss_aval.shape)}. Reduce it (e.g. .mean()) inside loss_fn."
        )
    b = Builder(strict=strict)
    roles = ["param"] * len(p_leaves) + ["state"] * len(s_leaves) + ["batch"] * len(b_leaves)
    names = p_names + s_names + b_paths
    ins = [
        b.new_tensor(v.aval, role, name)
        for v, role, name in zip(closed.jaxpr.invars, roles, names, strict=True)
    ]
    outs = b.convert(closed.jaxpr, closed.consts, ins)
    return b.graph(ins, outs, sig)


def _flatten_with_names(tree, prefix: str):
    pairs, tdef = jax.tree_util.tree_flatten_with_path(tree)
    names = [("/".join(filter(None, [prefix, _key_name(p)]))) for p, _ in pairs]
    return [x for _, x in pairs], names, tdef


def _abstract(x, name: str):
    if isinstance(x, jax.ShapeDtypeStruct):
        return x
    if not hasattr(x, "shape") or not hasattr(x, "dtype"):
        try:
            x = jnp.asarray(x)
        except TypeError as e:
            raise TraceError(f"leaf {name!r} is not an array ({type(x).__name__})") from e
    return jax.ShapeDtypeStruct(x.shape, x.dtype)
