"""Fused projections, rewritten so their parts' heads are dims of the weight.

A fused projection computes several tensors with one matmul and cuts its output in
equal parts with ``split``: q, k and v from one ``(d, 3d)`` weight (Hugging Face GPT-2's
``c_attn``), an MLP's gate and up from one ``(d, 2f)``. As traced, the weight's output
axis is one dim of size ``3d``, the ``split`` cuts it (``'^'``), and each part's heads
start a dim of their own: nothing ties head ``h`` of q to the weight's columns
``h*hd .. (h+1)*hd``, so splitting the heads needs the whole fused output, gathered.

:func:`unfuse_projections` views that axis as ``(parts, features)``: the weight operand is
reshaped to ``(.., 3, d)``, the matmul (and the bias add or cast between it and the
``split``) computes ``(.., 3, d)``, and each part is a slice along the ``3``. The
``features`` dim is now one dim from the weight's columns through every part to the
heads, so a plan that splits the heads splits the weight's columns the same way (device
i reads heads i of q, of k and of v): the strided layout of the original axis, as a
contiguous split of a reshaped view. The values are the same, op for op.
"""

from __future__ import annotations

import jax

from jscaler.ir.build import Builder
from jscaler.ir.graph import Graph, Literal, Op

__all__ = ["chain_to_weight", "free_axis", "on_view", "unfuse_projections"]

# ops allowed between the matmul and the split: the bias add, casts, scalings
_CHAIN = {"add", "sub", "mul", "convert_element_type", "copy"}
# what a weight goes through before its matmul (casts, a transposed kernel's transpose)
_WEIGHT_VIEWS = {"convert_element_type", "copy", "transpose"}


def unfuse_projections(graph: Graph) -> Graph:
    """``graph`` with every fused projection (a matmul reading a parameter, whose output
    one ``split`` cuts into equal parts along the parameter's output features, through
    elementwise ops only) computed on the ``(parts, features)`` view of that axis. The
    graph is returned unchanged when it has none."""
    found = [m for op in graph.ops if op.primitive == "split" for m in [_match(graph, op)] if m]
    if not found:
        return graph
    b = Builder(strict=True, first_id=max(graph.tensors) + 1)
    replace: dict[int, list[Op]] = {}  # split op id -> the ops replacing the pattern
    dropped: set[int] = set()
    for dot, side, chain, split in found:
        start = len(b.ops)
        _rewrite(graph, b, dot, side, chain, split)
        replace[split.id] = b.ops[start:]
        dropped |= {dot.id, split.id, *(o.id for o in chain)}
    return b.splice(graph, replace, dropped)


def _match(graph: Graph, split: Op):
    """``(dot, side, chain, split)`` when ``split`` ends a fused projection, else None:
    ``side`` is the matmul operand (0 or 1) holding the weight, ``chain`` the
    elementwise ops between the two, first to last."""
    sizes = split.eqn.params["sizes"]
    if len(sizes) < 2 or len(set(sizes)) != 1:
        return None
    found = chain_to_weight(graph, split.inputs[0], split.eqn.params["axis"])
    return None if found is None else (*found, split)


def chain_to_weight(graph: Graph, t: int, axis: int):
    """``(dot, side, chain)`` when tensor ``t`` is a matmul's output (through elementwise
    ops only, each read by the next alone) whose axis ``axis`` is the output features of
    a parameter, operand ``side`` of the matmul; ``chain``: the elementwise ops, first to
    last. None otherwise."""
    chain = []
    outputs = {x for x in graph.outputs if not isinstance(x, Literal)}
    while True:
        if t in outputs or len(graph.consumers(t)) != 1:
            return None
        op = graph.producer(t)
        if op is None or op.kind != "op" or len(op.outputs) != 1:
            return None
        if op.primitive == "dot_general":
            break
        if op.primitive not in _CHAIN:
            return None
        shape = graph.tensors[t].shape
        full = [x for x in op.tensor_inputs if graph.tensors[x].shape == shape]
        if len(full) != 1 or op.inputs.count(full[0]) != 1:
            return None
        chain.append(op)
        t = full[0]
    side = _weight_side(graph, op, axis)
    return None if side is None else (op, side, chain[::-1])


