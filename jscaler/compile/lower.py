"""Lowering a validated plan to one SPMD JAX program.

Every tensor gets the layout its pieces imply: parameters, state and batch are stored
with NamedShardings; before an op runs, its inputs are constrained to the layouts its
pieces read; after it runs, its outputs to the layouts its pieces write. XLA's SPMD
partitioner inserts the collectives between the two.

Partial sums stay under the plan's control: an op split along a '+' dim (a dot's
contracting dim, a ``ragged_dot``'s groups) runs as a ``shard_map`` region that computes
the local partial result and reduces it right there with the collective the consumers
ask for: ``psum`` (all-reduce), or ``psum_scatter`` (reduce-scatter) when every consumer
wants the result split along one more axis over the same devices. (The embedding
lookup's vocabulary split is left to XLA, which masks the lookups and reduces at the
output constraint.)

Manual regions (``plan.regions``: ring attention, coshard, marked ``shard_map`` regions)
run as one ``shard_map`` each, at the position of the region's last op
(:mod:`jscaler.compile.regions`). Colocated pieces of an op (coshard) share a device and
lower as their union.

Backward is JAX autodiff of this forward; random ops keep single-device bits because
threefry is partitionable.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import jax
import numpy as np
from jax._src import source_info_util
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import AxisType, Mesh, NamedSharding

from jscaler.compile.layout import Layout, layout_of, reduced_layout, replicated, spread_layout
from jscaler.compile.local import first_group, ragged_piece, transition, vary, varying
from jscaler.compile.regions import manual_regions
from jscaler.compile.reshard import loop_regathers, reshard_units, run_resharded
from jscaler.compile.segment import Segment
from jscaler.compile.softmax import softmax_outputs, with_softmax_rule
from jscaler.errors import LayoutError
from jscaler.ir.expose import loop_groups, run_loop
from jscaler.ir.graph import LOOP_PRIMITIVES, Literal, Loop, Op
from jscaler.ir.memo import Memoized
from jscaler.ir.rules_elementwise import PLACEMENT
from jscaler.plan.pieces import device_pieces
from jscaler.plan.plan import Plan

__all__ = ["Lowered", "lower", "run_ops"]

# what the backward of an exposed scan keeps per iteration: the matmuls' outputs and the
# collectives' results (the body's inputs too); the elementwise ops between them are
# rerun from those, as a fusing compiler does across an unrolled model's layers, and no
# collective runs twice. Keeping every residual instead costs, on a scanned Llama (d 512,
# 4 layers, seq 256), megatron(tp=8) 958 MB of temp against 481
_COLLECTIVES = {
    "psum", "psum_invariant", "all_gather", "all_gather_invariant", "reduce_scatter",
    "all_to_all", "ppermute", "ragged_all_to_all", "pmax", "pmin",
}  # fmt: skip


CONVERTED = "jscaler.converted"  # an op's input re-laid for it (GSPMD's collectives)


def _kept_converted(low: Lowered, op: Op, x: int) -> bool:
    """Whether a scan's backward keeps ``x`` as re-laid for ``op`` (a gathered activation)
    rather than re-laying it again; ZeRO-3's gathered weights are gathered again where
    that saves memory (:func:`loop_regathers`)."""
    made = low.plan.pgraph.graph.producer(x)
    if op.kind == "identity":
        return False
    return made is None or made.kind != "identity" or not loop_regathers(low, op.loop)


def loop_saves(prim, *args, **params) -> bool:
    """The ``jax.checkpoint`` policy of an exposed scan's body (see above)."""
    if prim.name in _COLLECTIVES or prim.name == "name" and params.get("name") == CONVERTED:
        return True
    return jax.checkpoint_policies.dots_saveable(prim, *args, **params)


SHARD_MAP_PARTIAL = {"dot_general", "conv_general_dilated", "reduce_sum", "ragged_dot_general"}


@dataclass(frozen=True, eq=False)
class OpLayouts:
    inputs: tuple[Layout | None, ...]  # None: a literal
    outputs: tuple[Layout, ...]  # produced; may be partial


