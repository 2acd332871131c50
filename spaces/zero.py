"""ZeRO (stages 1-3) as layouts of the data-parallel step.

Each parameter is split on its largest dim divisible by the dp degree (parameters with
none stay replicated). Stage 1 splits the optimizer update (so the optimizer state);
stage 2 also the gradients (reduce-scattered instead of all-reduced); stage 3 also the
stored parameters, decoupled from their consumers by an identity (all-gathered for use,
gradients reduce-scattered back).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
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
    shard_dim,
    split_classes,
    split_ops,
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
    plan: Plan,
    graph: jscaler.Graph,
    stage: int,
    axis: str | Sequence[str],
    *,
    forward: bool,
    replicas=(),
    only: frozenset[int] | None = None,
) -> Plan:
    """Applies ZeRO's parameter/gradient/optimizer splits over mesh axis ``axis`` (or
    axes: a parameter is sharded over every one of them it is replicated over).

    With ``forward``, also splits the forward ops by batch over the same (single) axis and
    assigns everything (a pure ZeRO-DP plan). ``replicas``: the plan's other mesh axes. A
    parameter its consumers read split over one of them (a Megatron weight over tp), or
    over one of ``axis`` (an expert weight over ep), keeps that split in its update,
    gradient and storage, and ZeRO splits its local shard further over the ZeRO axes it
    is read whole over, each on the largest local dim that axis divides (none: that axis
    replicates it); over the ``replicas`` it is read whole over each shard is replicated
    (ZeRO inside sequence parallelism). ``only``: the parameters to shard (default all).
    """
    axes = [axis] if isinstance(axis, str) else list(axis)
    levels = [*replicas, *axes]
    read = replicas if forward else levels  # a ZeRO-DP plan's ops are not split yet
    outer = {p.id: _consumer_splits(plan, graph, p.id, read) for p in graph.params()}
    # a stacked parameter an exposed scan reads one layer at a time: its layer axis stays
    # whole, and ZeRO-3 gathers each iteration's slice inside the loop (FSDP per layer)
    sliced = {p.id: s for p in graph.params() if (s := _scan_slice(graph, p.id)) is not None}
    algos = {}  # parameter -> per level in ``levels``: the tensor axis split there, or None
    for p in graph.params():
        if only is not None and p.id not in only:
            continue
        local = list(p.shape)
        for other, a in outer[p.id].items():
            if a is not None:
                local[a] //= plan.mesh.shape[other]
        chosen = {name: outer[p.id].get(name) for name in levels}
        first = 1 if p.id in sliced else 0
        for name in axes:
            if chosen[name] is None:
                d = shard_dim(tuple(local[first:]), plan.mesh.shape[name])
                if d is not None:
                    d += first
                    local[d] //= plan.mesh.shape[name]
                chosen[name] = d
        if any(chosen[name] != outer[p.id].get(name) for name in axes):
            algos[p.id] = [chosen[name] for name in levels]
    if stage >= 3:
        stored = [sliced[t].outputs[0] if t in sliced else t for t in algos]
        plan, _ = op_trans(plan, stored, decouple())
    pg = plan.pgraph
    virtual, dims_of, shift = [], {}, {}
    trees = dict(plan.trees)
    for t, dims in algos.items():
        ops = [pg.op(pg.update_ops[_index(pg, t)].id)]
        if stage >= 2:
            ops.append(pg.op(pg.grad_ops[_index(pg, t)].id))
        if stage >= 3 and t in sliced:
            # the slice is stored as the stack is: planned afresh with the identity
            ops.append(pg.op(sliced[t].id))
            ops.append(pg.op(pg.identity_of[sliced[t].outputs[0]]))
            trees.pop(sliced[t].id, None)
            shift[ops[-1].id] = shift[ops[-2].id] = 1
        elif stage >= 3:
            ops.append(pg.op(pg.identity_of[t]))
        virtual.extend(ops)
        dims_of.update((op.id, dims) for op in ops)
    plan = plan.evolve(trees=trees)
    # each op split (or replicated) once per level, as op_trans would one op at a time,
    # in one new plan per level (a slice's identity names the axes of one layer)
    for level, name in enumerate(levels):
        want = {
            op: None if d[level] is None else _letter(d[level] - shift.get(op, 0))
            for op, d in dims_of.items()
        }
        plan = split_ops(plan, want, plan.mesh.shape[name], strict=True)
    if forward:
        (only,) = axes
        n = plan.mesh.shape[only]
        skip = set(pg.identity_of.values()) | {v.id for v in virtual}
        rest = [o for o in pg.graph.ops if o.id not in skip]
        plan = split_classes(
            plan, batch_axes(graph, n), n, ops=rest, classes=DimClasses.for_graph(pg.graph)
        )
        plan = assign_mesh(plan, [only], ops=rest)
    return assign_mesh(plan, levels, ops=virtual)


def _scan_slice(graph: jscaler.Graph, t: int):
    """The ``scan_slice`` op that alone reads parameter ``t`` (a stacked layer weight), or
    None."""
    users = graph.consumers(t)
    if len(users) == 1 and users[0].primitive == "scan_slice":
        return users[0]
    return None


def _letter(axis: int) -> str:
    """The annotation dim of tensor axis ``axis`` in a grad/update/identity op."""
    return chr(ord("a") + axis)


def _consumer_splits(plan: Plan, graph: jscaler.Graph, t: int, axes) -> dict:
    """Mesh axis -> the tensor axis every consumer of parameter ``t`` reads it split along
    over that mesh axis (None: read whole, or the consumers disagree)."""
    if not axes:
        return {}
    mesh = plan.mesh
    users = [(op, k) for op in graph.consumers(t) for k, x in enumerate(op.inputs) if x == t]
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


def zero_over(
    plan: Plan,
    graph: jscaler.Graph,
    stage: int,
    axis: str | Sequence[str] = "dp",
    only: frozenset[int] | None = None,
) -> Plan:
    """ZeRO stage ``stage`` (0: none) over mesh axis ``axis`` of an existing plan, or over
    several (``("dp", "ep")``: a parameter read whole over both is sharded over both, one
    read split over ep only over dp); shards replicated over its other axes. ``only``:
    the parameters to shard (default all)."""
    if stage == 0:
        return plan
    if stage not in (1, 2, 3):
        raise jscaler.PlanError(f"zero={stage!r}: the ZeRO stage must be 0, 1, 2 or 3")
    axes = [axis] if isinstance(axis, str) else list(axis)
    sizes = [plan.mesh.shape.get(a, 1) for a in axes]
    if math.prod(sizes) < 2:
        over = (
            f"the {axes[0]!r} axis, which has 1 device"
            if len(axes) == 1
            else f"the {' x '.join(map(repr, axes))} axes, which have 1 device"
        )
        raise jscaler.PlanError(
            f"zero={stage} shards over {over} in {plan.name or 'this plan'}; leave devices "
            f"for {axes[0]} (e.g. {axes[0]}=2) or drop zero"
        )
    axes = [a for a, n in zip(axes, sizes) if n > 1]
    replicas = [a for a, size in plan.mesh.axes if a not in axes and size > 1]
    return shard_params(plan, graph, stage, axes, forward=False, replicas=replicas, only=only)


def _index(pg, t: int) -> int:
    return next(i for i, o in enumerate(pg.update_ops) if o.inputs[0] == t)


def zero(
    stage: int = 1, dp: int | None = None, recompute: float = 0, precision: str = "fp32"
) -> Zero:
    """ZeRO stage 1, 2 or 3 over ``dp`` devices (default: all); ``recompute`` is the
    fraction of repeated layers to checkpoint; ``precision="bf16"`` computes in bf16 with
    fp32 master parameters and optimizer state."""
    return Zero(stage, dp, recompute, precision)
