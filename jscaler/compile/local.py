"""Running graph ops on local pieces inside ``shard_map``, with explicit collectives.

Outside manual regions an op runs on the whole (global) array and XLA's partitioner turns
layouts into collectives. Inside a ``shard_map`` region each device holds only its piece,
so an op is bound again at its piece's shapes (:func:`bind_local`: a reshape's new sizes,
a broadcast's shape, an iota's values are those of the piece), and data moves between
the layout a producer writes and the layout a consumer reads by the collectives
:func:`transition` picks from the two layouts, axis by axis: ``psum`` or ``psum_scatter``
for partial sums, ``all_to_all`` for an axis that moves between tensor dims,
``all_gather`` for an axis that leaves, a local slice for an axis that arrives.

Values carry JAX's varying-axes type; every collective and every op sees operands that
agree on it, so autodiff transposes each collective correctly.
"""

from __future__ import annotations

import math
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

from jscaler.compile.layout import Layout
from jscaler.errors import LayoutError
from jscaler.ir.graph import Op

__all__ = ["bind_local", "block_index", "first_group", "ragged_piece", "transition", "vary"]

# Ops whose bits depend on the global shape: a piece would draw different numbers.
RANDOM = {"random_bits", "random_seed", "random_wrap", "random_unwrap", "threefry2x32"}


def varying(x) -> frozenset:
    """The mesh axes a value inside shard_map varies over (its varying-axes type)."""
    aval = jax.typeof(x)
    mat = getattr(aval, "mat", None)
    return frozenset(mat.varying if mat is not None else getattr(aval, "vma", ()))


def vary(x, axes):
    """``x`` typed as varying over ``axes`` too (no data moves)."""
    missing = tuple(sorted(set(axes) - varying(x)))
    return jax.lax.pcast(x, missing, to="varying") if missing else x


def block_index(axes: tuple[str, ...], sizes: dict[str, int]):
    """This device's block number along a tensor dim split over ``axes`` (major first)."""
    i = jnp.int32(0)
    for a in axes:
        i = i * sizes[a] + jax.lax.axis_index(a)
    return i


def transition(x, src: Layout, dst: Layout, sizes: dict[str, int], what: str):
    """Moves a local piece from layout ``src`` to layout ``dst`` (not partial)."""
    if dst.partial:
        raise LayoutError(f"{what}: a consumer cannot read partial sums ({dst})")
    spec = [list(a) for a in src.spec]
    if src.partial:
        x, spec = _reduce(x, src.partial, spec, dst)
    # an axis leaving one dim (its minor end) for another dim's minor end: all-to-all
    moved = True
    while moved:
        moved = False
        for a in range(len(spec)):
            if not spec[a] or _keeps(spec[a], dst.spec[a]):
                continue
            ax = spec[a][-1]
            for b in range(len(spec)):
                want = dst.spec[b]
                if b != a and len(want) > len(spec[b]) and _keeps(spec[b], want):
                    if want[len(spec[b])] == ax:
                        x = vary(x, (ax,))
                        x = jax.lax.all_to_all(x, ax, split_axis=b, concat_axis=a, tiled=True)
                        spec[a].pop()
                        spec[b].append(ax)
                        moved = True
                        break
    for a in range(len(spec)):
        keep = _common(spec[a], dst.spec[a])
        gone = tuple(spec[a][keep:])
        if gone:
            x = jax.lax.all_gather(vary(x, gone), gone, axis=a, tiled=True, to="invarying")
            spec[a] = spec[a][:keep]
        new = tuple(dst.spec[a][keep:])
        if new:
            n = math.prod(sizes[ax] for ax in new)
            size = x.shape[a] // n
            start = block_index(new, sizes) * size
            x = jax.lax.dynamic_slice_in_dim(x, start, size, axis=a)
            spec[a] = spec[a] + list(new)
    return x


def _common(have, want) -> int:
    k = 0
    while k < len(have) and k < len(want) and have[k] == want[k]:
        k += 1
    return k


def _keeps(have, want) -> bool:
    """True when ``have`` is a prefix of ``want`` (nothing to gather on this dim)."""
    return _common(have, want) == len(have)


def _reduce(x, partial, spec, dst: Layout):
    """Adds up partial sums: a reduce-scatter when dst splits one more dim over exactly
    the partial axes (as :func:`layout.reduced_layout` chooses), else an all-reduce."""
    partial = tuple(partial)
    for a in range(len(spec)):
        want = tuple(dst.spec[a])
        if want == tuple(spec[a]) + partial and all(
            tuple(dst.spec[b]) == tuple(spec[b]) for b in range(len(spec)) if b != a
        ):
            x = jax.lax.psum_scatter(vary(x, partial), partial, scatter_dimension=a, tiled=True)
            spec[a] = list(want)
            return x, spec
    return jax.lax.psum(vary(x, partial), partial), spec


