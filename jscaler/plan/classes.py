"""Dim classes: which axes of which tensors are the same logical dim across a graph.

Every op's annotation says which of its tensors' axes carry the same dim; joining those
statements over the whole graph partitions all (tensor, axis) pairs into classes. A
scan's carry in and carry out are one class per axis. The batch class holds every
activation's batch axis; the class of a column-parallel weight's
output axis runs through the heads (or the MLP's hidden) to the row-parallel weight's
input axis, where it is summed away. Splitting a class n ways splits every op along it,
which is how spaces find what to split in a model they have never seen.
"""

from __future__ import annotations

from collections.abc import Iterator

from jscaler.ir.graph import Graph, Literal, Op
from jscaler.ir.unionfind import UnionFind

__all__ = ["DimClasses"]


class DimClasses:
    """Union-find over (tensor id, axis) pairs, linked by every op's annotation."""

    def __init__(self, graph: Graph):
        self.graph = graph
        self._uf = UnionFind()
        self._op_dims: list[tuple[Op, str, tuple[int, int]]] = []
        self._by_op: dict[int, list[tuple[str, tuple[int, int]]]] = {}
        self._first_dims: dict[int, dict] = {}
        self._class_index: dict | None = None  # class -> [(op, dim)], built on first use
        for op in graph.ops:
            if op.annotation is None:
                continue
            ann = op.annotation
            leading: dict[str, list[tuple[int, int]]] = {}
            for dims, ids in ((ann.inputs, op.inputs), (ann.outputs, op.outputs)):
                for t, tid in zip(dims, ids):
                    if isinstance(tid, Literal):
                        continue
                    for axis, ax in enumerate(t):
                        leading.setdefault(ax[0], []).append((tid, axis))
            for d, nodes in leading.items():
                for n in nodes[1:]:
                    self._uf.union(nodes[0], n)
                self._op_dims.append((op, d, nodes[0]))
                self._by_op.setdefault(op.id, []).append((d, nodes[0]))
        # a scan's carry is one value across iterations: its axes are the same dims in
        # the body's carry in and carry out, so a split of one splits the other
        for loop in {op.loop for op in graph.ops if op.loop is not None}:
            for c_in, c_out in loop.carries:
                if isinstance(c_out, Literal) or c_in not in graph.tensors:
                    continue
                for axis in range(len(graph.tensors[c_in].shape)):
                    self._uf.union((c_in, axis), (c_out, axis))

    @classmethod
    def for_graph(cls, graph: Graph) -> DimClasses:
        """The graph's classes, built once per graph (graphs are immutable)."""
        return graph.memo((DimClasses.for_graph,), lambda: cls(graph))

    def of(self, tensor: int, axis: int) -> tuple[int, int]:
        """The class of a tensor axis (an opaque, comparable key)."""
        return self._uf.find((tensor, axis))

    def op_dims(self, cls) -> Iterator[tuple[Op, str]]:
        """``(op, dim name)`` for every op with a dim in the class, in graph order."""
        if self._class_index is None:  # the unions are all made in __init__: index once
            self._class_index = {}
            for op, d, node in self._op_dims:
                self._class_index.setdefault(self._uf.find(node), []).append((op, d))
        yield from self._class_index.get(cls, ())

    def dim_of(self, op: Op, cls) -> str | None:
        """The op's dim in the class, if it has one."""
        return self.first_dims(op).get(cls)

    def first_dims(self, op: Op) -> dict:
        """class -> the op's first dim in it, for every class the op carries."""
        first = self._first_dims.get(op.id)
        if first is None:
            first = {}
            for d, node in self._by_op.get(op.id, ()):
                first.setdefault(self._uf.find(node), d)
            self._first_dims[op.id] = first
        return first

    def dims_in(self, op: Op, cls) -> list[str]:
        """Every dim of the op in the class (attention's score matmul carries the
        sequence class twice: as queries and as keys)."""
        return [d for d, node in self._by_op.get(op.id, ()) if self._uf.find(node) == cls]

    def members(self, cls) -> list[tuple[int, int]]:
        return sorted(n for n in list(self._uf.parent) if self._uf.find(n) == cls)
