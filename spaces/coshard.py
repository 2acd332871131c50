"""Coshard (nnScaler): Megatron tensor parallelism whose per-device work is cut further.

Megatron splits each tensor-parallel region (attention by heads, an MLP by hidden
features) ``tp`` ways. Coshard cuts each device's share into ``colocate`` more pieces
that stay on that device and run one after another, each recomputed in the backward
pass: a device keeps one piece's activations at a time (for attention, the score matrix
of heads/(tp*colocate) heads instead of heads/tp), the memory a plain Megatron plan would
need ``colocate`` times the devices to reach. The partial sums of the region's closing
matmul are added up on the device and all-reduced across devices once, as in Megatron.

The regions are found as Megatron finds them (no names assumed): every op carrying a
tensor-parallel dim class becomes one coshard region. As in the paper's Swin plan, only
the layers where activations dominate are cosharded (``layers``: the first k repeated
layers; by default those whose largest activation exceeds half the largest of any
layer: Swin's high-resolution first stage, every layer of a uniform stack); the rest are
plain Megatron. ``pp > 1`` pipelines the layers over ``pp`` groups, each running this
plan on its own devices.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import jscaler
from jscaler.plan import DimClasses, Plan, op_trans, recompute_layers
from spaces.knobs import check_int
from spaces.megatron import Megatron, pipeline, tp_regions, tp_seeds


@dataclass(frozen=True)
class Coshard:
    tp: int = 2
    colocate: int = 2
    dp: int | None = None
    pp: int = 1
    layers: int | None = None
    recompute: float = 0
    precision: str = "fp32"

    def __call__(self, graph: jscaler.Graph, n_devices: int) -> Plan | jscaler.PipelinePlan:
        check_int("coshard", "colocate", self.colocate)
        check_int("coshard", "pp", self.pp)
        if self.pp > 1:
            if n_devices % self.pp:
                raise jscaler.PlanError(
                    f"coshard(pp={self.pp}) needs a device count divisible by pp; got {n_devices}"
                )
            return pipeline(graph, replace(self, dp=None, pp=1), self.pp, n_devices)
        base = Megatron(self.tp, self.dp, precision=self.precision)(graph, n_devices)
        dp = base.mesh.shape["dp"]
        plan = base.evolve(name=f"coshard(tp={self.tp}, colocate={self.colocate}, dp={dp})")
        classes = DimClasses.for_graph(plan.pgraph.graph)
        chosen = _chosen_ops(graph, self.layers)
        regions = 0
        seeds, _ = tp_seeds(graph, classes)
        for ops, seed in tp_regions(classes, seeds, self.tp * self.colocate):
            if chosen is not None and not all(o.id in chosen for o in ops):
                continue
            plan, _ = op_trans(plan, ops, jscaler.coshard(seed, self.colocate))
            regions += 1
        if not regions:
            raise jscaler.PlanError(
                f"coshard(tp={self.tp}, colocate={self.colocate}): no tensor-parallel region "
                f"(attention heads or MLP features) splits into tp x colocate = "
                f"{self.tp * self.colocate} pieces; choose a smaller colocate or tp"
            )
        return recompute_layers(plan, self.recompute)


def _chosen_ops(graph: jscaler.Graph, layers: int | None) -> set[int] | None:
    """Op ids of the layers to coshard (None: every op, for a graph without layers)."""
    found = graph.layers()
    if not found:
        return None
    if layers is None:
        peak = [
            max(graph.tensors[t].size for o in lay.graph.ops for t in o.outputs) for lay in found
        ]
        picked = [lay for lay, p in zip(found, peak) if p > max(peak) / 2]
    else:
        check_int("coshard", "layers", layers)
        picked = found[:layers]
    return {o.id for lay in picked for o in lay.graph.ops}


def coshard(
    tp: int = 2,
    colocate: int = 2,
    dp: int | None = None,
    pp: int = 1,
    layers: int | None = None,
    recompute: float = 0,
    precision: str = "fp32",
) -> Coshard:
    """Megatron tensor parallelism of degree ``tp`` (times data parallelism ``dp``) with
    each device's share of the tensor-parallel regions in the activation-heavy layers
    (``layers``: the first k; default: those whose largest activation exceeds half the
    largest) run as ``colocate`` sequential, recomputed pieces (nnScaler's coshard);
    ``pp`` pipeline stages of it."""
    return Coshard(tp, colocate, dp, pp, layers, recompute, precision)