@dataclass(frozen=True, eq=False)
class Lowered(Memoized):
    """A plan lowered onto concrete devices: the mesh, every layout, and the forward."""

    plan: Plan
    mesh: Mesh | None  # None: layouts only (lower(plan, None))
    ops: dict[int, OpLayouts]
    storage: dict[int, Layout]  # graph input tensor -> stored layout
    targets: dict[int, Layout]  # tensor -> the layout its consumers agree on (reduced)
    grad: dict[int, Layout]  # param tensor -> gradient layout
    update: dict[int, Layout]  # param tensor -> optimizer update / state layout
    regions: dict = field(default_factory=dict)  # op id -> ManualRegion it belongs to
    prefetch: dict = field(default_factory=dict)  # op id -> Prefetch to run before it
    # division op id -> (x, axes): it completes softmax(x), differentiated by softmax's rule
    softmax: dict = field(default_factory=dict)

    def sharding(self, layout: Layout) -> NamedSharding:
        return NamedSharding(self.mesh, layout.pspec())

    def accumulator(self, t: int) -> Layout:
        """Where a pipeline stage keeps parameter ``t``'s gradient summed over the
        micro-batches: its gradient layout split over every mesh axis that leaves whole
        (:func:`spread_layout`), so each micro-batch's gradient is reduce-scattered into
        it (or sliced, where it is whole on every device) rather than all-reduced."""
        g = self.plan.pgraph.graph
        return spread_layout(self.grad[t].reduced, g.tensors[t].shape, self.plan.mesh.axes)

    def input_shardings(self) -> list[NamedSharding]:
        g = self.plan.pgraph.graph
        return [self.sharding(self.storage[t]) for t in g.inputs]

    def forward(self, *flat_inputs):
        """Values of the graph outputs (loss, new state) under the plan's layouts."""
        return _run(self, flat_inputs)


def lower(plan: Plan, devices) -> Lowered:
    """Lowers a validated plan onto ``devices`` (device i of the plan = ``devices[i]``);
    ``devices=None`` gives the layouts alone (no mesh: for the cost model, which plans
    for devices this process does not have; computed once per plan)."""
    if devices is None:
        return plan.memo((lower,), lambda: _lower(plan, None))
    return _lower(plan, devices)


def _lower(plan: Plan, devices) -> Lowered:
    spec = plan.mesh
    mesh = None
    if devices is not None:
        arr = np.array([devices[i] for i in spec.devices], dtype=object).reshape(
            [s for _, s in spec.axes]
        )
        mesh = Mesh(arr, spec.names, axis_types=(AxisType.Auto,) * len(spec.axes))
    pg = plan.pgraph
    g = pg.graph
    ops = {op.id: _shared_layouts(plan, op) for op in g.ops}
    wants: dict[int, list[Layout]] = {}
    for op in g.ops:
        for x, lay in zip(op.inputs, ops[op.id].inputs):
            if not isinstance(x, Literal):
                wants.setdefault(x, []).append(lay)
    for x in g.outputs:
        if not isinstance(x, Literal):
            wants.setdefault(x, []).append(replicated(len(g.tensors[x].shape)))
    targets = {t: ls[0] for t, ls in wants.items() if all(lay == ls[0] for lay in ls)}
    storage = {t: targets.get(t, replicated(len(g.tensors[t].shape))) for t in g.inputs}
    grad, update = {}, {}
    for table, vops in ((grad, pg.grad_ops), (update, pg.update_ops)):
        for vop in vops:
            param = vop.inputs[0]
            if vop.id in plan.trees:
                table[param] = _op_layouts(plan, vop).outputs[0]
            else:
                table[param] = storage[param]
    regions = manual_regions(plan)
    prefetch = _prefetch_schedule(plan)
    softmax = softmax_outputs(g)
    return Lowered(plan, mesh, ops, storage, targets, grad, update, regions, prefetch, softmax)


@dataclass(frozen=True)
class Prefetch:
    """Gather the next layer's stored parameters while this layer runs (FSDP's prefetch):
    ``identities`` run when the layer reading ``carriers`` starts, not earlier, not later."""

    identities: tuple[Op, ...]
    carriers: tuple[int, ...]


