"""Data parallelism: every op that carries the batch dim is split over all devices."""

from __future__ import annotations

from dataclasses import dataclass

import jscaler


@dataclass(frozen=True)
class DP:
    """``dp()``: split the batch over every device; parameters replicated."""

    def __call__(self, graph: jscaler.Graph, n_devices: int) -> jscaler.Plan:
        return jscaler.data_parallel(graph, n_devices)


def dp() -> DP:
    """Data parallelism over all devices (gradients all-reduced)."""
    return DP()
