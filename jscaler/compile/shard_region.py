"""Layout-driven manual regions: ``manual("shard_map")`` and coshard.

The region's ops run in one ``shard_map`` on each device's pieces (:mod:`local`). Its
inputs enter in the layouts they have; every move between a producer's layout and a
consumer's is the collective :func:`local.transition` picks, not XLA's choice; partial
sums leave reduced (``psum``, or ``psum_scatter`` when the consumers want the result
split over the same axes).

Coshard: when each device holds ``colocate`` pieces of every op of the region (split
along one dim and left on the device), the pieces run one after another under
``lax.scan``, each under ``jax.checkpoint``. Inputs carrying the dim are cut into the
pieces' slices (the scan's xs); the others are shared by every piece. Outputs summed over
the dim are added up across pieces on the device and reduced across devices once;
outputs carrying it are stacked back. Only one piece's activations are alive at a time,
in the forward pass and (recomputed) in the backward pass.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import jax
import jax.numpy as jnp

from jscaler.compile.layout import Layout, reduced_layout, replicated
from jscaler.compile.local import (
    bind_local,
    block_index,
    first_group,
    transition,
    vary,
    varying,
)
from jscaler.errors import LayoutError
from jscaler.ir.graph import Literal, Op
from jscaler.plan.pieces import device_pieces, op_pieces
from jscaler.plan.plan import Plan, Region

__all__ = ["LocalRegion", "local_region"]

SUM = "+"  # a piece output that is one piece's share of a sum over the coshard dim


@dataclass(frozen=True, eq=False)
class LocalRegion:
    """A region's ops, the tensors crossing its boundary, and its colocated pieces."""

    region: Region
    ops: tuple[Op, ...]  # graph order
    inputs: tuple[int, ...]  # read inside, produced outside
    outputs: tuple[int, ...]  # produced inside, read outside
    last: int  # the op the region runs at (all its inputs exist by then)
    colocate: int
    piece_axis: dict  # (op id, "in"|"out", k) -> tensor axis of the colocated split, SUM, None
    shapes: dict  # (op id, k) -> the output shape of one piece
    layout_driven: bool = True  # the comm table reads its collectives from the layouts

    def run(self, low, env, have) -> None:
        g = low.plan.pgraph.graph
        sizes = low.plan.mesh.shape
        entry = [have.get(t, replicated(len(g.tensors[t].shape))) for t in self.inputs]
        producer = {t: (op, k) for op in self.ops for k, t in enumerate(op.outputs)}
        made = {}
        for t in self.outputs:
            op, k = producer[t]
            lay = low.ops[op.id].outputs[k]
            made[t] = (lay, reduced_layout(lay, low.targets.get(t)) if lay.partial else lay)

        def body(*xs):
            local = dict(zip(self.inputs, xs))
            ext = self._enter(low, local, dict(zip(self.inputs, entry)), sizes)
            if self.colocate == 1:
                vals = self._piece(low, ext, None, sizes)
            else:
                vals = self._pieces(low, ext, sizes)
            return [
                transition(vals[t], made[t][0], made[t][1], sizes, f"output of {self.where}")
                for t in self.outputs
            ]

        out = jax.shard_map(
            body,
            mesh=low.mesh,
            in_specs=tuple(lay.pspec() for lay in entry),
            out_specs=[made[t][1].pspec() for t in self.outputs],
        )(*[env[t] for t in self.inputs])
        for t, v in zip(self.outputs, out):
            env[t], have[t] = v, made[t][1]

    @property
    def where(self) -> str:
        return f"the {self.region.kind} region at {self.ops[0].where}"

    def _enter(self, low, local, entry, sizes):
        """(tensor, layout) -> each input moved into the layout each consumer reads."""
        ext = {}
        for op in self.ops:
            for x, lay in zip(op.inputs, low.ops[op.id].inputs):
                if isinstance(x, Literal) or x not in local or (x, lay) in ext:
                    continue
                what = f"input of {op.where}"
                ext[(x, lay)] = transition(local[x], entry[x], lay, low.plan.mesh.shape, what)
        return ext

    def _piece(self, low, ext, j, sizes):
        """Runs every op of the region on one piece (piece ``j`` of the colocated ones;
        ``None``: the device's whole piece). Returns the values of the region outputs."""
        env: dict[int, object] = {}
        have: dict[int, Layout] = {}
        varied: dict = {}  # (tensor, layout, axes) -> the value typed varying over axes
        for op in self.ops:
            lays = low.ops[op.id]
            ins, keys = [], []
            for k, (x, lay) in enumerate(zip(op.inputs, lays.inputs)):
                if isinstance(x, Literal):
                    ins.append(x.value)
                    keys.append(None)
                elif (x, lay) in ext:
                    ins.append(ext[(x, lay)])
                    keys.append((x, lay))
                else:
                    v = env[x]
                    if have[x] != lay:
                        v = transition(v, have[x], lay, sizes, f"input {k} of {op.where}")
                    ins.append(v)
                    keys.append((x, lay))
            # one cast per value and axes, shared by its consumers: each cast's transpose
            # is a psum of the cotangent, which then happens once, not once per consumer
            axes = frozenset().union(*(varying(v) for v in ins if isinstance(v, jax.Array)))
            for i, key in enumerate(keys):
                if key is not None and not axes <= varying(ins[i]):
                    ins[i] = varied.setdefault((*key, axes), vary(ins[i], axes))
            shapes = [self.shapes[(op.id, k)] for k in range(len(op.outputs))]
            offsets = self._offsets(op, lays.outputs[0], j, sizes) if op.primitive == "iota" else {}
            group = self._first_group(op, lays.inputs, j, sizes)
            outs = bind_local(op, ins, shapes, offsets, group)
            for t, v, lay in zip(op.outputs, outs, lays.outputs):
                env[t], have[t] = v, lay
        return {t: env[t] for t in self.outputs}

    def _offsets(self, op: Op, lay: Layout, j, sizes) -> dict:
        """Where this device's (and piece's) block of an iota starts along each axis."""
        piece = self.shapes[(op.id, 0)]
        glob = op.eqn.outvars[0].aval.shape
        cut = self.piece_axis.get((op.id, "out", 0)) if j is not None else None
        out = {}
        for a, axes in enumerate(lay.spec):
            if axes:
                n = math.prod(sizes[x] for x in axes)
                out[a] = block_index(axes, sizes) * (glob[a] // n)
            if cut == a:
                out[a] = out.get(a, jnp.int32(0)) + j * piece[a]
        return out

    def _first_group(self, op: Op, lays, j, sizes):
        """A ragged_dot's first group on this device (and piece), if its groups are split."""
        if op.primitive != "ragged_dot_general":
            return None
        first = first_group(op, lays[1], sizes)
        (g,) = op.eqn.params["ragged_dot_dimension_numbers"].rhs_group_dimensions or (None,)
        if j is not None and g is not None and self.piece_axis.get((op.id, "in", 1)) == g:
            local = (
                op.eqn.invars[1].aval.shape[g]
                // math.prod(sizes[a] for a in lays[1].spec[g])
                // self.colocate
            )
            first = (jnp.int32(0) if first is None else first) + j * local
        return first

    def _pieces(self, low, ext, sizes):
        """Coshard: the colocated pieces one after another, each recomputed in backward."""
        k = self.colocate
        axis_of = {}
        for op in self.ops:
            for i, (x, lay) in enumerate(zip(op.inputs, low.ops[op.id].inputs)):
                if (x, lay) in ext:
                    a = self.piece_axis[(op.id, "in", i)]
                    if axis_of.setdefault((x, lay), a) != a:
                        raise LayoutError(
                            f"{self.where}: tensor {x} is read split along different axes by "
                            f"different pieces; coshard along one dim class"
                        )
        keys = list(ext)
        cut = [key for key in keys if axis_of[key] is not None]
        stacked = [_stack(ext[key], axis_of[key], k) for key in cut]
        whole = [key for key in keys if axis_of[key] is None]
        kinds = [self._out_kind(t) for t in self.outputs]

        @jax.checkpoint
        def piece(j, xs, shared):
            vals = self._piece(low, {**dict(zip(whole, shared)), **dict(zip(cut, xs))}, j, sizes)
            sums = [vals[t] for t, kind in zip(self.outputs, kinds) if kind == SUM]
            parts = [vals[t] for t, kind in zip(self.outputs, kinds) if kind != SUM]
            return sums, parts

        # typed varying over every axis any input varies over before the loop, so that
        # the backward pass reduces each shared input's cotangent once, not per piece
        axes = frozenset().union(*(varying(v) for v in ext.values()))
        stacked = [vary(x, axes) for x in stacked]
        shared = [vary(ext[key], axes) for key in whole]
        sums, parts0 = piece(jnp.int32(0), [x[0] for x in stacked], shared)

        def step(acc, inp):
            j, xs = inp
            s, p = piece(j, xs, shared)
            return [a + b for a, b in zip(acc, s)], p

        sums, parts = jax.lax.scan(
            step, sums, (jnp.arange(1, k, dtype=jnp.int32), [x[1:] for x in stacked])
        )
        parts = [jnp.concatenate([p0[None], p]) for p0, p in zip(parts0, parts)]
        out, si, pi = {}, iter(sums), iter(parts)
        for t, kind in zip(self.outputs, kinds):
            out[t] = next(si) if kind == SUM else _unstack(next(pi), kind)
        return out

    def _out_kind(self, t):
        for op in self.ops:
            if t in op.outputs:
                return self.piece_axis[(op.id, "out", op.outputs.index(t))]
        raise KeyError(t)


def _stack(x, axis: int, k: int):
    """[.., L, ..] -> [k, .., L/k, ..]: the colocated pieces' slices, piece-major."""
    shape = list(x.shape)
    shape[axis : axis + 1] = [k, shape[axis] // k]
    return jnp.moveaxis(x.reshape(shape), axis, 0)


def _unstack(x, axis: int):
    """The inverse of :func:`_stack`."""
    x = jnp.moveaxis(x, 0, axis)
    shape = list(x.shape)
    shape[axis : axis + 2] = [shape[axis] * shape[axis + 1]]
    return x.reshape(shape)


def local_region(plan: Plan, region: Region) -> LocalRegion:
    """Checks a shard_map or coshard region and works out its boundary and pieces."""
    g = plan.pgraph.graph
    members = set(region.ops)
    order = {o.id: i for i, o in enumerate(g.ops)}
    missing = [o for o in region.ops if o not in order]
    if missing:
        raise LayoutError(f"the {region.kind} region names op {missing[0]}, not a forward op")
    ops = tuple(sorted((g.op(o) for o in region.ops), key=lambda o: order[o.id]))
    where = f"the {region.kind} region at {ops[0].where}"
    produced = {t for o in ops for t in o.outputs}
    inputs = tuple(dict.fromkeys(x for o in ops for x in o.tensor_inputs if x not in produced))
    last = ops[-1]
    outputs = []
    graph_outputs = {x for x in g.outputs if not isinstance(x, Literal)}
    for o in ops:
        for t in o.outputs:
            users = [u for u in g.consumers(t) if u.id not in members]
            if users or t in graph_outputs:
                outputs.append(t)
            early = [u for u in users if order[u.id] < order[last.id]]
            if early:
                raise LayoutError(
                    f"{where}: {early[0].where} reads a value of the region before the "
                    f"region's last op ({last.where}) runs; a region must be a contiguous "
                    f"step of the program: add {early[0].where} to it or end it earlier"
                )
    if not outputs:
        raise LayoutError(f"{where}: nothing outside the region reads what it computes")
    colocate, piece_axis, shapes = 1, {}, {}
    for o in ops:
        pieces, count = device_pieces(plan, o)
        if o is ops[0]:
            colocate = count
        elif count != colocate:
            raise LayoutError(
                f"{where}: {o.where} has {count} colocated pieces per device where "
                f"{ops[0].where} has {colocate}; coshard every op of the region alike"
            )
        leaf = op_pieces(plan, o)[0]
        for k, m in enumerate(leaf.outputs):
            shapes[(o.id, k)] = m.shape
        if count > 1:
            piece_axis.update(_piece_axes(plan, o))
    if region.kind == "coshard" and colocate == 1:
        raise LayoutError(f"{where}: its ops hold one piece per device; nothing to colocate")
    region_ = LocalRegion(
        region, ops, inputs, tuple(outputs), last.id, colocate, piece_axis, shapes
    )
    for t in region_.outputs if colocate > 1 else ():
        if region_._out_kind(t) is None:
            raise LayoutError(
                f"{where}: its output {g.tensors[t].name or t} neither carries the coshard "
                f"dim nor sums over it, so the pieces cannot produce it; end the region "
                f"before the op that makes it"
            )
    return region_


def _piece_axes(plan: Plan, op: Op) -> dict:
    """For each operand of ``op``: the axis its colocated split cuts (or SUM, or None)."""
    tree = plan.tree(op.id)
    path = next(p for p, _ in tree.leaves())
    dim = tree.at(path[:-1]).dim
    ann = op.annotation
    out = {}
    for k, dims in enumerate(ann.inputs):
        out[(op.id, "in", k)] = next((a for a, ax in enumerate(dims) if ax[0] == dim), None)
    for k, dims in enumerate(ann.outputs):
        a = next((a for a, ax in enumerate(dims) if ax[0] == dim), None)
        if a is None and ann.kinds.get(dim) == "+":
            a = SUM
        out[(op.id, "out", k)] = a
    return out
