"""Materialisation: the collectives a lowered plan implies, derived from its layouts.

Every tensor moves between the layout its producer writes and the layouts its consumers
read. Comparing the two layouts mesh axis by mesh axis names the data movement:

* an axis that splits the source but not the destination: ``all-gather`` over it;
* an axis that splits the destination only: a local slice (no communication);
* an axis that splits a different tensor axis on each side: ``all-to-all``;
* partial sums over some axes: ``all-reduce``, or ``reduce-scatter`` when the destination
  is split along those very axes.

The backward pass is the transpose: a consumer that runs split over a mesh axis its input
is not split over (a column-parallel matmul reading a replicated activation, a
data-parallel op reading a replicated weight) gets that input's gradient as partial sums
over the axis, reduced on the way back to the producer's layout (the weight's gradient
layout for parameters). Recomputed ops repeat their forward movements in the backward pass.
Optimizer-side movements (gradient -> update layout, parameter -> update layout, new
parameter -> storage) happen once per step; forward and backward once per micro-batch.

Bytes are per device and follow :mod:`jscaler.compile.hlo`: the gathered result of an
all-gather, the input of a reduce-scatter, the buffer of an all-reduce or all-to-all.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

import jax.numpy as jnp

from jscaler.compile.layout import Layout, replicated
from jscaler.compile.reshard import loop_regathers, reshard_units
from jscaler.ir.graph import Literal

__all__ = ["CommTable", "Transfer", "comm_table", "convert"]

NON_DIFFERENTIABLE = {"stop_gradient", "iota", "random_bits", "random_seed", "random_wrap"}


@dataclass(frozen=True)
class Transfer:
    """One collective: what moves, where in the model, over which mesh axes, how much."""

    phase: str  # forward | backward | recompute | update
    collective: str  # all-reduce | all-gather | reduce-scatter | all-to-all | collective-permute
    tensor: int
    path: str  # module path of the op where it happens
    axes: tuple[str, ...]
    bytes: int  # per device, per occurrence
    times: int = 1  # occurrences per step (micro-batches)
    op: int | None = None  # the op where it happens (None: the update's)


@dataclass(frozen=True)
class CommTable:
    """The predicted collectives of one training step."""

    rows: tuple[Transfer, ...]

    def summary(self) -> dict[str, tuple[int, int]]:
        """collective -> (count, bytes) per device per step."""
        out: dict[str, tuple[int, int]] = {}
        for r in self.rows:
            n, b = out.get(r.collective, (0, 0))
            out[r.collective] = (n + r.times, b + r.bytes * r.times)
        return out

    @property
    def total_bytes(self) -> int:
        return sum(r.bytes * r.times for r in self.rows)

    def by_path(self) -> dict[tuple[str, str], int]:
        """(module path, collective) -> bytes per step."""
        out: dict[tuple[str, str], int] = defaultdict(int)
        for r in self.rows:
            out[(r.path, r.collective)] += r.bytes * r.times
        return dict(out)

    def format(self, graph=None) -> str:
        """A readable table, one row per collective."""
        head = ("phase", "module path", "tensor", "collective", "axes", "KB", "x")
        data = []
        for r in self.rows:
            name = graph.tensors[r.tensor].name if graph is not None else ""
            data.append(
                (
                    r.phase,
                    r.path or "(root)",
                    name or str(r.tensor),
                    r.collective,
                    ",".join(r.axes),
                    f"{r.bytes / 1e3:.1f}",
                    str(r.times),
                )
            )
        widths = [max(len(x) for x in col) for col in zip(head, *data)]
        lines = ["  ".join(c.ljust(w) for c, w in zip(row, widths)) for row in (head, *data)]
        lines.insert(1, "-" * len(lines[0]))
        total = self.total_bytes / 1e6
        lines.append(f"{len(self.rows)} collectives, {total:.2f} MB per device per step")
        return "\n".join(lines)


def _dim_of(layout: Layout, axis: str) -> int | None:
    for d, axes in enumerate(layout.spec):
        if axis in axes:
            return d
    return None


def convert(shape, itemsize: int, src: Layout, dst: Layout, sizes: dict[str, int]):
    """The collectives taking a reduced tensor from layout ``src`` to ``dst``:
    ``[(collective, axes, bytes)]`` (slices are free and not listed)."""
    moved, gathered = [], []
    for axis in sorted(src.axes_used() | dst.axes_used()):
        if sizes.get(axis, 1) == 1 or axis in src.partial:
            continue
        a, b = _dim_of(src, axis), _dim_of(dst, axis)
        if a == b or a is None:
            continue
        (gathered if b is None else moved).append(axis)
    out = []
    local = src.local_bytes(shape, itemsize, sizes)
    if moved:
        out.append(("all-to-all", tuple(moved), local))
    if gathered:
        kept = Layout(tuple(tuple(x for x in axes if x not in gathered) for axes in src.spec))
        out.append(("all-gather", tuple(gathered), kept.local_bytes(shape, itemsize, sizes)))
    return out


def _reduce(shape, itemsize, layout: Layout, partial, target: Layout, sizes):
    """The reduction of partial sums over ``partial`` held in ``layout`` towards
    ``target``: a reduce-scatter when the target splits a tensor axis over exactly those
    mesh axes (beyond what the layout splits), else an all-reduce."""
    partial = tuple(a for a in partial if sizes.get(a, 1) > 1)
    if not partial:
        return []
    local = layout.local_bytes(shape, itemsize, sizes)
    for d, axes in enumerate(target.spec):
        extra = tuple(a for a in axes if a not in layout.spec[d])
        if extra and set(extra) <= set(partial):
            return [("reduce-scatter", extra, local)] + (
                [("all-reduce", tuple(a for a in partial if a not in extra), local)]
                if set(partial) - set(extra)
                else []
            )
    return [("all-reduce", partial, local)]


def _total(moves) -> int:
    return sum(nbytes for _, _, nbytes in moves)


def table_rows(op, x) -> frozenset[int]:
    """The dims of ``x`` an embedding lookup ``op`` indexes when ``x`` is its table (a
    gather's operand), else none; shared with the ILP's pricing of the same rule."""
    if op.primitive != "gather" or op.eqn is None or x != op.inputs[0]:
        return frozenset()
    return frozenset(op.eqn.params["dimension_numbers"].start_index_map)


def _lookup_gather(op, x, lay, target, partial, lays, info, made, sizes):
    """An embedding lookup's table gradient made where it is stored, or None.

    When the table is stored whole (no forward gather, whose transpose is the
    reduce-scatter) but its gradient is kept split by rows (ZeRO-2) and the
    lookup runs split over ``partial`` (the batch), XLA can gather the lookup's output
    cotangent and its indices over those axes and scatter into each device's own rows,
    instead of scattering the whole table and reduce-scattering it; it does whichever
    moves fewer bytes (a GPT-2 token table: the micro-batch's cotangent; its short position
    table: the table). ``[(collective, axes, bytes)]`` for the first way."""
    indexed = table_rows(op, x)
    split = {d for d, axes in enumerate(target.spec) if any(a not in lay.spec[d] for a in axes)}
    if not split or not split <= indexed:
        return None
    out = []
    for t, have in ((op.outputs[0], lays.outputs[0]), (op.inputs[1], lays.inputs[1])):
        if isinstance(t, Literal) or t in made or have is None:
            continue
        whole = Layout(tuple(tuple(a for a in axes if a not in partial) for axes in have.spec))
        shape, isz = info(t)
        out += convert(shape, isz, have.reduced, whole, sizes)
    return out


def comm_table(lowered, microbatches: int = 1, accumulate: bool = False) -> CommTable:
    """The collectives one training step under ``lowered`` implies (see module doc);
    computed once per lowering, micro-batch count and ``accumulate`` (a pipeline stage's:
    gradients reduced into :meth:`Lowered.accumulator`, not the plan's gradient layout)."""
    return lowered.memo(
        (comm_table, microbatches, accumulate),
        lambda: _comm_table(lowered, microbatches, accumulate),
    )


def _comm_table(lowered, microbatches: int, accumulate: bool = False) -> CommTable:
    from jscaler.compile.lower import output_layout

    plan = lowered.plan
    g = plan.pgraph.graph
    sizes = plan.mesh.shape
    m = microbatches
    rows: list[Transfer] = []
    producer_layout: dict[int, Layout] = {}
    for t in g.inputs:
        producer_layout[t] = lowered.storage[t]
    for t in g.consts:  # closed-over constants (a mask, an index table): on every device
        producer_layout[t] = replicated(len(g.tensors[t].shape))
    recomputed = {op_id for grp in plan.recompute for op_id in grp}
    # ZeRO-3 gathers done again for the backward (reshard after forward)
    units = reshard_units(lowered, list(g.ops)).values()
    regathered = {t for unit in units for o in unit if o.kind == "identity" for t in o.outputs}

    def info(t):
        tensor = g.tensors[t]
        return tensor.shape, jnp.dtype(tensor.dtype).itemsize

    # an op in an exposed scan runs once per iteration, and so do the collectives at its
    # inputs and outputs; a scan's stacked inputs and initial carries are re-laid once,
    # before the loop, its results once after it
    repeats = {o.id: o.repeats for o in g.ops if o.loop is not None}
    once = {o.id for o in g.ops if o.primitive in ("scan_carry", "scan_slice")}

    def add(phase, kind, t, path, axes, nbytes, times, op=None, at_input=False):
        if nbytes:
            if op in repeats and not (at_input and op in once):
                times *= repeats[op]
            rows.append(Transfer(phase, kind, t, path, tuple(axes), int(nbytes), times, op))

    # ---- forward: reductions at producers, conversions at consumers ------------------
    # a weight (a tied embedding read by the lookup and the LM head) converted to the same
    # layout by several ops is converted once in the forward: XLA merges the identical
    # collectives on one parameter (the recomputed forward converts it again); so it does
    # an activation's identical all-to-alls (AlphaFold2's DAP: two readers of one value in
    # the triangle attention), while an activation's all-gathers stay one per consumer
    # (sequence parallelism's before q, k and v), as XLA leaves them
    weights = from_params_only(g)
    made = remade(g)
    converted = set()
    for op in g.ops:
        region = lowered.regions.get(op.id)
        if region is not None and not region.layout_driven:
            if op.id == region.last:
                out = region.attention.out
                producer_layout[out] = _region_rows(region, lowered, producer_layout, add, info, m)
            continue
        lays = lowered.ops[op.id]
        phases = [("forward", m)] + ([("recompute", m)] if op.id in recomputed else [])
        seen = set()
        for x, lay in zip(op.inputs, lays.inputs):
            if isinstance(x, Literal) or (x, lay) in seen or x in made:
                continue
            seen.add((x, lay))
            shape, isz = info(x)
            again = [("recompute", m)] if x in regathered and op.id not in recomputed else []
            made_by = g.producer(x)
            if op.loop is not None and made_by is not None and made_by.kind == "identity":
                again = [("recompute", m)] if loop_regathers(lowered, op.loop) else []
            todo = phases + again
            twice = (x, lay) in converted  # another reader converted it so in the forward
            converted.add((x, lay))
            for kind, axes, nbytes in convert(shape, isz, producer_layout[x], lay, sizes):
                for phase, times in todo:
                    merged = x in weights or kind == "all-to-all"
                    if not (twice and merged and phase == "forward"):
                        add(phase, kind, x, op.path, axes, nbytes, times, op.id, True)
        for t, lay in zip(op.outputs, lays.outputs):
            final = output_layout(lowered, op, t, lay)
            producer_layout[t] = final
            if not lay.partial:
                continue
            shape, isz = info(t)
            for kind, ax, nbytes in _reduce(shape, isz, lay.reduced, lay.partial, final, sizes):
                for phase, times in phases:
                    add(phase, kind, t, op.path, ax, nbytes, times, op.id)

    # ---- backward: partial cotangents reduced towards the producer's layout ----------
    # a cotangent is reduced only where a gradient flows: not through a recycling pass
    # under stop_gradient, nor into integer values
    needs = {t for t in needs_grad(g) if jnp.issubdtype(jnp.dtype(g.tensors[t].dtype), jnp.inexact)}
    grad_target = {
        t: lowered.accumulator(t) if accumulate else lowered.grad[t] for t in lowered.grad
    }
    region_seen: dict[int, set] = {}
    for op in g.ops:
        if op.primitive in NON_DIFFERENTIABLE or not any(t in needs for t in op.outputs):
            continue
        if op.id in lowered.regions and not lowered.regions[op.id].layout_driven:
            continue  # counted with the region
        lays = lowered.ops[op.id]
        op_axes = set()
        for lay in (*lays.inputs, *lays.outputs):
            if lay is not None:
                op_axes |= lay.axes_used()
        region = lowered.regions.get(op.id)
        # a manual region reduces a cotangent once for all its consumers of one value
        seen = region_seen.setdefault(id(region), set()) if region is not None else set()
        for x, lay in zip(op.inputs, lays.inputs):
            partial = tuple(sorted(op_axes - lay.axes_used())) if lay is not None else ()
            if isinstance(x, Literal) or x not in needs or (x, lay, partial) in seen:
                continue
            seen.add((x, lay, partial))
            shape, isz = info(x)
            target = grad_target.get(x, producer_layout[x])
            red = _reduce(shape, isz, lay, partial, target, sizes)
            scattered = red and red[0][0] == "reduce-scatter"
            if scattered and not convert(shape, isz, producer_layout[x], lay, sizes):
                # read as stored: no forward gather whose transpose is the reduce-scatter
                gathered = _lookup_gather(op, x, lay, target, partial, lays, info, made, sizes)
                if gathered is not None and _total(gathered) < _total(red):
                    red = gathered
            for kind, axes, nbytes in red:
                add("backward", kind, x, op.path, axes, nbytes, m, op.id, True)
            after = lay
            if red and red[0][0] == "reduce-scatter":
                after = target
            for kind, axes, nbytes in convert(shape, isz, after, target, sizes):
                add("backward", kind, x, op.path, axes, nbytes, m, op.id, True)

    # ---- optimizer: gradient and parameter to the update layout, back to storage ----
    for t in lowered.update:
        shape, isz = info(t)
        upd, stored, grad = lowered.update[t], lowered.storage[t], lowered.grad[t]
        name = g.tensors[t].name
        for src, dst in ((grad, upd), (stored, upd), (upd, stored)):
            for kind, axes, nbytes in convert(shape, isz, src, dst, sizes):
                add("update", kind, t, name, axes, nbytes, 1)
    return CommTable(tuple(rows))


def _region_rows(region, lowered, producer_layout, add, info, m) -> Layout:
    """Ring attention: q, k, v converted into the region's layout (and their gradients
    back), then n-1 hops of the key and value blocks around the ring each way. Returns
    the layout the region's output leaves with."""
    att, axis = region.attention, region.region.axis
    sizes = lowered.plan.mesh.shape
    lays = region.layouts(lowered, producer_layout[att.q])
    path = region.attention.path
    for t in (att.q, att.k, att.v):
        shape, isz = info(t)
        src = producer_layout[t]
        for kind, axes, nbytes in convert(shape, isz, src, lays[t], sizes):
            add("forward", kind, t, path, axes, nbytes, m)
        for kind, axes, nbytes in convert(shape, isz, lays[t], src, sizes):
            add("backward", kind, t, path, axes, nbytes, m)
    hops = sizes[axis] - 1
    for t in (att.k, att.v):
        shape, isz = info(t)
        nbytes = lays[t].local_bytes(shape, isz, sizes)
        add("forward", "collective-permute", t, path, (axis,), nbytes, m * hops)
        add("backward", "collective-permute", t, path, (axis,), nbytes, m * hops)
    return lays[att.out]


def needs_grad(g) -> frozenset[int]:
    """Tensors a gradient flows through: computed from a parameter and reaching the loss
    along differentiable ops (a recycling pass under ``stop_gradient`` has no backward).
    Once per graph: every estimate and search problem asks."""
    return g.memo((needs_grad,), lambda: _needs_grad(g))


def _needs_grad(g) -> frozenset[int]:
    params = {p.id for p in g.params()}
    down = set(params)
    for op in g.ops:
        if op.primitive not in NON_DIFFERENTIABLE and any(t in down for t in op.tensor_inputs):
            down.update(op.outputs)
    up = {t for t in g.outputs if not isinstance(t, Literal)}
    for op in reversed(g.ops):
        if op.primitive not in NON_DIFFERENTIABLE and any(t in up for t in op.outputs):
            up.update(op.tensor_inputs)
    return frozenset(down & up)


REMADE = ("broadcast_in_dim", "iota")


def remade(g) -> dict[int, object]:
    """Tensors made from scalars alone (a broadcast of a literal, an iota) -> the op
    making them. A consumer that wants one in another layout than it was made in moves
    nothing: XLA makes it again in that layout (the zeros a scatter writes into, made
    split by the batch and read whole, are not gathered)."""
    out = {}
    for op in g.ops:
        if op.primitive in REMADE and all(not g.tensors[t].shape for t in op.tensor_inputs):
            out.update((t, op) for t in op.outputs)
    return out


def from_params_only(g) -> frozenset[int]:
    """The parameters and the tensors computed from parameters alone (a norm's scale
    broadcast, a cast weight): a reduction of their gradient is a parameter-gradient
    reduction, independent of the rest of the backward pass."""
    return g.memo((from_params_only,), lambda: _from_params_only(g))  # shared: don't change it


def _from_params_only(g) -> frozenset[int]:
    out = {p.id for p in g.params()}
    for op in g.ops:
        ins = [t for t in op.tensor_inputs]
        if ins and all(t in out for t in ins):
            out.update(op.outputs)
    return frozenset(out)
