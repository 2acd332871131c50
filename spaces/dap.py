"""Dynamic axial parallelism (DAP, FastFold): split the representations along an axis.

AlphaFold2's activations are ``[batch, axis, axis, channels]`` (the MSA ``[s, r]``, the pair
``[r, r]``) and dwarf its weights, so tensor parallelism over channels saves little while
splitting an *axis* divides the activations. Each Evoformer module updates along one axis
(row attention along residues within an MSA row, column attention along the rows within a
residue, the triangle updates along one pair axis), so it runs locally when split along
the other axis; between modules that want different axes the layout switches with an
all-to-all, and a module needing a whole tensor (the pair bias of row attention, the
second projection of a triangle multiplication) all-gathers it.

``dap(dap, dp)`` does this from the graph, without names. The *axial* classes are the
middle axes (neither batch nor channels) of the first repeated layer's activation inputs.
Ops are visited in graph order and each is split over the ``dap`` mesh axis along one
axial dim:

1. only a dim it can split whole (no partial sums), of a size ``dap`` divides;
2. preferring a dim whose class the op carries once (column attention's scores carry the
   rows twice, as queries and keys, and the residues once: they split by residues);
3. then the dim its inputs already arrive split along (no data moves);
4. then the first such dim of its output.

Ops without an axial dim (weights, the loss's scalars) replicate over ``dap``; parameters
stay whole, their gradients reduced over ``dp`` and ``dap`` together. The layouts imply the
all-gathers and all-to-alls; XLA emits them.
"""

from __future__ import annotations

from dataclasses import dataclass

import jscaler
from jscaler.plan import (
    DimClasses,
    MeshSpec,
    Plan,
    assign_mesh,
    batch_axes,
    recompute_layers,
    split_classes,
    split_ops,
)
from spaces.megatron import infer_dp
from spaces.zero import zero_over


def axial_classes(graph: jscaler.Graph, classes: DimClasses) -> set:
    """The classes of the middle axes of the first repeated layer's activation inputs."""
    layers = graph.layers()
    if not layers:
        raise jscaler.PlanError(
            "dap: the graph has no repeated layers (a module list such as blocks/0, "
            "blocks/1, ...) whose inputs would show the representations' axes; use dp() "
            "or megatron()"
        )
    first = layers[0].graph
    roots = set()
    for t in first.inputs:
        tensor = graph.tensors[t]
        if tensor.role != "value" or len(tensor.shape) < 3:
            continue
        roots |= {classes.of(t, axis) for axis in range(1, len(tensor.shape) - 1)}
    if not roots:
        raise jscaler.PlanError(
            f"dap: the first repeated layer ({layers[0].name}) reads no activation of rank "
            f">= 3 ([batch, axis..., channels]); there is no axis to split"
        )
    return roots


def _choose(op, classes: DimClasses, axial: set, layout: dict, n: int) -> str | None:
    ann = op.annotation
    if ann is None:
        return None
    count = {}
    for d in ann.dims:
        for r in axial:
            if d in classes.dims_in(op, r):
                count[d] = len(classes.dims_in(op, r))
    ok = [
        d for d in ann.splittable() if d in count and ann.kinds[d] == "" and ann.sizes[d] % n == 0
    ]
    if not ok:
        return None
    arrived = []
    for dims, t in zip(ann.inputs, op.inputs):
        axis = layout.get(t) if isinstance(t, int) else None
        if axis is not None and dims[axis][0] in ok:
            arrived.append(dims[axis][0])
    out_order = [ax[0] for t in ann.outputs for ax in t]
    order = {d: out_order.index(d) if d in out_order else len(out_order) for d in ok}
    return min(ok, key=lambda d: (count[d] > 1, d not in arrived, order[d]))


def axial_split(plan: Plan, graph: jscaler.Graph, n: int, classes: DimClasses) -> Plan:
    """Splits every op n ways along an axial dim (see the module doc); replicates the rest."""
    axial = axial_classes(graph, classes)
    layout: dict[int, int] = {}  # tensor -> the axis it is split along
    dims = {}
    for op in graph.ops:
        dims[op.id] = dim = _choose(op, classes, axial, layout, n)
        for out, t in zip(op.annotation.outputs if op.annotation else (), op.outputs):
            axis = next((a for a, ax in enumerate(out) if ax[0] == dim), None)
            if axis is not None:
                layout[t] = axis
    return split_ops(plan, dims, n)


@dataclass(frozen=True)
class DAP:
    dap: int = 2
    dp: int | None = None
    recompute: float = 0
    zero: int = 0

    def __call__(self, graph: jscaler.Graph, n_devices: int) -> Plan:
        dp = infer_dp(n_devices, self.dap, 1, self.dp, "dap")
        mesh = MeshSpec.create(dp=dp, dap=self.dap)
        plan = Plan.create(graph, mesh, name=f"dap(dap={self.dap}, dp={dp})")
        classes = DimClasses.for_graph(plan.pgraph.graph)
        plan = split_classes(plan, batch_axes(graph, dp), dp, classes=classes)
        plan = axial_split(plan, plan.pgraph.graph, self.dap, classes)
        plan = zero_over(assign_mesh(plan, ["dp", "dap"]), graph, self.zero)
        return recompute_layers(plan, self.recompute)


def dap(dap: int = 2, dp: int | None = None, recompute: float = 0, zero: int = 0) -> DAP:
    """Dynamic axial parallelism of degree ``dap`` (activations split along an axis of
    the representations, switching axes between modules) times data parallelism ``dp``
    (inferred as devices / dap when not given); ``zero`` = ZeRO stage over dp."""
    return DAP(dap, dp, recompute, zero)
