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

__all__ = ["Combined", "collective_time"]


def collective_time(
    kind: str,
    nbytes: float,
    group,
    cluster: Cluster,
    algorithm: str = "ring",
    latency: bool = True,
) -> float:
    """Seconds for one ``kind`` collective of ``nbytes`` (per device) over ``group``;
    ``latency=False``: the bandwidth term only, for a collective XLA's combiner merges
    with others (the merged one pays the latency once)."""
    n = len(group)
    if n <= 1 or nbytes <= 0:
        return 0.0
    link = cluster.link(group)
    hop = link.latency if latency else 0.0
    frac = (n - 1) / n
    if kind == "all-reduce":
        steps = 2 * math.ceil(math.log2(n)) if algorithm == "tree" else 2 * (n - 1)
        return steps * hop + 2 * frac * nbytes / link.bandwidth
    if kind in ("all-gather", "reduce-scatter", "all-to-all"):
        return (n - 1) * hop + frac * nbytes / link.bandwidth
    if kind in ("collective-permute", "send"):
        return hop + nbytes / link.bandwidth
    raise ValueError(f"unknown collective {kind!r}")


class Combined:
    """Independent collectives that XLA's combiner merges (parameter-gradient reductions,
    the ZeRO all-gathers after the update): per key, kind and device group, consecutive
    ones are packed into buckets of up to ``cluster.combine_bytes``, each bucket timed as
    one collective, so the latency is paid per bucket, not per tensor."""

    def __init__(self, cluster: Cluster, algorithm: str = "ring"):
        self.cluster, self.algorithm = cluster, algorithm
        self._buckets: dict[tuple, list[float]] = {}

    def add(self, key, kind: str, group, nbytes: float) -> None:
        sizes = self._buckets.setdefault((key, kind, tuple(group)), [0.0])
        if sizes[-1] and sizes[-1] + nbytes > self.cluster.combine_bytes:
            sizes.append(0.0)
        sizes[-1] += nbytes

    def buckets(self) -> list[tuple]:
        """Each merged collective as ``(key, kind, group, bytes, seconds)``, in the order
        the collectives were added."""
        return [
            (key, kind, group, b, collective_time(kind, b, group, self.cluster, self.algorithm))
            for (key, kind, group), sizes in self._buckets.items()
            for b in sizes
        ]

    def seconds(self) -> dict:
        """key -> seconds of its merged collectives."""
        out: dict = {}
        for key, _, _, _, t in self.buckets():
            out[key] = out.get(key, 0.0) + t
        return out
