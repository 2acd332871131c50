"""Sub-op pieces: which part (vTensor mask) of each input and output a sub-op touches.

Walking an op's tree from the root, a split along dim d into n narrows, for child i, every
tensor whose axis carries d to its i-th chunk of that axis; for a '+' dim the outputs
(which lack d) become the i-th partial sum instead. Tensors without d are whole.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from jscaler.errors import PlanError
from jscaler.ir.graph import Literal, Op
from jscaler.ir.vtensor import Mask
from jscaler.plan.plan import Node, Plan, SubOp

__all__ = ["Piece", "colocated", "device_pieces", "op_pieces"]


@dataclass(frozen=True)
class Piece:
    """One leaf sub-op: its device and the masks of its inputs (None: literal) and outputs."""

    sub: SubOp
    device: int | None
    inputs: tuple[Mask | None, ...]
    outputs: tuple[Mask, ...]


def _splits(tree: Node, path):
    node, out = tree, []
    for i in path:
        if node.algo == "split":
            out.append((node.dim, len(node.children), i))
        node = node.children[i]
    return out


def _mask(dims, shape, splits, kinds, is_output) -> Mask:
    m = Mask.full(shape)
    for d, n, i in splits:
        axis = next((a for a, ax in enumerate(dims) if ax[0] == d), None)
        if axis is not None:
            m = m.split(axis, n, i)
        elif is_output and kinds.get(d) == "+":
            m = m.split_value(n, i)
    return m


def op_pieces(plan: Plan, op: Op) -> tuple[Piece, ...]:
    """The pieces of every leaf of ``op``'s tree in ``plan`` (cached on the plan)."""
    return plan.memo((op_pieces, op.id), lambda: _pieces(plan, op))


def _pieces(plan: Plan, op: Op) -> tuple[Piece, ...]:
    tree = plan.tree(op.id)
    tensors = plan.pgraph.graph.tensors
    shapes = tuple(None if isinstance(x, Literal) else tensors[x].shape for x in op.inputs)
    masks = _leaf_masks(tree, op.annotation, shapes, tuple(tensors[x].shape for x in op.outputs))
    return tuple(
        Piece(SubOp(op.id, path), leaf.device, ins, outs)
        for (path, leaf), (ins, outs) in zip(tree.leaves(), masks)
    )


@functools.lru_cache(maxsize=65536)
def _leaf_masks(tree: Node, ann, in_shapes, out_shapes) -> tuple:
    """Per leaf of ``tree``: the masks of its inputs (None: literal) and outputs. Shared by
    every op with the same tree, annotation and shapes (a model's repeated layers)."""
    out = []
    for path, _ in tree.leaves():
        splits = _splits(tree, path)
        if ann is None:
            ins = tuple(None if s is None else Mask.full(s) for s in in_shapes)
            outs = tuple(Mask.full(s) for s in out_shapes)
        else:
            ins = tuple(
                None if s is None else _mask(dims, s, splits, ann.kinds, False)
                for dims, s in zip(ann.inputs, in_shapes)
            )
            outs = tuple(
                _mask(dims, s, splits, ann.kinds, True) for dims, s in zip(ann.outputs, out_shapes)
            )
        out.append((ins, outs))
    return tuple(out)


def colocated(tree: Node, path: tuple[int, ...] = ()):
    """Yields ``(path, node, device, count)`` for each unit of work on one device: a leaf
    (count 1), or a split whose leaves all sit on one device (coshard's colocated pieces,
    which together are one contiguous piece of that device)."""
    if tree.algo == "leaf":
        yield path, tree, tree.device, 1
        return
    devices = {leaf.device for _, leaf in tree.leaves()}
    if tree.algo == "split" and len(devices) == 1 and None not in devices:
        yield path, tree, devices.pop(), sum(1 for _ in tree.leaves())
        return
    for i, c in enumerate(tree.children):
        yield from colocated(c, path + (i,))


def device_pieces(plan: Plan, op: Op) -> tuple[tuple[Piece, ...], int]:
    """Pieces with colocated leaves merged (one per device where a plan colocates), and
    how many leaves each merged piece holds (1 when nothing is colocated)."""
    tree = plan.tree(op.id)
    units = list(colocated(tree))
    if all(count == 1 for *_, count in units):
        return op_pieces(plan, op), 1
    tensors = plan.pgraph.graph.tensors
    ann = op.annotation
    out, counts = [], set()
    for path, _, device, count in units:
        splits = _splits(tree, path)
        ins = tuple(
            None if isinstance(x, Literal) else _mask(d, tensors[x].shape, splits, ann.kinds, False)
            for d, x in zip(ann.inputs, op.inputs)
        )
        outs = tuple(
            _mask(d, tensors[x].shape, splits, ann.kinds, True)
            for d, x in zip(ann.outputs, op.outputs)
        )
        out.append(Piece(SubOp(op.id, path), device, ins, outs))
        counts.add(count)
    if len(counts) != 1:
        raise PlanError(
            f"{op.where}: devices hold different numbers of colocated pieces "
            f"({sorted(counts)}); coshard every piece of the op with the same colocate"
        )
    return tuple(out), counts.pop()