def _prefetch_schedule(plan: Plan) -> dict[int, Prefetch]:
    """First op of layer i -> the identity ops (ZeRO-3 gathers) of layer i+1.

    Left to itself XLA's scheduler may issue every gather at the start of the step, so every
    full parameter is alive before the first layer runs. Recomputed layers keep their
    gathers where they are (inside the recomputed segment)."""
    g = plan.pgraph.graph
    identities = {o.id for o in g.ops if o.kind == "identity"}
    if not identities:
        return {}
    layers = g.layers()
    inputs = set(g.inputs)
    position = {o.id: k for k, o in enumerate(g.ops)}
    out = {}
    for cur, nxt in zip(layers, layers[1:]):
        ops = [o for o in nxt.graph.ops if o.id in identities]
        if not ops or any(plan.is_recomputed(o.id) for o in (*cur.graph.ops, *nxt.graph.ops)):
            continue
        inside = {o.id for o in cur.graph.ops}
        carriers = []
        for o in cur.graph.ops:
            for x in o.tensor_inputs:
                p = g.producer(x)
                if x not in inputs and p is not None and p.id not in inside:
                    carriers.append(x)
        start = position[cur.graph.ops[0].id]
        # a layer run several times (recycling passes) reads values made after its first
        # op: no prefetch there
        if carriers and all(position[g.producer(x).id] < start for x in carriers):
            out[cur.graph.ops[0].id] = Prefetch(tuple(ops), tuple(dict.fromkeys(carriers)))
    return out


# layouts by what they depend on, shared by a model's repeated layers and by the many plans
# of one search, which differ in a few ops' trees (cleared when full)
_LAYOUTS: dict[tuple, OpLayouts] = {}
_LAYOUTS_MAX = 1 << 16


def _shared_layouts(plan: Plan, op: Op) -> OpLayouts:
    key = _layout_key(plan, op)
    found = _LAYOUTS.get(key)
    if found is None:
        found = _op_layouts(plan, op)
        if len(_LAYOUTS) >= _LAYOUTS_MAX:
            _LAYOUTS.clear()
        _LAYOUTS[key] = found
    return found


def _layout_key(plan: Plan, op: Op) -> tuple:
    """What an op's layouts depend on: the mesh, its annotation, its operands' shapes
    (None for a literal) and its sub-op tree (devices included)."""
    tensors = plan.pgraph.graph.tensors
    ins = tuple(None if isinstance(x, Literal) else tensors[x].shape for x in op.inputs)
    outs = tuple(tensors[x].shape for x in op.outputs)
    return (plan.mesh, op.annotation, ins, outs, plan.tree(op.id))


def _op_layouts(plan: Plan, op: Op) -> OpLayouts:
    pieces, _ = device_pieces(plan, op)
    by_device = {}
    for p in pieces:
        if p.device in by_device:
            raise LayoutError(
                f"{op.where} has two pieces on device {p.device} that are not one split of a "
                f"piece; one SPMD program runs one piece of each op per device. Colocate "
                f"pieces with coshard (split a device's piece further, on the same device)"
            )
        by_device[p.device] = p
    tensors = plan.pgraph.graph.tensors
    ins = []
    for k, x in enumerate(op.inputs):
        if isinstance(x, Literal):
            ins.append(None)
            continue
        masks = {d: p.inputs[k] for d, p in by_device.items()}
        ins.append(layout_of(plan.mesh, tensors[x].shape, masks, f"input {k} of {op.where}"))
    outs = []
    for k, x in enumerate(op.outputs):
        masks = {d: p.outputs[k] for d, p in by_device.items()}
        outs.append(layout_of(plan.mesh, tensors[x].shape, masks, f"output {k} of {op.where}"))
    return OpLayouts(tuple(ins), tuple(outs))


# ---- running the forward -------------------------------------------------------------


def _constrain(low: Lowered, x, layout: Layout):
    return jax.lax.with_sharding_constraint(x, low.sharding(layout))


def _bind(op: Op, ins):
    if op.primitive in PLACEMENT:  # the plan's layouts replace the user's
        return list(ins)
    eqn = op.eqn
    params = eqn.primitive.get_bind_params(eqn.params)
    with eqn.ctx.manager:
        out = eqn.primitive.bind(*ins, **params)
    return list(out) if eqn.primitive.multiple_results else [out]


def _run(low: Lowered, flat_inputs):
    g = low.plan.pgraph.graph
    env = dict(g.consts)
    have: dict[int, Layout] = {}
    for t, v in zip(g.inputs, flat_inputs):
        env[t] = v
        have[t] = low.storage[t]
    run_ops(low, g.ops, env, have)
    return [x.value if isinstance(x, Literal) else env[x] for x in g.outputs]


