"""ZeRO (stages 1-3) as layouts of the data-parallel step.

Each parameter is split on its largest dim divisible by the dp degree (parameters with
none stay replicated). Stage 1 splits the optimizer update (so the optimizer state);
stage 2 also the gradients (reduce-scattered instead of all-reduced); stage 3 also the
stored parameters, decoupled from their consumers by an identity (all-gathered for use,
gradients reduce-scattered back).
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
    decouple,
    op_pieces,
    op_trans,
    recompute_layers,
    replicate,
    shard_dim,
    split,
    split_classes,
)


@dataclass(frozen=True)
class Zero:
    stage: int = 1
    dp: int | None = None
    recompute: float = 0
    precision: str = "fp32"

    def __call__(self, graph: jscaler.Graph, n_devices: int) -> Plan:
        if self.stage not in (1, 2, 3):
            raise jscaler.PlanError(f"zero(stage={self.stage!r}): stage must be 1, 2 or 3")
        dp = n_devices if self.dp is None else self.dp
        if isinstance(dp, bool) or not isinstance(dp, int) or dp != n_devices:
            raise jscaler.PlanError(
                f"zero(dp={dp!r}): dp must be the device count, {n_devices}, or left out"
            )
        plan = Plan.create(graph, MeshSpec.create(dp=dp), name=f"zero(stage={self.stage}, dp={dp})")
        plan = shard_params(plan, graph, self.stage, "dp", forward=True)
        return recompute_layers(plan, self.recompute)


def shard_params(
    plan: Plan, graph: jscaler.Graph, stage: int, axis: str, *, forward: bool, replicas=()
) -> Plan:
    """Applies ZeRO's parameter/gradient/optimizer splits over mesh axis ``axis``.

    With ``forward``, also splits the forward ops by batch over the same axis and assigns
    everything (a pure ZeRO-DP plan). ``replicas``: the plan's other mesh axes. A
    parameter its consumers read split over one of them (a Megatron weight over tp) keeps
    that split in its update, gradient and storage, and ZeRO splits its local shard
    further; over the others each shard is replicated (ZeRO inside sequence parallelism).
    """
    n = plan.mesh.shape[axis]
    outer = {p.id: _consumer_splits(plan, graph, p.id, replicas) for p in graph.params()}
    dims = {}
    for p in graph.params():
        local = list(p.shape)
        for other, a in outer[p.id].items():
            if a is not None:
                local[a] //= plan.mesh.shape[other]
        dims[p.id] = shard_dim(tuple(local), n)
    if stage >= 3:
        plan, _ = op_trans(plan, [t for t, d in dims.items() if d is not None], decouple())
    pg = plan.pgraph
    virtual = []
    for t, d in dims.items():
        if d is None:
            continue
        ops = [pg.op(pg.update_ops[_index(pg, t)].id)]
        if stage >= 2:
            ops.append(pg.op(pg.grad_ops[_index(pg, t)].id))
        if stage >= 3:
            ops.append(pg.op(pg.identity_of[t]))
        for op in ops:
            for other in replicas:
                a = outer[t][other]
                size = plan.mesh.shape[other]
                algo = replicate() if a is None else split(_letter(a))
                plan, _ = op_trans(plan, op.id, algo, size)
            plan, _ = op_trans(plan, op.id, split(_letter(d)), n)
            virtual.append(op)
    if forward:
        identities = set(pg.identity_of.values())
        rest = [o for o in pg.graph.ops if o.id not in identities]
        plan = split_classes(
            plan, batch_axes(graph, n), n, ops=rest, classes=DimClasses.for_graph(pg.graph)
        )
        plan = assign_mesh(plan, [axis], ops=rest)
    return assign_mesh(plan, [*replicas, axis], ops=virtual)


def _letter(axis: int) -> str:
    """The annotation dim of tensor axis ``axis`` in a grad/update/identity op."""
    return chr(ord("a") + axis)


def _consumer_splits(plan: Plan, graph: jscaler.Graph, t: int, axes) -> dict:
    """Mesh axis -> the tensor axis every consumer of parameter ``t`` reads it split along
    over that mesh axis (None: read whole, or the consumers disagree)."""
    if not axes:
        return {}
    mesh = plan.mesh
    users = [(op, k) for op in graph.ops for k, x in enumerate(op.inputs) if x == t]
    origin = mesh.device_at({})
    out = {}
    for name in axes:
        other = mesh.device_at({name: 1})
        found = set()
        for op, k in users:
            pieces = {p.device: p for p in op_pieces(plan, op)}
            if origin not in pieces or other not in pieces:
                found.add(None)
                continue
            a, b = pieces[origin].inputs[k], pieces[other].inputs[k]
            moved = [i for i in range(len(a.slices)) if a.slices[i] != b.slices[i]]
            found.add(moved[0] if len(moved) == 1 else None)
        out[name] = found.pop() if len(found) == 1 else None
    return out


def zero_over(plan: Plan, graph: jscaler.Graph, stage: int, axis: str = "dp") -> Plan:
    """ZeRO stage ``stage`` (0: none) over mesh axis ``axis`` of an existing plan, shards
    replicated over its other axes."""
    if stage == 0:
        return plan
    if stage not in (1, 2, 3):
        raise jscaler.PlanError(f"zero={stage!r}: the ZeRO stage must be 0, 1, 2 or 3")
    if plan.mesh.shape.get(axis, 1) < 2:
        raise jscaler.PlanError(
            f"zero={stage} shards over the {axis!r} axis, which has "
            f"{plan.mesh.shape.get(axis, 1)} device in {plan.name or 'this plan'}; leave "
            f"devices for {axis} (e.g. dp=2) or drop zero"
        )
    replicas = [a for a, size in plan.mesh.axes if a != axis and size > 1]
    return shard_params(plan, graph, stage, axis, forward=False, replicas=replicas)


def _index(pg, t: int) -> int:
    return next(i for i, o in enumerate(pg.update_ops) if o.inputs[0] == t)


def zero(
    stage: int = 1, dp: int | None = None, recompute: float = 0, precision: str = "fp32"
) -> Zero:
    """ZeRO stage 1, 2 or 3 over ``dp`` devices (default: all); ``recompute`` is the
    fraction of repeated layers to checkpoint; ``precision="bf16"`` computes in bf16 with
    fp32 master parameters and optimizer state."""
    return Zero(stage, dp, recompute, precision)
