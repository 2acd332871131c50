"""Data parallelism: every op that carries the batch dim is split over all devices."""

from __future__ import annotations

from dataclasses import dataclass

import jscaler
from jscaler.plan import recompute_layers


@dataclass(frozen=True)
class DP:
    """``dp()``: split the batch over every device; parameters replicated."""

    recompute: float = 0
    precision: str = "fp32"

    def __call__(self, graph: jscaler.Graph, n_devices: int) -> jscaler.Plan:
        plan = jscaler.data_parallel(graph, n_devices)
        return recompute_layers(plan, self.recompute)


def dp(recompute: float = 0, precision: str = "fp32") -> DP:
    """Data parallelism over all devices (gradients all-reduced); ``recompute`` is the
    fraction of repeated layers to checkpoint; ``precision="bf16"`` computes in bf16 with
    fp32 master parameters."""
    return DP(recompute, precision)
