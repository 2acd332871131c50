"""Checks before anything runs: the cost model's memory estimate against the devices'.

``parallelize(..., cluster=)`` predicts each device's memory for the plan (parameters,
gradients, optimizer state, batch, the activations the backward keeps: see
:mod:`jscaler.cost.estimate`) and refuses a plan that cannot fit, with the breakdown and
what to try instead, before a compile or an allocation can fail deep inside XLA.
"""

from __future__ import annotations

import jax
import optax

from jscaler.cost.estimate import Estimate
from jscaler.errors import OutOfMemoryError

__all__ = ["check_memory", "device_capacity", "optimizer_slots"]


def optimizer_slots(optimizer: optax.GradientTransformation, params_tree) -> int:
    """How many parameter-sized arrays the optimizer keeps per parameter (SGD 0, momentum
    1, Adam 2), read from the shapes of its state (nothing is allocated)."""
    state = jax.eval_shape(optimizer.init, params_tree)
    n_params = sum(x.size for x in jax.tree_util.tree_leaves(params_tree))
    n_state = sum(x.size for x in jax.tree_util.tree_leaves(state) if x.ndim > 0)
    return round(n_state / n_params) if n_params else 0


def device_capacity(devices: list) -> float | None:
    """The smallest device's memory limit in bytes, where the runtime reports one (GPUs and
    TPUs do; CPU devices do not)."""
    limits = []
    for d in devices:
        try:
            stats = d.memory_stats()
        except Exception:  # CPU and some plugins do not implement it
            stats = None
        if stats and stats.get("bytes_limit"):
            limits.append(stats["bytes_limit"])
    return min(limits) if limits else None


def check_memory(est: Estimate, capacity: float, where: str) -> None:
    """Raises :class:`OutOfMemoryError` when the predicted peak per device exceeds
    ``capacity`` bytes, with the breakdown and plans to try."""
    mem = est.memory
    if mem["total"] <= capacity:
        return
    gib = 2**30
    parts = ", ".join(
        f"{k} {mem[k] / gib:.2f}"
        for k in ("params", "grads", "optimizer", "batch", "activations")
        if k in mem
    )
    biggest = max(("params", "grads", "optimizer", "activations"), key=lambda k: mem.get(k, 0))
    advice = {
        "params": "shard the weights: zero(stage=3), megatron(tp=N) or a pipeline (pp=N)",
        "grads": "shard the gradients: zero(stage=2) or zero(stage=3), or megatron(tp=N)",
        "optimizer": "shard the optimizer state: zero(stage=1..3), or an optimizer with "
        "fewer slots",
        "activations": "recompute activations (megatron(recompute=1.0)), more micro-batches "
        "(microbatches=), sequence parallelism (megatron(sp=True)) or coshard",
    }[biggest]
    raise OutOfMemoryError(
        f"plan {est.plan!r} is predicted to need {mem['total'] / gib:.2f} GiB per device "
        f"({parts} GiB) on {where}, which has {capacity / gib:.2f} GiB per device; "
        f"{biggest} dominate: {advice}; or plan='auto' with cluster= searches for a plan "
        f"that fits (the estimate is the cost model's, see jscaler.cost.estimate)"
    )
