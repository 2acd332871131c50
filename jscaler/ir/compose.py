"""The annotation of a call or loop op, derived from the annotations of its body.

Every axis of every tensor in the body is a node; an op's annotation links the axes that
carry the same dim. A class of linked axes becomes one dim of the composite op: splittable
(``''``) when every op along it splits it plainly, ``'^'`` when any op reduces it, cuts
it, holds it in a non-leading group position, or when it joins two axes of one tensor.
Dims reduced inside the body come out as ``'^'``: whether partial sums survive the rest
of the body is not checked, so the composite does not promise them.
"""

from __future__ import annotations

from collections.abc import Sequence

from jscaler.ir.annotation import Annotation
from jscaler.ir.graph import Graph, Literal
from jscaler.ir.registry import Namer
from jscaler.ir.unionfind import UnionFind

__all__ = ["compose"]


class _Classes(UnionFind):
    """Union-find whose classes can be blocked (not splittable); joins keep the block."""

    def __init__(self):
        super().__init__()
        self.blocked: set = set()

    def union(self, a, b):
        keep, gone = super().union(a, b)
        if gone in self.blocked:
            self.blocked.add(keep)
        return keep, gone

    def block(self, x):
        self.blocked.add(self.find(x))


def compose(
    body: Graph,
    *,
    leading_in: Sequence[bool] | None = None,
    leading_out: Sequence[bool] | None = None,
    carries: Sequence[tuple[int, int]] = (),
) -> Annotation | None:
    """Annotation of an op whose computation is ``body``; None if a body op has none.

    Args:
      body: the inner graph; its inputs/outputs are the op's, in order.
      leading_in / leading_out: per op input/output, True when the op's tensor has an extra
        leading axis the body does not see (a scan's stacked ``xs``/``ys``: the loop axis,
        which is '^').
      carries: (input index, output index) pairs that are the same loop-carried value; their
        axes must keep their dims across iterations.
    """
    if any(o.annotation is None for o in body.ops):
        return None
    uf = _Classes()
    for o in body.ops:
        ann = o.annotation
        where = {}
        for tensors, ids in ((ann.inputs, o.inputs), (ann.outputs, o.outputs)):
            for t, tid in zip(tensors, ids):
                if isinstance(tid, Literal):
                    continue
                for ai, ax in enumerate(t):
                    for pos, d in enumerate(ax):
                        where.setdefault(d, []).append(((tid, ai), pos))
        for d, occurrences in where.items():
            leading = [node for node, pos in occurrences if pos == 0]
            for node in leading[1:]:
                uf.union(leading[0], node)
            plain = ann.kinds[d] == "" and all(pos == 0 for _, pos in occurrences)
            if leading and not plain:
                uf.block(leading[0])
    ins, outs = list(body.inputs), list(body.outputs)
    for i, j in carries:
        if not isinstance(outs[j], Literal):
            for a in range(len(body.tensors[ins[i]].shape)):
                uf.union((ins[i], a), (outs[j], a))
    boundary = [(t, a) for t in ins for a in range(len(body.tensors[t].shape))]
    boundary += [
        (t, a)
        for t in outs
        if not isinstance(t, Literal)
        for a in range(len(body.tensors[t].shape))
    ]
    members: dict = {}
    for node in boundary:
        members.setdefault(uf.find(node), set()).add(node)
    for root, nodes in members.items():
        tensors = [t for t, _ in nodes]
        if len(set(tensors)) < len(tensors):
            uf.blocked.add(root)
    in_roots = {uf.find((t, a)) for t in ins for a in range(len(body.tensors[t].shape))}
    out_roots = {
        uf.find((t, a))
        for t in outs
        if not isinstance(t, Literal)
        for a in range(len(body.tensors[t].shape))
    }
    nm = Namer()
    names: dict = {}

    def axis_name(t, a):
        root = uf.find((t, a))
        if root in uf.blocked or (root in in_roots and root not in out_roots):
            return nm.new("^")
        if root not in names:
            names[root] = nm.new()
        return names[root]

    def dims(t, extra):
        shape = () if isinstance(t, Literal) else body.tensors[t].shape
        loop = [nm.new("^")] if extra else []
        if isinstance(t, Literal):
            return loop + nm.fresh(len(getattr(t.value, "shape", ())), "^")
        return loop + [axis_name(t, a) for a in range(len(shape))]

    leading_in = leading_in or [False] * len(ins)
    leading_out = leading_out or [False] * len(outs)
    return nm.build(
        [dims(t, x) for t, x in zip(ins, leading_in)],
        [dims(t, x) for t, x in zip(outs, leading_out)],
    )