def run_ops(low: Lowered, ops, env: dict, have: dict, inside: Loop | None = None) -> None:
    """Runs ``ops`` (a subset of the plan graph's ops, in its order: the whole forward, or
    one pipeline stage) on ``env`` (tensor -> value) whose values are laid out as ``have``
    (tensor -> Layout) says; both are updated with every output.

    The ops of an exposed scan run as one ``jax.lax.scan`` (:func:`_run_loop`; ``inside``:
    the scan whose body ``ops`` are). A prefetch runs only when the layer it gathers for is
    among ``ops``; a manual region runs at its last op, so all of its ops must be among
    ``ops``."""
    for loop, group in loop_groups(ops, inside):
        if loop is None:
            _run_plain(low, group, env, have)
        else:
            _run_loop(low, group, env, have)


def _run_loop(low: Lowered, ops: list[Op], env: dict, have: dict) -> None:
    """One exposed scan: its stacked inputs and initial carries enter with the layouts its
    boundary ops read, a carry leaves each iteration in the layout it entered with, and the
    results leave with the layouts the boundary ops write. The body runs under
    ``jax.checkpoint`` with :func:`loop_saves`."""
    loop = ops[0].loop

    def lay(o: Op, k: int) -> Layout:
        lays = low.ops[o.id]
        return lays.inputs[0] if k == 0 else lays.outputs[0]

    def enter(o: Op, v):  # a stack, an initial carry: before the loop
        return _constrain(low, v, lay(o, 0))

    def carry(o: Op, v):  # a carry leaves each iteration as it entered
        return _constrain(low, v, lay(o, 1))

    def leave(o: Op, v):  # a final carry, a stacked output: after the loop
        return _constrain(low, v, lay(o, 1))

    def body(body_ops, local):
        inner = dict(have)
        for o in ops:
            if o.primitive in ("scan_carry", "scan_slice"):
                inner[o.outputs[0]] = lay(o, 1)
        run_ops(low, body_ops, local, inner, loop)

    # inside the body nothing else is re-laid: a slice inherits its stack's layout (a
    # constraint on it would make the backward keep a copy of every layer's weights), and
    # so does a stacked output its slices'. A body the user checkpointed whole runs under
    # their policy alone (its segment)
    body_ops = [o for o in ops if o.primitive not in LOOP_PRIMITIVES]
    policy = None if all(o.remat is not None for o in body_ops) else loop_saves
    run_loop(ops, env, body, enter, carry, leave, policy)
    for o in ops:
        if o.primitive in ("scan_final", "scan_stack"):
            have[o.outputs[0]] = lay(o, 1)


def _run_plain(low: Lowered, ops, env: dict, have: dict) -> None:
    ids = {o.id for o in ops}
    done: set[int] = set()
    units = reshard_units(low, ops)
    in_units = {o.id for unit in units.values() for o in unit}
    for policy, seg in _segments(low.plan, ops):
        if policy is not False:  # a recompute group, or a user's checkpoint in a scan
            _run_checkpointed(low, seg, env, have, policy)
            continue
        for op in seg:
            if op.id in units:
                run_resharded(low, units[op.id], env, have, _run_op)
                done.update(o.id for o in units[op.id])
            pre = low.prefetch.get(op.id)
            if (
                pre is not None
                and all(o.id in ids for o in pre.identities)
                and not any(o.id in in_units for o in pre.identities)
            ):
                _run_prefetch(low, pre, env, have, done)
            if op.id not in done:
                _run_op(low, op, env, have)


def _run_prefetch(low: Lowered, pre: Prefetch, env, have, done: set[int]) -> None:
    """Runs the next layer's gathers between two optimization barriers tied to this
    layer's inputs: they start once the layer's inputs exist and finish before it runs."""
    barrier = jax.lax.optimization_barrier
    stored = [op.inputs[0] for op in pre.identities]
    carried = [env[t] for t in pre.carriers]
    vals, carried = barrier(([env[t] for t in stored], carried))
    for op, t, v in zip(pre.identities, stored, vals):
        env[t] = v
        _run_op(low, op, env, have)
        done.add(op.id)
    outs = [op.outputs[0] for op in pre.identities]
    vals, carried = barrier(([env[t] for t in outs], carried))
    env.update(zip(outs, vals))
    env.update(zip(pre.carriers, carried))


def _segments(plan: Plan, ops):
    """Consecutive runs of ops, grouped by recompute group, else by the user checkpoint
    they ran under in a scan's body: ``(checkpoint policy or None, ops)``; (False, ops)
    for a run that is not rematerialised."""
    group_of = {}
    for i, grp in enumerate(plan.recompute):
        for op_id in grp:
            group_of[op_id] = i
    out: list[tuple[object, object, list[Op]]] = []  # (group key, policy, ops)
    for op in ops:
        grp = group_of.get(op.id)
        if grp is not None:
            key, policy = ("plan", grp), None
        elif op.remat is not None:
            key, policy = ("user", op.remat), op.remat.policy
        else:
            key, policy = None, False
        if out and out[-1][0] == key:
            out[-1][2].append(op)
        else:
            out.append((key, policy, [op]))
    return [(policy, seg) for _, policy, seg in out]


