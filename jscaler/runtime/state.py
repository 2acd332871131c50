"""The training state as one frozen pytree, and the one function that moves it.

A :class:`TrainState` is everything a step reads and writes: the parameters (in the
model's flattened order), the optimizer state, the model's non-parameter state (BatchNorm
statistics, and the RNG: an nnx model's ``Rngs`` keys and counters are state variables,
carried and checkpointed with the rest), and the step count. Programs take one and return
the next (:mod:`jscaler.runtime.program`); checkpoints save and restore one
(:mod:`jscaler.runtime.checkpoint`); a new layout (another batch shape's plan, a restore)
is :func:`relayout`.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

import jax
import numpy as np
from jax.sharding import Sharding

__all__ = ["TrainState", "gather", "relayout"]


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class TrainState:
    """One step's training state (a pytree; ``step`` is a leaf, so it is checkpointed).

    Attributes:
      params: the parameters' leaves, in the model's flattened order.
      opt_state: the optax state, laid out as the plan's update says.
      model_state: the model's non-parameter variables' leaves (BatchNorm statistics, an
        nnx model's RNG keys and counters); host arrays where a program keeps them on the
        host (a pipeline's).
      step: the number of updates applied.
    """

    params: list
    opt_state: Any
    model_state: list
    step: int = field(default=0)

    def replace(self, **changes) -> TrainState:
        """A copy with ``changes`` (the state is frozen)."""
        return replace(self, **changes)


def relayout(state: TrainState, shardings: TrainState) -> TrainState:
    """``state`` with every array moved to the sharding at the same place in
    ``shardings`` (a TrainState of :class:`jax.sharding.Sharding`, or ``None`` for a host
    copy); arrays already there are kept. The step count is kept as it is."""

    def move(x, s):
        if s is None:
            return np.asarray(gather(x)) if isinstance(x, jax.Array) else x
        if isinstance(x, jax.Array) and x.sharding == s:
            return x
        return jax.device_put(x, s)

    moved = jax.tree_util.tree_map(
        move,
        state.replace(step=None),
        shardings.replace(step=None),
        is_leaf=lambda x: x is None or isinstance(x, Sharding),
    )
    return moved.replace(step=state.step)


def gather(x):
    """A global array as one host numpy array, whichever process holds its shards (a
    PRNG key array stays a key array, gathered through its key data)."""
    if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
        data = gather(jax.random.key_data(x))
        return jax.random.wrap_key_data(data, impl=jax.random.key_impl(x))
    if not isinstance(x, jax.Array):
        return np.asarray(x)
    if jax.process_count() > 1 and not x.is_fully_addressable:
        from jax.experimental import multihost_utils

        return np.asarray(multihost_utils.process_allgather(x, tiled=True))
    return np.asarray(jax.device_get(x))
