"""``jscaler.trace``: a loss function over a model (or params) and a batch -> Graph."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from jscaler.errors import TraceError
from jscaler.ir.build import Builder
from jscaler.ir.evaluate import evaluate
from jscaler.ir.expose import expose_loops
from jscaler.ir.extrema import two_level_extrema
from jscaler.ir.fused_parts import cut_fused_parts
from jscaler.ir.graph import Graph
from jscaler.ir.loops import refuse_dynamic_loops
from jscaler.ir.scopes import leaf_scopes, module_classes, module_scopes
from jscaler.ir.unfuse import unfuse_projections

__all__ = ["Signature", "key_names", "trace"]


def key_names(path) -> list[str]:
    """A pytree path as strings, without an nnx Variable's ``value`` step."""
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
    return parts


def _key_name(path) -> str:
    return "/".join(key_names(path))


@dataclass(frozen=True, eq=False)
class Signature:
    """How the graph's flat inputs and outputs relate to ``loss_fn(model_or_params, batch)``.

    Inputs are: trained params, then the state (an nnx model's other variables, or linen
    variables' collections other than ``"params"``), then batch leaves. Outputs are: the
    loss, then the state after the call.

    ``kind`` is ``"nnx"`` (an nnx Module), ``"params"`` (a pytree, all of it trained) or
    ``"linen"`` (linen variables ``{"params": ..., <collection>: ...}`` traced with
    ``has_aux=True``: ``params_def`` is the ``"params"`` tree's, ``state_def`` the other
    collections').
    """

    kind: str  # "nnx" | "params" | "linen"
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
        if self.kind == "linen":
            params, rest = _linen_split(model_or_params)
            p_leaves, p_def = jax.tree_util.tree_flatten(params)
            s_leaves, s_def = jax.tree_util.tree_flatten(rest)
            _check_def("params collection", p_def, self.params_def)
            _check_def("non-param collections", s_def, self.state_def)
            return p_leaves, s_leaves
        leaves, tdef = jax.tree_util.tree_flatten(model_or_params)
        _check_def("params", tdef, self.params_def)
        return leaves, []

    def variables(self, params, state_leaves) -> dict:
        """Linen variables ``{"params": params, <collection>: ...}`` from the params tree
        and the state leaves (``kind == "linen"`` only)."""
        if self.kind != "linen":
            use = ".model" if self.kind == "nnx" else ".params"
            raise TypeError(
                f"variables are for linen variables traced with has_aux=True; this graph "
                f"was traced from {'an nnx Module' if self.kind == 'nnx' else 'a params pytree'}"
                f" (use {use})"
            )
        rest = jax.tree_util.tree_unflatten(self.state_def, list(state_leaves))
        return {"params": params, **rest}

    def make_fn(self, graph: Graph) -> Callable:
        sig = self

        def fn(model_or_params, batch):
            p_leaves, s_leaves = sig.split(model_or_params)
            b_leaves, b_def = jax.tree_util.tree_flatten(batch)
            _check_def("batch", b_def, sig.batch_def)
            outs = evaluate(graph, *p_leaves, *s_leaves, *b_leaves)
            if sig.kind == "nnx" and s_leaves:
                new_state = jax.tree_util.tree_unflatten(sig.state_def, outs[1:])
                nnx.update(model_or_params, new_state)
            if sig.kind == "linen":  # as the user's loss: (loss, new collections)
                return outs[0], jax.tree_util.tree_unflatten(sig.state_def, outs[1:])
            return outs[0]

        return fn


def _check_def(what: str, got, expected) -> None:
    if got != expected:
        raise TypeError(
            f"the {what} passed have a different structure from the traced ones:\n"
            f"  traced: {expected}\n  got:    {got}"
        )


