"""ZeRO-3's reshard after forward: a layer's gathered weights are not kept for its backward.

A ZeRO-3 plan stores each parameter split over the devices and gathers it (an identity op
whose output layout is the consumers') where a layer uses it. Differentiated as it is, the
gathered copy is a residual of the layer's matmuls: every layer's full weights stay alive
from the forward to the backward, and ZeRO-3 saves little over data parallelism. FSDP's
answer, done here per layer (a *unit*: the ops of one entry of a module list holding
gathers):

* the unit runs under ``jax.checkpoint`` with a policy that saves everything except the
  outputs of sharding constraints and views (:data:`VIEWS`: reshapes, transposes, casts),
  so the stored (split) parameter is the residual and the gather, and whatever view of
  the gathered weight its matmul reads, runs again in the backward (an activation's
  constraint or view, redone from the saved value before it, moves nothing);
* a ``custom_vjp`` around it makes the backward read its residuals through an
  optimization barrier with the incoming cotangent, and the stored weights are constrained
  back to their stored layout after it: without that, sharding propagation carries the
  gathered layout back across the barrier and XLA merges the backward's gather with the
  forward's (the same collective on the same operand) -- which is keeping it. The
  forward reads them through one with the unit's other inputs likewise.
* the unit's outputs are only the values read after it (a custom_vjp's every output gets a
  cotangent, zeros included).

Measured (8 devices, adamw, per device; plain ``jax.jit`` FSDP in brackets):
``zero(stage=3)`` on gpt-small 320 -> 264 MB (307), Hugging Face Flax GPT-2 97 -> 93 MB
(88), Llama 99 -> 91 MB (96), at 1.4-1.7x FSDP's collective bytes (the second gather).
A function of a params pytree has its layers from the parameters' names
(``Graph.layers``). A layer is resharded only where that saves memory (:func:`worth_it`):
under ``megatron(tp=4, dp=2, zero=3)`` the weights gathered per layer are smaller than the
activation the checkpointed layer keeps (measured there). The forward's
one-layer-ahead prefetch is off inside units (the next layer's gathered weights would be
a unit's output, kept): each layer gathers when it starts.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp

from jscaler.compile.segment import Segment
from jscaler.ir.graph import LOOP_PRIMITIVES, Literal, Op

__all__ = ["loop_regathers", "reshard_units", "run_resharded", "worth_it"]


def reshard_units(low, ops: list[Op]) -> dict[int, list[Op]]:
    """First op id -> the ops of a layer (``graph.layers()``) among ``ops`` that holds ZeRO-3
    gathers and runs as a resharded unit: contiguous in ``ops``, not recomputed (a
    recompute group is already rematerialised), every manual region it touches inside it."""
    plan = low.plan
    g = plan.pgraph.graph
    if not any(o.kind == "identity" for o in ops):
        return {}
    position = {o.id: k for k, o in enumerate(ops)}
    region_ops: dict[int, set[int]] = {}
    for op_id, region in low.regions.items():
        region_ops.setdefault(id(region), set()).add(op_id)
    units = {}
    for layer in g.layers():
        mine = [o for o in layer.graph.ops if o.id in position]
        if not any(o.kind == "identity" for o in mine):
            continue
        at = sorted(position[o.id] for o in mine)
        if at != list(range(at[0], at[0] + len(at))):
            continue
        ids = {o.id for o in mine}
        if any(plan.is_recomputed(i) for i in ids):
            continue
        if any(region_ops[id(low.regions[i])] - ids for i in ids if i in low.regions):
            continue
        unit = [ops[k] for k in at]
        if worth_it(low, unit):
            units[unit[0].id] = unit
    return units


def loop_regathers(low, loop) -> bool:
    """Whether an exposed scan's backward gathers its ZeRO-3 weights again (one layer at a
    time, as FSDP does) rather than keeping every iteration's: by :func:`worth_it` on one
    iteration's ops (the loop's body is rerun from its inputs in the backward anyway, see
    ``jscaler.compile.lower.loop_saves``)."""

    def decide():
        g = low.plan.pgraph.graph
        body = [o for o in g.ops if o.loop is loop and o.primitive not in LOOP_PRIMITIVES]
        return any(o.kind == "identity" for o in body) and worth_it(low, body)

    return low.memo((loop_regathers, loop), decide)


def worth_it(low, unit: list[Op]) -> bool:
    """Whether resharding ``unit`` saves memory: its gathered weights (what it stops
    keeping) outweigh its largest activation read from outside (what the checkpointed
    unit costs: XLA keeps a copy of it at the boundary). Measured: ZeRO-3 over 8 devices
    frees 5-12x that; megatron(tp=4, dp=2, zero=3), gathering a quarter of each weight
    over 2 devices, lost 7-26 MB on three GPTs while its row-parallel weights were kept
    to the backward regardless; since they are gathered again it is within 0.5% either
    way (gpt-small +1.1 MB kept), which this rule does not resolve."""
    g = low.plan.pgraph.graph
    sizes = low.plan.mesh.shape

    def local(t, layout):
        tensor = g.tensors[t]
        return layout.local_bytes(tensor.shape, jnp.dtype(tensor.dtype).itemsize, sizes)

    made = {t for o in unit for t in o.outputs}
    gathered = activation = 0
    for o in unit:
        lays = low.ops[o.id]
        if o.kind == "identity":
            gathered += local(o.outputs[0], lays.outputs[0])
            continue
        for t, lay in zip(o.inputs, lays.inputs):
            if isinstance(t, Literal) or t in made or g.tensors[t].role in ("param", "const"):
                continue
            activation = max(activation, local(t, lay))
    return gathered > activation


# not saved, redone in the backward: layout changes and views, which is what lies between
# a stored weight and its matmul (the gather, a cast, a transpose, a fused kernel's
# (d, parts, d) view); an activation's are redone from the value before them, as large
VIEWS = frozenset({
    "sharding_constraint", "reshape", "transpose", "squeeze", "expand_dims",
    "broadcast_in_dim", "convert_element_type", "copy",
    # inside a shard_map (a row-parallel matmul's region): the cast of the weight piece to
    # the activation's varying axes; saved, it is a residual output of the region and the
    # gathered weight is kept to the backward (the region's partial evaluation returns
    # what its backward reads)
    "pvary",
})  # fmt: skip


def _saveable(prim, *_, **__) -> bool:
    return prim.name not in VIEWS


def run_resharded(low, ops: list[Op], env: dict, have: dict, run_op: Callable) -> None:
    """Runs one unit (:func:`reshard_units`) on ``env``/``have`` as :func:`run_ops` would,
    with its gathered weights dropped after the forward and gathered again in the backward.
    ``run_op(low, op, env, have)`` runs one op."""
    g = low.plan.pgraph.graph
    # only what is read after the unit: a custom_vjp's every output gets a cotangent
    inside = {o.id for o in ops}
    read = {t for o in g.ops if o.id not in inside for t in o.tensor_inputs}
    read |= {t for t in g.outputs if not isinstance(t, Literal)}
    seg = Segment(low, ops, have, run_op, [t for o in ops for t in o.outputs if t in read])
    needed = seg.needed
    graph_inputs = set(g.inputs)
    stored = [k for k, t in enumerate(needed) if t in graph_inputs]
    checkpointed = jax.checkpoint(seg, policy=_saveable)

    def on_storage(v, t):
        # after a barrier: a stored weight back on its stored layout, so that its gather
        # stays on this side of the barrier
        return jax.lax.with_sharding_constraint(v, low.sharding(low.storage[t]))

    def held(vals):
        vals = jax.lax.optimization_barrier(list(vals))
        return [on_storage(v, needed[k]) if k in stored else v for k, v in enumerate(vals)]

    @jax.custom_vjp
    def unit(vals):
        return checkpointed(held(vals))

    residual_at: dict = {}

    def fwd(vals):
        vals = held(vals)
        out, vjp = jax.vjp(checkpointed, vals)
        leaves, _ = jax.tree_util.tree_flatten(vjp)
        # which residuals are the stored weights (by identity: jax.vjp keeps its inputs)
        residual_at["stored"] = [
            (j, needed[k]) for j, leaf in enumerate(leaves) for k in stored if leaf is vals[k]
        ]
        return out, vjp

    def bwd(vjp, ct):
        leaves, tdef = jax.tree_util.tree_flatten(vjp)
        real = [c for c in ct if c.dtype != jax.dtypes.float0]
        leaves, real = jax.lax.optimization_barrier((leaves, real))
        it = iter(real)
        ct = [c if c.dtype == jax.dtypes.float0 else next(it) for c in ct]
        for j, t in residual_at["stored"]:
            leaves[j] = on_storage(leaves[j], t)
        return jax.tree_util.tree_unflatten(tdef, leaves)(ct)

    unit.defvjp(fwd, bwd)
    seg.store(unit([env[t] for t in needed]), env, have)
