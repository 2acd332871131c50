"""Mixed precision: compute in bf16, keep fp32 master parameters and optimizer state.

The loss is traced with the model's floating-point parameters (and floating batch
leaves) as bf16, so the graph, the plan and the compiled step compute in bf16 as the
model's own code would with bf16 weights (a model that keeps its softmax or norms in
fp32 still does). The trainer stores fp32 parameters and casts them inside the
differentiated function, so gradients arrive in fp32 through the cast's transpose.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jscaler.errors import PlanError

__all__ = ["COMPUTE_DTYPES", "compute_dtype", "with_compute_dtype"]

COMPUTE_DTYPES = {"fp32": None, "bf16": jnp.bfloat16}


def compute_dtype(precision: str):
    """The dtype a precision name computes in (None: as the model is)."""
    if precision not in COMPUTE_DTYPES:
        raise PlanError(f"precision={precision!r}: expected one of {sorted(COMPUTE_DTYPES)}")
    return COMPUTE_DTYPES[precision]


def _abstract(x, dtype):
    x_dtype = getattr(x, "dtype", None)
    if dtype is not None and x_dtype is not None and jnp.issubdtype(x_dtype, jnp.floating):
        return jax.ShapeDtypeStruct(x.shape, dtype)
    return jax.ShapeDtypeStruct(x.shape, x_dtype) if x_dtype is not None else x


def with_compute_dtype(model_or_params, batch, dtype):
    """(model or params, batch) as shapes, floats in ``dtype``, to trace the loss with."""
    if dtype is None:
        return model_or_params, batch
    batch = jax.tree_util.tree_map(lambda x: _abstract(x, dtype), batch)
    if isinstance(model_or_params, nnx.Module):
        graphdef, params, rest = nnx.split(model_or_params, nnx.Param, ...)
        params = jax.tree_util.tree_map(lambda x: _abstract(x, dtype), params)
        return nnx.merge(graphdef, params, rest), batch
    return jax.tree_util.tree_map(lambda x: _abstract(x, dtype), model_or_params), batch