def trace(
    loss_fn: Callable,
    model_or_params: Any,
    batch: Any,
    *,
    strict: bool = True,
    has_aux: bool = False,
) -> Graph:
    """Traces ``loss_fn(model_or_params, batch) -> scalar`` into a :class:`Graph`.

    Args:
      loss_fn: the user's loss. For an nnx model it is called as ``loss_fn(model, batch)``;
        for a params pytree (linen users close over ``module.apply``) as
        ``loss_fn(params, batch)``; with ``has_aux=True`` as ``loss_fn(variables, batch)
        -> (loss, new_collections)``.
      model_or_params: a ``flax.nnx.Module``, a pytree of arrays, or (``has_aux=True``)
        linen variables ``{"params": ..., "batch_stats": ..., ...}``.
      batch: a pytree of arrays (abstract ``jax.ShapeDtypeStruct`` leaves work too).
      strict: raise :class:`UnsupportedOpError` for an op without a dim annotation; with
        False, such ops are kept with ``annotation=None`` and show in ``coverage()``.
      has_aux: linen mutable collections. Only ``variables["params"]`` is trained; the
        other collections are state, replaced each step by the ``new_collections`` the
        loss returns (``module.apply(variables, x, mutable=["batch_stats"])`` gives them),
        which must hold exactly those collections with the same structure and shapes.

    Returns:
      The graph of the forward computation. Param tensors are named by their pytree path.

    Raises:
      TraceError: the loss is not a scalar float; it returns a tuple without
        ``has_aux=True``, or (with it) not ``(loss, collections)`` matching the variables.
      UnsupportedOpError: an op has no dim rule (``strict``), is refused (``shard_map``,
        collectives, refs: the message says why and what to do), or is a ``while_loop``
        with a run-time trip count that gradients flow through.

    Example::

        graph = jscaler.trace(gpt.loss, model, batch)
        print(graph.select("blocks/0/attn/*").ops)

        def loss(variables, batch):  # linen with BatchNorm
            logits, new = cnn.apply(variables, batch["x"], mutable=["batch_stats"])
            return xent(logits, batch["y"]), new
        graph = jscaler.trace(loss, variables, batch, has_aux=True)
    """
    b_leaves, b_paths, b_def = _flatten_with_names(batch, "batch")
    if isinstance(model_or_params, nnx.Module):
        if has_aux:
            raise TraceError(
                "has_aux=True is for linen variables {'params': ..., <collection>: ...}; an "
                "nnx model's loss returns the loss alone (its variables update in place)"
            )
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
            return (_only_loss(loss), *jax.tree_util.tree_leaves(new_state))

    elif has_aux:
        params, rest = _linen_split(model_or_params)
        p_leaves, p_names, p_def = _flatten_with_names(params, "params")
        s_leaves, s_names, s_def = _flatten_with_names(rest, "")
        sig = Signature("linen", None, p_def, s_def, b_def)
        n_p, n_s = len(p_leaves), len(s_leaves)

        def flat(*leaves):
            variables = {
                "params": jax.tree_util.tree_unflatten(p_def, leaves[:n_p]),
                **jax.tree_util.tree_unflatten(s_def, leaves[n_p : n_p + n_s]),
            }
            out = loss_fn(variables, jax.tree_util.tree_unflatten(b_def, leaves[n_p + n_s :]))
            loss, new = _loss_and_aux(out)
            return (loss, *_aux_leaves(new, rest, leaves[n_p : n_p + n_s]))

    else:
        p_leaves, p_names, p_def = _flatten_with_names(model_or_params, "")
        s_leaves, s_names = [], []
        sig = Signature("params", None, p_def, None, b_def)
        n_p = len(p_leaves)

        classes = module_classes()

        def flat(*leaves):
            params = jax.tree_util.tree_unflatten(p_def, leaves[:n_p])
            names = {id(x): n for x, n in zip(leaves[:n_p], p_names)}
            with leaf_scopes(names, classes):
                loss = loss_fn(params, jax.tree_util.tree_unflatten(b_def, leaves[n_p:]))
            return (_only_loss(loss),)

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
    # a scan over stacked layers: its body's ops are planned like any layer's
    graph = expose_loops(b.graph(ins, outs, sig))
    # fused q/k/v (gate/up) matmuls on their (parts, features) view: heads split cleanly
    graph = cut_fused_parts(unfuse_projections(graph))
    # a loss's max over the vocabulary in two levels: the logits can stay split
    graph = two_level_extrema(graph)
    refuse_dynamic_loops(graph)
    return graph


