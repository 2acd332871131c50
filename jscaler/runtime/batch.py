"""Batches: what identifies one (its signature), its checks, and how it is split.

Every program is compiled for one batch signature (:func:`batch_key`); the trainer and
``parallelize_step`` check a batch against the example batch (:func:`batch_leaves`,
:func:`batch_shapes`) and split it into micro-batches the same way (:func:`microbatches`,
:func:`accumulate`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jscaler.errors import PlanError

__all__ = [
    "accumulate",
    "batch_key",
    "batch_leaves",
    "batch_shapes",
    "microbatches",
    "process_rows",
]


def batch_key(leaves) -> tuple:
    """What identifies a batch's compiled step: each leaf's shape and canonical dtype."""
    return tuple((tuple(x.shape), str(jax.dtypes.canonicalize_dtype(x.dtype))) for x in leaves)


def batch_shapes(batch, microbatches: int) -> list[jax.ShapeDtypeStruct]:
    """The batch leaves' shapes, each checked to split on axis 0 into the micro-batches."""
    leaves = jax.tree_util.tree_leaves_with_path(batch)
    shapes = [jax.ShapeDtypeStruct(x.shape, x.dtype) for _, x in leaves]
    for i, s in enumerate(shapes):
        if len(s.shape) == 0:
            raise PlanError(
                f"batch leaf {jax.tree_util.keystr(leaves[i][0]) or i} is a scalar: every "
                f"batch leaf needs a leading batch axis (one entry per example). Close over a "
                f"constant in the loss instead, or give it shape (batch, ...)"
            )
        if s.shape[0] % microbatches:
            raise PlanError(
                f"batch leaf {i} has shape {tuple(s.shape)}: its axis 0 must split into "
                f"{microbatches} micro-batches; use a batch size divisible by {microbatches}"
            )
    return shapes


def batch_leaves(batch, batch_def, shapes) -> list:
    """The batch's leaves, after checking its structure (``batch_def``) and shapes against
    the example batch the program was made for."""
    leaves, tdef = jax.tree_util.tree_flatten(batch)
    if tdef != batch_def:
        raise PlanError(f"the batch has structure {tdef}; the trainer was made for {batch_def}")
    for i, (x, want) in enumerate(zip(leaves, shapes)):
        if tuple(x.shape) != tuple(want.shape):
            raise PlanError(
                f"batch leaf {i} has shape {tuple(x.shape)}; the trainer was made for "
                f"{tuple(want.shape)} (the example batch's shape)"
            )
    return leaves


def microbatches(x, m: int):
    """(B, ...) -> (B/m, m, ...): micro-batch j is rows j, j+m, j+2m, ... (local to each
    data-parallel shard, so splitting needs no communication)."""
    return x.reshape(x.shape[0] // m, m, *x.shape[1:])


def process_rows(sharding, shape: tuple, plan: str) -> tuple[int, int]:
    """The contiguous block of rows this process's devices hold of an array of ``shape``
    laid out by ``sharding``; a PlanError when the rows are replicated across processes
    or not one block."""
    spans = {
        idx[0].indices(shape[0])[:2]
        for idx in sharding.addressable_devices_indices_map(shape).values()
    }
    start, stop = min(a for a, _ in spans), max(b for _, b in spans)
    covered = sum(b - a for a, b in spans)
    if jax.process_count() > 1 and stop - start == shape[0]:
        raise PlanError(
            f"the plan {plan!r} does not split the batch across processes (every process "
            f"holds all {shape[0]} rows); pass the whole batch to step(), or use a plan "
            f"whose outer mesh axis is data parallel"
        )
    if covered < stop - start and len(spans) > 1:
        raise PlanError(
            f"under the plan {plan!r} this process holds rows {sorted(spans)} of "
            f"{shape[0]}, not one block; pass the whole batch to step()"
        )
    return start, stop


def accumulate(vg, params, state, inputs, *, m, batch, shardings, reduce, loss_dtype, aux_avals):
    """Loss, aux and gradients averaged over ``m`` micro-batches, as one step computes them.

    ``vg(params, state, inputs)`` returns ``((loss, (aux, new_state)), grads)``; the inputs
    at positions ``batch`` are split on axis 0 (:func:`microbatches`, placed on
    ``shardings[j]``) and scanned over, the state carried from one micro-batch to the
    next, each micro-batch's gradients laid out by ``reduce`` before they are summed.
    Returns ``(loss, aux, new_state, grads)``.
    """
    if m == 1:
        (loss, (aux, state)), grads = vg(params, state, inputs)
        return loss, aux, state, reduce(grads)
    split = {j: microbatches(inputs[j], m) for j in batch}

    def body(carry, i):
        loss_sum, g_sum, aux_sum, state = carry
        mb = list(inputs)
        for j in batch:
            x = jax.lax.dynamic_index_in_dim(split[j], i, 1, keepdims=False)
            mb[j] = jax.lax.with_sharding_constraint(x, shardings[j])
        (loss, (aux, state)), grads = vg(params, state, mb)
        g_sum = [a + b for a, b in zip(g_sum, reduce(grads))]
        aux_sum = [a + b for a, b in zip(aux_sum, aux)]
        return (loss_sum + loss, g_sum, aux_sum, state), None

    init = (
        jnp.zeros((), loss_dtype),
        reduce([jnp.zeros_like(p) for p in params]),
        [jnp.zeros(a.shape, a.dtype) for a in aux_avals],
        state,
    )
    (loss, grads, aux, state), _ = jax.lax.scan(body, init, jnp.arange(m))
    return loss / m, [a / m for a in aux], state, [g / m for g in grads]