def _agree(args, dtypes):
    """Operands typed as varying over the same mesh axes (literals made arrays to match):
    primitives bound directly, not through jnp, do not insert these casts themselves."""
    axes = set().union(*(varying(x) for x in args if isinstance(x, jax.Array)))
    if not axes:
        return list(args)
    return [
        vary(x if isinstance(x, jax.Array) else jnp.asarray(x, d), axes)
        for x, d in zip(args, dtypes)
    ]


def _piece_params(op: Op, ins, out_shapes):
    """The op's params at piece shapes, or a LayoutError naming what does not fit."""
    eqn = op.eqn
    params = dict(eqn.params)
    name = op.primitive
    if "sharding" in params:
        params["sharding"] = None
    if name == "reshape":
        params["new_sizes"] = tuple(out_shapes[0])
        params["dimensions"] = None
    elif name in ("broadcast_in_dim", "iota"):
        params["shape"] = tuple(out_shapes[0])
    elif name == "slice":
        glob = op.eqn.invars[0].aval.shape
        for a, (g, loc) in enumerate(zip(glob, ins[0].shape)):
            if g != loc and params["start_indices"][a]:
                raise LayoutError(
                    f"{op.where}: the slice starts at {params['start_indices'][a]} along an "
                    f"axis that is split here; keep that axis whole in this region"
                )
        params["limit_indices"] = _fit_sizes(op, ins[0], params["limit_indices"], "slice")
    elif name in ("dynamic_slice", "gather"):
        params["slice_sizes"] = _fit_sizes(op, ins[0], params["slice_sizes"], name)
    return params


def _fit_sizes(op: Op, x, sizes, what):
    """Sizes that took a whole global axis take the whole local axis."""
    glob = op.eqn.invars[0].aval.shape
    out = []
    for s, g, loc in zip(sizes, glob, x.shape):
        if g != loc and s == g:
            out.append(loc)
        elif g != loc:
            raise LayoutError(
                f"{op.where}: the {what} takes {s} of an axis of size {g} that is split "
                f"here ({loc} per piece); keep that axis whole in this region"
            )
        else:
            out.append(s)
    return tuple(out)


def bind_local(op: Op, ins, out_shapes, offsets: dict[int, object] | None = None, group=None):
    """Binds ``op`` on local pieces ``ins``; ``out_shapes`` are its pieces' output shapes.

    ``offsets`` maps an output axis to where this piece starts along it (an iota along a
    split axis counts from there). ``group``: a ``ragged_dot``'s first group on this piece
    when its rhs groups are split (:func:`first_group`).
    """
    if op.primitive in RANDOM:
        raise LayoutError(
            f"{op.where}: random numbers ({op.primitive}) drawn on a piece differ from "
            f"those drawn whole; keep random ops (dropout) outside manual regions"
        )
    if op.kind == "call":
        return _bind_call(op, ins, out_shapes)
    if op.kind != "op":
        raise LayoutError(
            f"{op.where}: a {op.kind} op ({op.primitive}) cannot run on pieces in a manual "
            f"region; leave it outside the region"
        )
    ins = _agree(ins, [v.aval.dtype for v in op.eqn.invars])
    if group is not None:
        outs = ragged_piece(op, ins, group)
        _check_shapes(op, outs, out_shapes)
        return outs
    if op.primitive == "erfc":  # see _erfc
        outs = [_erfc(ins[0])]
        _check_shapes(op, outs, out_shapes)
        return outs
    params = _piece_params(op, ins, out_shapes)
    prim = op.eqn.primitive
    # not under the equation's own context: it would restore the (non-manual) abstract
    # mesh the loss was traced under
    out = prim.bind(*ins, **prim.get_bind_params(params))
    outs = list(out) if prim.multiple_results else [out]
    if op.primitive == "iota" and offsets:
        dim = params["dimension"]
        if dim in offsets:
            outs[0] = outs[0] + offsets[dim].astype(outs[0].dtype)
    _check_shapes(op, outs, out_shapes)
    return outs


def _ragged_axes(op: Op) -> tuple[int, int, int]:
    """(lhs ragged axis, rhs group axis, output row axis) of a ``ragged_dot_general``
    whose ragged dim is a row dim of the output (a MoE's forward), or a LayoutError."""
    rdn = op.eqn.params["ragged_dot_dimension_numbers"]
    (lc, _), (lb, _) = rdn.dot_dimension_numbers
    ragged, groups = rdn.lhs_ragged_dimensions, rdn.rhs_group_dimensions
    sizes = op.eqn.invars[2].aval.shape
    if len(ragged) != 1 or len(groups) != 1 or len(sizes) != 1 or ragged[0] in (*lc, *lb):
        raise LayoutError(
            f"{op.where}: this ragged_dot_general (ragged dims {ragged}, group dims {groups}, "
            f"group_sizes {sizes}) cannot run split along its groups; only one ragged row "
            f"dim of the lhs and one group dim of the rhs can; keep its groups whole"
        )
    rank = len(op.eqn.invars[0].aval.shape)
    free = [i for i in range(rank) if i not in (*lc, *lb)]
    return ragged[0], groups[0], len(lb) + free.index(ragged[0])


