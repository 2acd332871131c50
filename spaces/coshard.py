"""Coshard (nnScaler): Megatron tensor parallelism whose per-device work is cut further.

Megatron splits each tensor-parallel region (attention by heads, an MLP by hidden
features) ``tp`` ways. Coshard cuts each device's share into ``colocate`` more pieces
that stay on that device and run one after another, each recomputed in the backward
pass: a device keeps one piece's activations at a time (for attention, the score matrix
of heads/(tp*colocate) heads instead of heads/tp), the memory a plain Megatron plan would
need ``colocate`` times the devices to reach. The partial sums of the region's closing
matmul are added up on the device and all-reduced across devices once, as in Megatron.

The regions are found as Megatron finds them (no names assumed): every op carrying a
tensor-parallel dim class becomes one coshard region.
"""

from __future__ import annotations

from dataclasses import dataclass

import jscaler
from jscaler.plan import DimClasses, Plan, op_trans, recompute_layers
from spaces.megatron import Megatron, tp_regions, tp_seeds


@dataclass(frozen=True)
class Coshard:
    tp: int = 1
    colocate: int = 2
    dp: int | None = None
    recompute: float = 0
    precision: str = "fp32"

    def __call__(self, graph: jscaler.Graph, n_devices: int) -> Plan:
        if isinstance(self.colocate, bool) or not isinstance(self.colocate, int):
            raise jscaler.PlanError(f"coshard: colocate must be an int, got {self.colocate!r}")
        base = Megatron(self.tp, self.dp, precision=self.precision)(graph, n_devices)
        dp = base.mesh.shape["dp"]
        plan = base.evolve(name=f"coshard(tp={self.tp}, colocate={self.colocate}, dp={dp})")
        classes = DimClasses(plan.pgraph.graph)
        regions = 0
        seeds, _ = tp_seeds(graph, classes)
        for ops, seed in tp_regions(classes, seeds, self.tp * self.colocate):
            plan, _ = op_trans(plan, ops, jscaler.coshard(seed, self.colocate))
            regions += 1
        if not regions:
            raise jscaler.PlanError(
                f"coshard(tp={self.tp}, colocate={self.colocate}): no tensor-parallel region "
                f"(attention heads or MLP features) splits into tp x colocate = "
                f"{self.tp * self.colocate} pieces; choose a smaller colocate or tp"
            )
        return recompute_layers(plan, self.recompute)


def coshard(
    tp: int = 1,
    colocate: int = 2,
    dp: int | None = None,
    recompute: float = 0,
    precision: str = "fp32",
) -> Coshard:
    """Megatron tensor parallelism of degree ``tp`` (times data parallelism ``dp``) with
    each device's share of every tensor-parallel region run as ``colocate`` sequential,
    recomputed pieces (nnScaler's coshard)."""
    return Coshard(tp, colocate, dp, recompute, precision)
