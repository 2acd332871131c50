"""Helpers for writing spaces: split dim classes over a mesh axis, assign by mesh level.

A space is a function ``space(graph, n_devices) -> Plan`` written with the primitives.
These helpers are the common moves, built from ``op_trans`` and ``op_assign`` only.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from fractions import Fraction

from jscaler.errors import PlanError, SplitError
from jscaler.ir.graph import LOOP_PRIMITIVES, Graph, Layer, Op
from jscaler.plan.classes import DimClasses
from jscaler.plan.mesh import MeshSpec
from jscaler.plan.plan import Node, Plan, SubOp
from jscaler.plan.primitives import (
    node_with_leaves,
    split_problem,
)

__all__ = [
    "assign_mesh",
    "batch_axes",
    "data_parallel",
    "recompute_layers",
    "recomputed_layers",
    "shard_dim",
    "split_classes",
    "split_ops",
]


def batch_axes(graph: Graph, n: int | None = None) -> list[tuple[int, int]]:
    """(tensor, 0) for every batch leaf of rank >= 1: the seeds of data parallelism.

    With ``n``, every such leaf must split n ways; otherwise a PlanError says which.
    """
    seeds = [
        (t, 0)
        for t in graph.inputs
        if graph.tensors[t].role == "batch" and len(graph.tensors[t].shape) >= 1
    ]
    for t, _ in seeds if n else ():
        rows = graph.tensors[t].shape[0]
        if rows % n:
            raise PlanError(
                f"batch leaf {graph.tensors[t].name!r} has {rows} rows (per micro-batch), "
                f"which data parallelism of degree {n} cannot split; use a batch size whose "
                f"micro-batches divide by {n}"
            )
    return seeds


def shard_dim(shape: tuple[int, ...], n: int) -> int | None:
    """The largest dim n divides (the first of equals), or None: where ZeRO splits a
    parameter's gradient, update and optimizer state n ways."""
    best = None
    for a, size in enumerate(shape):
        if size % n == 0 and size >= n and (best is None or size > shape[best]):
            best = a
    return best


def split_classes(
    plan: Plan,
    seeds: Sequence[tuple[int, int]],
    n: int,
    *,
    ops: Iterable[Op] | None = None,
    classes: DimClasses | None = None,
    choose=None,
) -> Plan:
    """Splits each op n ways along the first seed class it carries; replicates the rest.

    Args:
      seeds: tensor axes ``(tensor id, axis)`` whose dim classes to split.
      ops: the ops to transform (default: every forward op).
      choose: optional ``fn(op, dim) -> bool`` vetoing a split (then the op replicates).
    """
    classes = classes or DimClasses.for_graph(plan.pgraph.graph)
    rank: dict = {}
    for s in seeds:
        rank.setdefault(classes.of(*s), len(rank))

    def dim_for(op):
        found = sorted((rank[c], d) for c, d in classes.first_dims(op).items() if c in rank)
        return [d for _, d in found if choose is None or choose(op, d)]

    targets = ops if ops is not None else plan.pgraph.graph.ops
    return split_ops(plan, {op.id: dim_for(op) for op in targets}, n)


def split_ops(
    plan: Plan, dims: Mapping[int, str | Sequence[str] | None], n: int, *, strict: bool = False
) -> Plan:
    """``op_trans`` of many ops at once: every leaf of op ``i`` splits n ways along
    ``dims[i]`` (a dim name, or candidates in order: the first it can split n ways), and
    replicates n ways when it has none. One new plan for all (the primitives one op at a
    time copy the plan per call: quadratic on graphs of thousands of ops). ``strict``: a
    leaf none of whose wanted dims splits n ways raises the first one's
    :class:`SplitError`, as ``op_trans(plan, op, split(dim), n)`` does, instead of
    replicating."""
    trees = dict(plan.trees)
    pg = plan.pgraph
    for op_id, want in dims.items():
        if not pg.has(op_id):
            raise PlanError(f"split_ops: no op {op_id} in this plan's graph")
        op = pg.op(op_id)
        wanted = [want] if isinstance(want, str) else list(want or ())
        tree = trees.get(op_id, Node())
        for path, _ in list(tree.leaves()):
            dim = next((d for d in wanted if not split_problem(op, tree, path, d, n)), None)
            if strict and wanted and dim is None:
                raise SplitError(split_problem(op, tree, path, wanted[0], n))
            tree = tree.replace(
                path,
                node_with_leaves("split", dim, n)
                if dim
                else node_with_leaves("replicate", None, n),
            )
        trees[op_id] = tree
    return plan.evolve(trees=trees)