def _linen_split(variables) -> tuple[Any, dict]:
    """(the ``"params"`` collection, {other collection: tree}) of linen variables."""
    if not isinstance(variables, Mapping) or "params" not in variables:
        got = type(variables).__name__
        if isinstance(variables, Mapping):
            got = f"a mapping with keys {sorted(variables)}"
        raise TraceError(
            f"has_aux=True expects linen variables {{'params': ..., <collection>: ...}} "
            f"(what module.init returns); got {got}"
        )
    return variables["params"], {k: variables[k] for k in variables if k != "params"}


def _only_loss(out):
    if isinstance(out, (tuple, list)):
        raise TraceError(
            f"loss_fn returned a {type(out).__name__} of {len(out)}, not a scalar loss. If it "
            f"returns (loss, new_collections) from a linen module.apply(..., mutable=[...]), "
            f"pass has_aux=True with the linen variables; otherwise return the loss alone"
        )
    if not hasattr(out, "shape") or not hasattr(out, "dtype"):
        keys = f" with keys {sorted(map(str, out))}" if isinstance(out, dict) else ""
        raise TraceError(
            f"loss_fn returned a {type(out).__name__}{keys}, not a scalar loss array. Return "
            f"the loss alone (e.g. `return metrics['loss']`)"
        )
    return out


def _loss_and_aux(out):
    if not isinstance(out, (tuple, list)) or len(out) != 2:
        got = f"a {type(out).__name__}"
        if isinstance(out, (tuple, list)):
            got += f" of {len(out)}"
        raise TraceError(
            f"with has_aux=True, loss_fn must return (loss, new_collections); it returned "
            f"{got}. Return e.g. `logits, new = module.apply(variables, x, "
            f"mutable=['batch_stats'])` ... `return loss, new`, or drop has_aux=True"
        )
    return out


def _aux_leaves(new, rest: dict, old_leaves) -> list:
    """The leaves of the returned collections, in the order of the variables' non-param
    collections, after checking they are the same collections, structure and shapes."""
    if not isinstance(new, Mapping):
        raise TraceError(
            f"with has_aux=True, loss_fn's aux must be the updated collections "
            f"(a dict like {{'batch_stats': ...}}); it returned a {type(new).__name__}"
        )
    want, got = sorted(rest), sorted(new)
    if want != got:
        raise TraceError(
            f"loss_fn returned collections {got}, but the variables' non-param collections "
            f"are {want}: every one is carried as state and replaced by the returned one. "
            f"Call module.apply(..., mutable={want}), or leave the unused collections out "
            f"of the variables"
        )
    new = {k: new[k] for k in want}
    w_pairs = jax.tree_util.tree_flatten_with_path(rest)[0]
    g_pairs = jax.tree_util.tree_flatten_with_path(new)[0]
    w_paths = [_key_name(p) for p, _ in w_pairs]
    g_paths = [_key_name(p) for p, _ in g_pairs]
    if w_paths != g_paths:
        missing = sorted(set(w_paths) - set(g_paths))[:3]
        extra = sorted(set(g_paths) - set(w_paths))[:3]
        raise TraceError(
            f"the collections loss_fn returned have another structure than the variables' "
            f"(missing {missing}, unexpected {extra}); return what module.apply(..., "
            f"mutable=[...]) gives for the same variables"
        )
    for path, (_, x), old in zip(w_paths, g_pairs, old_leaves):
        if (jnp.shape(x), jnp.result_type(x)) != (old.shape, old.dtype):
            raise TraceError(
                f"collection leaf {path!r} comes back as {jnp.result_type(x)}{list(jnp.shape(x))}"
                f" but is {old.dtype}{list(old.shape)} in the variables; state must keep its "
                f"shape and dtype from step to step"
            )
    return [x for _, x in g_pairs]


def _flatten_with_names(tree, prefix: str):
    pairs, tdef = jax.tree_util.tree_flatten_with_path(tree)
    # Haiku's "mlp/~/linear_0" keys: the "~" is a separator, not a module (op paths drop it)
    names = [
        "/".join(q for q in [prefix, *_key_name(p).split("/")] if q and q != "~") for p, _ in pairs
    ]
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
