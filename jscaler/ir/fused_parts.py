"""Fused projections cut in unequal parts, or into heads then sliced: a matmul per part.

:mod:`jscaler.ir.unfuse` handles a fused projection whose ``split`` cuts equal parts. Two
other ways of writing one leave each part's heads tied to no dim of the weight:

* grouped-query attention's fused q/k/v: ``jnp.split(qkv, [d, d + kv])``, parts of
  unequal sizes (q has more heads than k and v);
* a fused projection reshaped into heads and then sliced: ``qkv.reshape(b, s, H + 2K,
  hd)`` then ``[:, :, :H]``, ``[:, :, H:H + K]``, ``[:, :, H + K:]``.

In both, each part is a slice (``'^'``) of the fused output, so no plan splits the heads
through it and the attention after it runs whole on every device. :func:`cut_fused_parts`
computes each part with a matmul of its own, on the slice of the weight's columns it
reads (the bias add or cast between the matmul and the cut sliced alike; a reshape into
heads applied per part). Every output element is the same dot product as before; each
part's features now start a dim of their own, which a plan splits by heads, as it does
separate q, k and v projections. The weight is read through slices, so it is stored
whole, as :mod:`jscaler.ir.unfuse`'s view stores it.
"""

from __future__ import annotations

import jax

from jscaler.ir.build import Builder
from jscaler.ir.graph import Graph, Literal, Op
from jscaler.ir.unfuse import chain_to_weight, free_axis, on_view

__all__ = ["cut_fused_parts"]


def cut_fused_parts(graph: Graph) -> Graph:
    """``graph`` with every fused projection cut by an unequal ``split``, or by a reshape
    into heads followed by slices of the heads, computed as one matmul per part."""
    found = []
    for op in graph.ops:
        m = _match_split(graph, op) if op.primitive == "split" else None
        m = m or (_match_heads(graph, op) if op.primitive == "reshape" else None)
        if m:
            found.append(m)
    if not found:
        return graph
    b = Builder(strict=True, first_id=max(graph.tensors) + 1)
    replace: dict[int, list[Op]] = {}
    dropped: set[int] = set()
    for dot, side, chain, at, ranges, heads, outs, gone in found:
        start = len(b.ops)
        _rewrite(graph, b, dot, side, chain, ranges, heads, outs)
        replace[at.id] = b.ops[start:]
        dropped |= {dot.id, *(o.id for o in chain), *(o.id for o in gone)}
    return b.splice(graph, replace, dropped)


def _match_split(graph: Graph, split: Op):
    sizes = split.eqn.params["sizes"]
    if len(sizes) < 2 or len(set(sizes)) == 1:
        return None  # equal parts: jscaler.ir.unfuse's view
    axis = split.eqn.params["axis"]
    found = chain_to_weight(graph, split.inputs[0], axis)
    if found is None:
        return None
    dot, side, chain = found
    starts = [sum(sizes[:j]) for j in range(len(sizes))]
    ranges = [(a, a + n) for a, n in zip(starts, sizes, strict=True)]
    return dot, side, chain, split, (axis, ranges), None, list(split.outputs), [split]


def _match_heads(graph: Graph, reshape: Op):
    """A reshape of a fused projection's output axis into (heads, head dim), each of whose
    consumers slices a contiguous run of heads, the runs covering every head once."""
    (src,) = reshape.tensor_inputs
    old, new = graph.tensors[src].shape, graph.tensors[reshape.outputs[0]].shape
    if len(new) != len(old) + 1 or reshape.eqn.params.get("dimensions") is not None:
        return None
    axis = next((i for i in range(len(old)) if old[i] != new[i]), None)
    if axis is None or old[:axis] != new[:axis] or old[axis + 1 :] != new[axis + 2 :]:
        return None
    n_heads, hd = new[axis], new[axis + 1]
    users = graph.consumers(reshape.outputs[0])
    if len(users) < 2 or reshape.outputs[0] in _outputs(graph):
        return None
    runs = []
    for u in users:
        if u.primitive != "slice" or u.inputs[0] != reshape.outputs[0]:
            return None
        p = u.eqn.params
        if p["strides"] not in (None,) and any(s != 1 for s in p["strides"]):
            return None
        lo, hi = p["start_indices"], p["limit_indices"]
        if any((lo[i], hi[i]) != (0, new[i]) for i in range(len(new)) if i != axis):
            return None
        runs.append((lo[axis], hi[axis], u))
    runs.sort(key=lambda r: r[0])
    if [r[0] for r in runs] != [0, *(r[1] for r in runs[:-1])] or runs[-1][1] != n_heads:
        return None
    found = chain_to_weight(graph, src, axis)
    if found is None:
        return None
    dot, side, chain = found
    ranges = [(a * hd, z * hd) for a, z, _ in runs]
    slices = [u for _, _, u in runs]
    first = min((reshape, *slices), key=lambda o: graph.ops.index(o))
    outs = [u.outputs[0] for u in slices]
    return dot, side, chain, first, (axis, ranges), hd, outs, [reshape, *slices]


def _outputs(graph: Graph) -> set[int]:
    return {x for x in graph.outputs if not isinstance(x, Literal)}


def _rewrite(graph, b: Builder, dot: Op, side: int, chain, cut, heads, outs) -> None:
    """Adds per part: the matmul on the weight's columns of the part, the chain on the
    part's slice of its other operands, the reshape into heads (if any)."""
    axis, ranges = cut
    _, w_axis = free_axis(graph, dot, axis)
    params = dot.eqn.primitive.get_bind_params(dict(dot.eqn.params))
    prim = dot.eqn.primitive

    def part_fn(lo, hi):
        def part(x, y, *rest):
            operands = [x, y]
            operands[side] = jax.lax.slice_in_dim(operands[side], lo, hi, axis=w_axis)
            t = prim.bind(*operands, **params)
            width = graph.tensors[dot.outputs[0]].shape[axis]

            def cut(v):  # the part's slice of an operand spanning the fused axis
                full = v.ndim and v.shape[axis] == width
                return jax.lax.slice_in_dim(v, lo, hi, axis=axis) if full else v

            rest = iter(rest)
            prev = dot.outputs[0]
            for op in chain:
                n = sum(1 for a in op.inputs if not isinstance(a, Literal) and a != prev)
                t = on_view(op, prev, cut)(t, *(next(rest) for _ in range(n)))
                prev = op.outputs[0]
            if heads is not None:
                t = jax.lax.reshape(
                    t, (*t.shape[:axis], (hi - lo) // heads, heads, *t.shape[axis + 1 :])
                )
            return t

        return part

    others = [x for op in chain for x in op.tensor_inputs if x not in _chain_outs(dot, chain)]
    for (lo, hi), out in zip(ranges, outs, strict=True):
        start = len(b.ops)
        (t,) = b.emit(part_fn(lo, hi), [*dot.inputs, *others], dot.path, graph)
        b.rename_outputs(start, {t: out})


def _chain_outs(dot: Op, chain) -> set[int]:
    return {dot.outputs[0], *(o.outputs[0] for o in chain)}