def assign_mesh(plan: Plan, levels: Sequence[str], *, ops: Iterable[Op] | None = None) -> Plan:
    """Assigns every leaf: its child index at tree level k is its coordinate on mesh axis
    ``levels[k]``. Every op must have been transformed once per level."""
    mesh = plan.mesh
    sizes = mesh.shape
    for name in levels:
        if name not in sizes:
            raise PlanError(f"assign_mesh: mesh {mesh} has no axis {name!r}")
    targets = list(ops) if ops is not None else list(plan.pgraph.graph.ops)
    trees = dict(plan.trees)
    placed: dict[Node, Node] = {}  # repeated layers share trees: place each tree once

    def place(node: Node, path: tuple[int, ...]) -> Node:
        if node.algo == "leaf":
            return Node(device=mesh.device_at(dict(zip(levels, path))))
        kids = tuple(place(c, (*path, i)) for i, c in enumerate(node.children))
        return Node(node.algo, node.dim, kids)

    for op in targets:
        tree = trees.get(op.id, Node())
        if tree not in placed:
            for path, _ in tree.leaves():
                if len(path) != len(levels):
                    raise PlanError(
                        f"assign_mesh: sub-op {SubOp(op.id, path)} of {op.where} is "
                        f"{len(path)} levels deep; expected one level per mesh axis "
                        f"{list(levels)}"
                    )
            placed[tree] = place(tree, ())
        trees[op.id] = placed[tree]
    return plan.evolve(trees=trees)


def recompute_layers(plan: Plan, fraction) -> Plan:
    """Selective activation checkpointing: recompute a fraction of the repeated layers,
    evenly spread (1/2: every other layer, the second of each pair; 1: all of them). The
    layers stacked under an exposed scan are one decision: any fraction above 0 recomputes
    every iteration of its body."""
    layers = recomputed_layers(plan.graph, fraction)
    if not layers:
        return plan
    # op_trans(plan, layer.graph, recompute()) per layer, in one new plan
    groups = tuple(tuple(sorted(o.id for o in layer.graph.ops)) for layer in layers)
    return plan.evolve(recompute=plan.recompute + groups)


def recomputed_layers(graph: Graph, fraction) -> list:
    """The repeated layers ``recompute_layers(plan, fraction)`` checkpoints."""
    try:
        p = Fraction(fraction).limit_denominator(64)
    except (TypeError, ValueError):  # 'all', None, a list: not a number
        p = None
    if p is None or not 0 <= p <= 1:
        raise PlanError(f"recompute={fraction!r}: expected a fraction between 0 and 1")
    if p == 0:
        return []
    layers = graph.layers()
    scanned = _scanned_layers(graph)
    if not layers and not scanned:
        raise PlanError(
            f"recompute={fraction}: the graph has no repeated layers (module lists such as "
            f"blocks/0, blocks/1, ..., or layers stacked under a scan) to checkpoint"
        )
    chosen = [lay for i, lay in enumerate(layers) if math.floor((i + 1) * p) > math.floor(i * p)]
    return chosen + scanned


def _scanned_layers(graph: Graph) -> list[Layer]:
    """One Layer per exposed scan: its body, which a plan recomputes for every iteration
    or for none (one scan runs one program per iteration)."""
    bodies: dict = {}
    for o in graph.ops:
        if o.loop is not None and o.primitive not in LOOP_PRIMITIVES:
            bodies.setdefault(o.loop, []).append(o)
    return [
        Layer(f"scan {loop.index} (x{loop.length})", loop.index, graph.subgraph(ops))
        for loop, ops in bodies.items()
    ]


def data_parallel(graph: Graph, n_devices: int) -> Plan:
    """Data parallelism: every op carrying the batch dim is split n ways; others replicate.

    Parameters are replicated; their gradients are all-reduced by the layouts.
    """
    mesh = MeshSpec.create(dp=n_devices)
    plan = Plan.create(graph, mesh, name=f"dp(dp={n_devices})")
    plan = split_classes(plan, batch_axes(graph, n_devices), n_devices)
    return assign_mesh(plan, ["dp"])