def first_group(op: Op, rhs: Layout, sizes: dict[str, int]):
    """The first group this device's piece of a ``ragged_dot``'s rhs holds; ``None`` when
    ``op`` is no ragged_dot or its groups are whole here."""
    if op.primitive != "ragged_dot_general":
        return None
    groups = op.eqn.params["ragged_dot_dimension_numbers"].rhs_group_dimensions
    axes = rhs.spec[groups[0]] if groups else ()
    if not axes:
        return None
    _, g, _ = _ragged_axes(op)
    local = op.eqn.invars[1].aval.shape[g] // math.prod(sizes[a] for a in axes)
    return block_index(axes, sizes) * local


def ragged_piece(op: Op, ins, first):
    """A ``ragged_dot`` on a piece of its groups: rhs holds groups ``[first, first + n)``,
    ``group_sizes`` is whole. Rows of other groups come out zero, so the pieces add up to
    the whole (the '+' of the group dim, :func:`jscaler.ir.rules_nn.ragged_dot_general`).
    ``first=None``: the groups are whole, the op runs as it is.

    The rows are rotated so that the piece's first row comes first, multiplied with the
    piece's group sizes (ragged_dot leaves the rows past their sum zero), and rotated
    back: every row gets the value the whole op computes for it (on CPU, bit for bit).
    """
    params = dict(op.eqn.params)
    params["out_sharding"] = None
    prim = op.eqn.primitive
    # not under the equation's own context: see bind_local
    if first is None:  # whole groups
        return [prim.bind(*ins, **prim.get_bind_params(params))]
    r, g, o = _ragged_axes(op)
    lhs, rhs, sizes = ins
    n = rhs.shape[g]
    first = jnp.asarray(first, sizes.dtype)
    start = jnp.sum(jnp.where(jnp.arange(sizes.shape[0]) < first, sizes, 0))
    mine = jax.lax.dynamic_slice_in_dim(sizes, first, n)
    out = prim.bind(_rotate(lhs, start, r), rhs, mine, **prim.get_bind_params(params))
    return [_rotate(out, -start, o)]


def _rotate(x, shift, axis: int):
    """``x`` with row ``(i + shift) % n`` at row ``i`` along ``axis``: a gather of a
    permutation. ``jnp.roll`` by a traced shift concatenates ``x`` with itself and slices,
    a buffer twice ``x``'s size for every rotation and its gradient."""
    # typed as varying wherever the shift is (a piece's shift follows its ep index), so
    # the cotangent below has x's type; the cast's transpose sums where x was invariant
    return _rotate_rows(vary(x, varying(shift)), shift.astype(jnp.int32), axis)


@partial(jax.custom_vjp, nondiff_argnums=(2,))
def _rotate_rows(x, shift, axis: int):
    n = x.shape[axis]
    rows = (jnp.arange(n, dtype=jnp.int32) + shift) % n
    return jnp.take(x, rows, axis=axis, unique_indices=True, mode="clip")


def _rotate_rows_fwd(x, shift, axis: int):
    return _rotate_rows(x, shift, axis), shift


def _rotate_rows_bwd(axis: int, shift, ct):
    # a permutation's transpose is the inverse permutation: a gather again. Autodiff's
    # transpose of the gather is a scatter-add into zeros, and XLA (CPU) copies the one
    # zeros broadcast for every such scatter early in the forward and holds each copy to
    # the backward: 12 row-sized buffers alive at the peak of expert(ep=4, dp=2) on
    # moe-tiny-dropless, 1.5 MB of its 4.2 MB temp
    return _rotate_rows(ct, -shift, axis), None


_rotate_rows.defvjp(_rotate_rows_fwd, _rotate_rows_bwd)


@jax.custom_jvp
def _erfc(x):
    """``erfc`` whose derivative works under shard_map: JAX's own (0.12) evaluates a
    ``polynomial`` with literal coefficients that its varying-axes check rejects, so
    the exact GELU could not be differentiated inside a manual region. Same values; the
    derivative -2/sqrt(pi) exp(-x^2) with ordinary ops."""
    return jax.lax.erfc(x)


@_erfc.defjvp
def _erfc_jvp(primals, tangents):
    (x,), (t,) = primals, tangents
    return _erfc(x), (-2.0 / np.sqrt(np.pi)) * jnp.exp(-x * x) * t


