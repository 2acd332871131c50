"""Alpha-beta time of one collective on a cluster's links.

Ring algorithms (NCCL's default for large messages): over a group of n devices an
all-reduce moves ``2 (n-1)/n`` of the buffer through every device's link in ``2 (n-1)``
steps; an all-gather or reduce-scatter ``(n-1)/n`` of the full buffer in ``n-1`` steps; an
all-to-all ``(n-1)/n`` of the local buffer; a point-to-point send the whole buffer once.
``algorithm="tree"`` uses ``2 log2 n`` latency steps for all-reduce (NCCL's tree, better
for small messages across nodes). The byte counts are the comm table's (per device): the
gathered result of an all-gather, the input of a reduce-scatter, the buffer otherwise.
"""

from __future__ import annotations

import math

from jscaler.cost.cluster import Cluster

__all__ = ["collective_time"]


def collective_time(
    kind: str, nbytes: float, group, cluster: Cluster, algorithm: str = "ring"
) -> float:
    """Seconds for one ``kind`` collective of ``nbytes`` (per device) over ``group``."""
    n = len(group)
    if n <= 1 or nbytes <= 0:
        return 0.0
    link = cluster.link(group)
    frac = (n - 1) / n
    if kind == "all-reduce":
        steps = 2 * math.ceil(math.log2(n)) if algorithm == "tree" else 2 * (n - 1)
        return steps * link.latency + 2 * frac * nbytes / link.bandwidth
    if kind in ("all-gather", "reduce-scatter", "all-to-all"):
        return (n - 1) * link.latency + frac * nbytes / link.bandwidth
    if kind in ("collective-permute", "send"):
        return link.latency + nbytes / link.bandwidth
    raise ValueError(f"unknown collective {kind!r}")