def _weight_side(graph: Graph, dot: Op, out_axis: int) -> int | None:
    """The operand whose free axis is the dot's output axis, if it is a parameter (through
    casts and transposes)."""
    found = free_axis(graph, dot, out_axis)
    if found is None:
        return None
    side, _ = found
    return None if graph.param_behind(dot.inputs[side], _WEIGHT_VIEWS) is None else side


def free_axis(graph: Graph, dot: Op, out_axis: int) -> tuple[int, int] | None:
    """``(operand, axis)`` of the dot's output axis, or None for a batch axis."""
    (lc, rc), (lb, rb) = dot.eqn.params["dimension_numbers"]
    ranks = [len(graph.tensors[x].shape) for x in dot.inputs]
    free = [
        [a for a in range(ranks[0]) if a not in (*lc, *lb)],
        [a for a in range(ranks[1]) if a not in (*rc, *rb)],
    ]
    k = out_axis - len(lb)
    if k < 0:
        return None
    if k < len(free[0]):
        return 0, free[0][k]
    return 1, free[1][k - len(free[0])]


def _expand(shape, axis: int, parts: int) -> tuple[int, ...]:
    return (*shape[:axis], parts, shape[axis] // parts, *shape[axis + 1 :])


def _shift(dims, axis: int) -> tuple[int, ...]:
    return tuple(d + 1 if d > axis else d for d in dims)


def _rewrite(graph: Graph, b: Builder, dot: Op, side: int, chain: list[Op], split: Op) -> None:
    """Adds to ``b`` the ops computing ``split``'s outputs on the (parts, features) view."""
    parts = len(split.eqn.params["sizes"])
    axis = split.eqn.params["axis"]
    _, w_axis = free_axis(graph, dot, axis)

    def emit(fn, ins, path):
        return b.emit(fn, ins, path, graph)

    def view_of(x):  # the (parts, features) view of the split axis (kept if broadcast)
        if x.ndim == 0:
            return x
        if x.shape[axis] == 1:
            return jax.lax.reshape(x, (*x.shape[:axis], 1, 1, *x.shape[axis + 1 :]))
        return jax.lax.reshape(x, _expand(x.shape, axis, parts))

    params = dict(dot.eqn.params)
    (lc, rc), (lb, rb) = params["dimension_numbers"]
    if side == 0:
        dims = ((_shift(lc, w_axis), rc), (_shift(lb, w_axis), rb))
    else:
        dims = ((lc, _shift(rc, w_axis)), (lb, _shift(rb, w_axis)))
    params["dimension_numbers"] = dims
    params = dot.eqn.primitive.get_bind_params(params)

    def matmul(x, y):
        operands = [x, y]
        w = operands[side]
        operands[side] = jax.lax.reshape(w, _expand(w.shape, w_axis, parts))
        return dot.eqn.primitive.bind(*operands, **params)

    (t,) = emit(matmul, dot.inputs, dot.path)
    prev = dot.outputs[0]
    for op in chain:
        (t,) = emit(
            on_view(op, prev, view_of), [t, *(x for x in op.tensor_inputs if x != prev)], op.path
        )
        prev = op.outputs[0]

    def cut(x):
        return [
            jax.lax.squeeze(jax.lax.slice_in_dim(x, j, j + 1, axis=axis), (axis,))
            for j in range(parts)
        ]

    start = len(b.ops)
    outs = emit(cut, [t], split.path)
    b.rename_outputs(start, dict(zip(outs, split.outputs, strict=True)))


def on_view(op: Op, fused: int, view_of):
    """``op`` as a function of its operand ``fused`` (already on the view) and its other
    tensor operands (in order, put on the view here); literals stay inline."""
    eqn = op.eqn
    params = eqn.primitive.get_bind_params(eqn.params)

    def fn(x, *rest):
        rest = iter(rest)
        args = []
        for a in op.inputs:
            if isinstance(a, Literal):
                args.append(a.value)
            elif a == fused:
                args.append(x)
            else:
                args.append(view_of(next(rest)))
        return eqn.primitive.bind(*args, **params)

    return fn
