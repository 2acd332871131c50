"""The interlaced pipeline's plan (nnScaler, T5): the embedding over every device.

A huge embedding table does not fit one pipeline stage, and splitting it by vocabulary
over a stage's few devices leaves the other stages idle while it runs. Here stage 0 holds
only the ops before the first repeated layer (the embedding lookup), on a group spanning
all devices with the table split by vocabulary over all of them; the layers are cut into
``pp`` balanced stages on disjoint groups, each under ``megatron(tp, dp)``. With
``head=True`` (the default) the ops after the last layer (the tied LM head, reading the
same table, and the loss) form a last stage on the all-device group too, as the paper
places them. The plan's own schedule (used when none is given) is ``interlaced_head``
(or ``interlaced`` without the head stage), which time-shares the devices.
"""

from __future__ import annotations

from dataclasses import dataclass

import jscaler
from jscaler.plan import DimClasses, MeshSpec, Plan, assign_mesh, split_classes
from schedules.interlaced import interlaced as interlaced_schedule
from schedules.interlaced import interlaced_head
from spaces.knobs import check_int
from spaces.megatron import megatron, tp_seeds


@dataclass(frozen=True)
class Interlaced:
    pp: int = 2
    tp: int = 1
    dp: int | None = None
    precision: str = "fp32"
    head: bool = True
    recompute: float = 0

    def __call__(self, graph: jscaler.Graph, n_devices: int) -> jscaler.PipelinePlan:
        check_int("interlaced", "pp", self.pp)
        if n_devices % self.pp:
            raise jscaler.PlanError(
                f"interlaced(pp={self.pp}) needs a device count divisible by pp; got {n_devices}"
            )
        size = n_devices // self.pp
        graph = jscaler.ir.chunk_loops(graph, self.pp)  # a scanned stack: a scan per chunk
        inner = megatron(
            tp=self.tp, dp=self.dp, precision=self.precision, recompute=self.recompute
        )(graph, size)
        layers = graph.layers()
        if len(layers) < self.pp:
            raise jscaler.PlanError(
                f"interlaced(pp={self.pp}) cuts repeated layers into stages; the graph has "
                f"{len(layers)} ({', '.join(layer.name for layer in layers) or 'none'})"
            )
        # stage 0: everything before the first layer; stage k + 1 from layer k * L / pp
        starts = [
            min(o.id for o in layers[k * len(layers) // self.pp].graph.ops) for k in range(self.pp)
        ]
        groups = [
            jscaler.StageGroup(range(k * size, (k + 1) * size), inner) for k in range(self.pp)
        ]
        groups.append(jscaler.StageGroup(range(n_devices), embedding_over_all(graph, n_devices)))
        what, schedule = "embedding", interlaced_schedule
        if self.head:
            last = max(o.id for o in layers[-1].graph.ops)
            order = [o.id for o in graph.ops]
            tail = order[order.index(last) + 1 :]
            if not tail:
                raise jscaler.PlanError(
                    "interlaced(head=True): no op follows the last repeated layer "
                    f"({layers[-1].name}) to form the head stage; use head=False"
                )
            starts.append(tail[0])
            what, schedule = "embedding and head", interlaced_head
        name = f"interlaced(pp={self.pp}, tp={self.tp}, {what} over {n_devices})"
        return jscaler.PipelinePlan(
            tuple(groups), name, cuts=tuple(starts), whole=(self.pp,), schedule=schedule
        )


def embedding_over_all(graph: jscaler.Graph, n: int) -> Plan:
    """Every embedding table split by vocabulary over n devices; all else replicated."""
    plan = Plan.create(graph, MeshSpec.create(tp=n), name=f"embedding(tp={n})")
    classes = DimClasses.for_graph(plan.pgraph.graph)
    seeds, _ = tp_seeds(graph, classes)
    tables = [(t, axis) for t, axis in seeds if _is_lookup_table(graph, t)]
    if not tables:
        raise jscaler.PlanError("interlaced: the graph has no embedding lookup to split")
    for t, _ in tables:
        if graph.tensors[t].shape[0] % n:
            raise jscaler.PlanError(
                f"interlaced: embedding {graph.tensors[t].name!r} has vocabulary "
                f"{graph.tensors[t].shape[0]}, which does not split over {n} devices"
            )
    plan = split_classes(plan, tables, n, classes=classes)
    return assign_mesh(plan, ["tp"])


def _is_lookup_table(graph: jscaler.Graph, t: int) -> bool:
    return any(op.primitive == "gather" for op in graph.consumers(t))


def interlaced(
    pp: int = 2,
    tp: int = 1,
    dp: int | None = None,
    precision: str = "fp32",
    head: bool = True,
    recompute: float = 0,
):
    """The interlaced pipeline: ``pp`` stages of layers (each ``megatron(tp, dp)``) and the
    embedding (with ``head``, also the ops after the last layer: the tied LM head and the
    loss) split by vocabulary over every device. Runs with ``schedules.interlaced_head``
    (``schedules.interlaced`` without the head); ``recompute``: the fraction of repeated
    layers to checkpoint."""
    return Interlaced(pp, tp, dp, precision, head, recompute)