def _bind_call(op: Op, ins, out_shapes):
    """A custom-derivative or remat call holds a program traced at global shapes; an
    elementwise one (every operand of one shape) is evaluated at the piece's shape, its
    primal differentiated directly."""
    inner = op.eqn.params.get("call_jaxpr", op.eqn.params.get("jaxpr"))
    jaxpr = getattr(inner, "jaxpr", inner)
    shapes = {tuple(v.aval.shape) for v in (*jaxpr.invars, *jaxpr.outvars) if v.aval.shape}
    if len(shapes) > 1:
        raise LayoutError(
            f"{op.where}: a {op.primitive} over operands of shapes {sorted(shapes)} cannot "
            f"run on pieces; leave it outside the manual region"
        )
    glob = shapes.pop() if shapes else ()
    local = tuple(out_shapes[0]) if out_shapes else glob
    try:
        outs = _eval_elementwise(inner, ins, glob, local)
    except (LayoutError, TypeError, ValueError) as e:
        raise LayoutError(
            f"{op.where}: the {op.primitive} cannot run on pieces of shape {local} (whole: "
            f"{glob}): {e}; leave it outside the manual region"
        ) from None
    _check_shapes(op, outs, out_shapes)
    return outs


def _eval_elementwise(inner, ins, glob, local):
    """Evaluates a (closed) jaxpr with every ``glob``-shaped param made ``local``; nested
    jit calls are evaluated the same way."""
    jaxpr = getattr(inner, "jaxpr", inner)
    env = dict(zip(jaxpr.constvars, getattr(inner, "consts", ())))
    env.update(zip(jaxpr.invars, ins))

    def read(v):
        return v.val if hasattr(v, "val") else env[v]

    for eqn in jaxpr.eqns:
        args = _agree([read(v) for v in eqn.invars], [v.aval.dtype for v in eqn.invars])
        if eqn.primitive.name in ("jit", "pjit", "closed_call"):
            outs = _eval_elementwise(eqn.params.get("jaxpr", eqn.params.get("call_jaxpr")), args,
                                     glob, local)  # fmt: skip
        else:
            params = _local_params(eqn, args, glob, local)
            out = eqn.primitive.bind(*args, **eqn.primitive.get_bind_params(params))
            outs = out if eqn.primitive.multiple_results else [out]
            want = [_local_shape(v.aval.shape, glob, local) for v in eqn.outvars]
            got = [tuple(o.shape) for o in outs]
            if any(w is not None and g != w for g, w in zip(got, want)):
                raise LayoutError(
                    f"the {eqn.primitive.name} inside gives {got} on a piece where "
                    f"{want} was expected"
                )
        env.update(zip(eqn.outvars, outs))
    return [read(v) for v in jaxpr.outvars]


def _local_shape(shape, glob, local):
    """A body value's shape on the piece, where it follows from ``glob -> local``: the
    whole shape, or the shape with unit dims added or dropped (a kept-dims reduction's
    ``(.., 1)``); None where it does not."""
    shape = tuple(shape)
    if shape == tuple(glob):
        return tuple(local)
    if [d for d in shape if d != 1] == [d for d in glob if d != 1] and len(shape) != len(glob):
        split = iter(loc for g, loc in zip(glob, local) if g != 1)
        return tuple(1 if d == 1 else next(split) for d in shape)
    return None


def _local_params(eqn, args, glob, local) -> dict:
    """``eqn``'s params with its global sizes made those of the piece. A broadcast's output
    dim that an operand dim fills keeps that dim's local size (a reduction over the last
    axis of a softmax broadcast back to ``(.., 1)``, jax 0.12.1's ``_softmax``); the
    broadcast's new dims, and a reshape's sizes, follow :func:`_local_shape`."""
    params = dict(eqn.params)
    if "sharding" in params:
        params["sharding"] = None
    name = eqn.primitive.name
    if name == "broadcast_in_dim":
        shape = list(params["shape"])
        whole = _local_shape(shape, glob, local)
        if whole is not None:
            shape = list(whole)
        src = eqn.invars[0].aval.shape
        for i, d in enumerate(params["broadcast_dimensions"]):
            if src[i] == params["shape"][d]:  # not broadcast along d: the operand's size
                shape[d] = args[0].shape[i]
        params["shape"] = tuple(shape)
    elif name in ("reshape", "iota"):
        key = "new_sizes" if name == "reshape" else "shape"
        mapped = _local_shape(params[key], glob, local)
        if mapped is not None:
            params[key] = mapped
    return params


def _check_shapes(op: Op, outs, out_shapes):
    got = [tuple(o.shape) for o in outs]
    want = [tuple(s) for s in out_shapes]
    if got != want:
        raise LayoutError(
            f"{op.where}: on its pieces the {op.primitive} gives shapes {got} where the plan "
            f"says {want}; this op cannot run split this way inside a manual region"
        )