def _run_checkpointed(low: Lowered, ops, env, have, policy=None):
    seg = Segment(low, ops, have, _run_op)
    run = jax.checkpoint(lambda *vals: seg(vals), policy=policy)
    outs = run(*[env[t] for t in seg.needed])
    seg.store(outs, env, have)


def _run_op(low: Lowered, op: Op, env, have):
    region = low.regions.get(op.id)
    with source_info_util.extend_name_stack(op.path or "root"):
        if region is None:
            _run_op_named(low, op, env, have)
        elif op.id == region.last:  # its inputs are all computed by now
            region.run(low, env, have)


def _run_op_named(low: Lowered, op: Op, env, have):
    lays = low.ops[op.id]
    ins = []
    for x, lay in zip(op.inputs, lays.inputs):
        if isinstance(x, Literal):
            ins.append(x.value)
            continue
        v = env[x]
        if have.get(x) != lay:
            v = _constrain(low, v, lay)
            if op.loop is not None and _kept_converted(low, op, x):
                v = checkpoint_name(v, CONVERTED)
        ins.append(v)
    partial = any(lay.partial for lay in lays.outputs)
    if op.kind == "identity":
        outs = ins
    elif partial and op.primitive in SHARD_MAP_PARTIAL:
        outs, out_lays = _run_partial(low, op, ins, lays)
        for t, v, lay in zip(op.outputs, outs, out_lays):
            env[t], have[t] = v, lay
        return
    else:
        outs = _bind(op, ins)
    for t, v, lay in zip(op.outputs, outs, lays.outputs):
        lay = output_layout(low, op, t, lay)
        env[t] = _constrain(low, v, lay)
        have[t] = lay
    rule = low.softmax.get(op.id)
    if rule is not None and rule[0] in env:
        # after its layout: the value its readers get is the one the rule keeps
        (t,) = op.outputs
        env[t] = with_softmax_rule(env[rule[0]], env[t], rule[1])


def _run_partial(low: Lowered, op: Op, ins, lays: OpLayouts):
    """A '+' split in a shard_map: local partial result, then the plan's reduction."""
    tensor_ins = [(k, v) for k, (v, lay) in enumerate(zip(ins, lays.inputs)) if lay is not None]
    literals = {k: v for k, (v, lay) in enumerate(zip(ins, lays.inputs)) if lay is None}
    finals = [reduced_layout(lay, low.targets.get(t)) for t, lay in zip(op.outputs, lays.outputs)]
    sizes = low.plan.mesh.shape

    def body(*local):
        # one varying-axes type for all operands: primitives bound directly (not through
        # jnp) do not insert the casts themselves
        vma = set().union(*(varying(x) for x in local))
        local = [vary(x, vma) for x in local]
        args = dict(zip((k for k, _ in tensor_ins), local))
        args.update(literals)
        args = [args[k] for k in range(len(ins))]
        if op.primitive == "ragged_dot_general":  # a piece of its groups knows its first
            outs = ragged_piece(op, args, first_group(op, lays.inputs[1], sizes))
        else:
            outs = _bind(op, args)
        return [
            transition(v, lay, final, sizes, f"output of {op.where}")
            for v, lay, final in zip(outs, lays.outputs, finals)
        ]

    in_specs = tuple(lays.inputs[k].pspec() for k, _ in tensor_ins)
    out_specs = [final.pspec() for final in finals]
    outs = jax.shard_map(body, mesh=low.mesh, in_specs=in_specs, out_specs=out_specs)(
        *[v for _, v in tensor_ins]
    )
    return outs, finals


def output_layout(low: Lowered, op: Op, t: int, produced: Layout) -> Layout:
    """The layout output ``t`` of ``op`` leaves with: as produced, or once its partial sums
    are reduced (in the op's shard_map region as :func:`reduced_layout` says, or by XLA
    towards the layout its consumers agree on)."""
    if not produced.partial:
        return produced
    if op.primitive in SHARD_MAP_PARTIAL:
        return reduced_layout(produced, low.targets.get(t))
    return low.targets.get(t, produced.reduced)
