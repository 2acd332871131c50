"""Mixed precision: compute in bf16, keep fp32 master parameters and optimizer state.

The loss is traced with the model's floating-point parameters (and floating batch
leaves) as bf16, so the graph, the plan and the compiled step compute in bf16 as the
model's own code would with bf16 weights (a model that keeps its softmax or norms in
fp32 still does). The trainer stores fp32 parameters and casts them inside the
differentiated function, so gradients arrive in fp32 through the cast's transpose.
"""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
from flax import nnx

from jscaler.cost.estimate import CONTRACTIONS
from jscaler.cost.precision import op_compute_dtypes
from jscaler.errors import PlanError

__all__ = [
    "COMPUTE_DTYPES",
    "compute_dtype",
    "map_floats",
    "warn_if_not_computing_in",
    "with_compute_dtype",
]

COMPUTE_DTYPES = {"fp32": None, "bf16": jnp.bfloat16}


def compute_dtype(precision: str):
    """The dtype a precision name computes in (None: as the model is)."""
    if precision not in COMPUTE_DTYPES:
        raise PlanError(f"precision={precision!r}: expected one of {sorted(COMPUTE_DTYPES)}")
    return COMPUTE_DTYPES[precision]


def map_floats(model_or_params, batch, fn, *, has_aux: bool = False):
    """(model or params, batch) with ``fn`` applied to every floating parameter and batch
    leaf (an nnx model's Params only, or with ``has_aux`` the ``"params"`` collection of
    linen variables; other variables are left as they are)."""

    def leaf(x):
        dtype = getattr(x, "dtype", None)
        return fn(x) if dtype is not None and jnp.issubdtype(dtype, jnp.floating) else x

    batch = jax.tree_util.tree_map(leaf, batch)
    if isinstance(model_or_params, nnx.Module):
        graphdef, params, rest = nnx.split(model_or_params, nnx.Param, ...)
        return nnx.merge(graphdef, jax.tree_util.tree_map(leaf, params), rest), batch
    if has_aux:
        variables = dict(model_or_params)
        return {**variables, "params": jax.tree_util.tree_map(leaf, variables["params"])}, batch
    return jax.tree_util.tree_map(leaf, model_or_params), batch


def with_compute_dtype(model_or_params, batch, dtype, *, has_aux: bool = False):
    """(model or params, batch) to trace the loss with: floats as ``dtype`` shapes."""
    if dtype is None:
        return model_or_params, batch
    cast = lambda x: jax.ShapeDtypeStruct(x.shape, dtype)  # noqa: E731
    return map_floats(model_or_params, batch, cast, has_aux=has_aux)


def warn_if_not_computing_in(graph, precision: str) -> None:
    """Warns when a step traced for ``precision="bf16"`` has no matrix product in bf16:
    the model's layers cast their inputs back (``nnx.Linear(dtype=jnp.float32)``, a
    config's ``dtype``), so the step computes in fp32 at fp32's speed and memory."""
    if compute_dtype(precision) is None:
        return
    kinds = op_compute_dtypes(graph)
    dots = [op for op in graph.ops if op.primitive in CONTRACTIONS]
    if dots and all(kinds[op.id] == "fp32" for op in dots):
        warnings.warn(
            f"precision={precision!r}, but all {len(dots)} matrix products of the traced "
            f"step compute in float32 (the first: {dots[0].where}): the model's layers "
            f"cast their inputs to float32 (a layer built with dtype=jnp.float32, say). The "
            f"step runs at fp32's speed and memory; build the layers with dtype=None or "
            f"jnp.bfloat16 to compute in bf16.",
            stacklevel=4,
        )
