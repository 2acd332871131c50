"""Helpers for writing spaces: split dim classes over a mesh axis, assign by mesh level.

A space is a function ``space(graph, n_devices) -> Plan`` written with the primitives.
These helpers are the common moves, built from ``op_trans`` and ``op_assign`` only.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from fractions import Fraction

from jscaler.errors import PlanError
from jscaler.ir.graph import Graph, Op
from jscaler.plan.classes import DimClasses
from jscaler.plan.mesh import MeshSpec
from jscaler.plan.plan import Plan, SubOp
from jscaler.plan.primitives import (
    _split_problem,
    op_assign,
    op_trans,
    recompute,
    replicate,
    split,
)

__all__ = [
    "assign_mesh",
    "batch_axes",
    "data_parallel",
    "recompute_layers",
    "split_classes",
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
    classes = classes or DimClasses(plan.pgraph.graph)
    roots = [classes.of(*s) for s in seeds]
    for op in list(ops if ops is not None else plan.pgraph.graph.ops):
        for sub in plan.sub_ops(op.id):
            dim = None
            for r in roots:
                d = classes.dim_of(op, r)
                tree = plan.tree(op.id)
                if d is not None and not _split_problem(op, tree, sub.path, d, n):
                    if choose is None or choose(op, d):
                        dim = d
                        break
            algo = split(dim) if dim else replicate()
            plan, _ = op_trans(plan, sub, algo, n)
    return plan


def assign_mesh(plan: Plan, levels: Sequence[str], *, ops: Iterable[Op] | None = None) -> Plan:
    """Assigns every leaf: its child index at tree level k is its coordinate on mesh axis
    ``levels[k]``. Every op must have been transformed once per level."""
    mesh = plan.mesh
    sizes = mesh.shape
    for name in levels:
        if name not in sizes:
            raise PlanError(f"assign_mesh: mesh {mesh} has no axis {name!r}")
    targets = list(ops) if ops is not None else list(plan.pgraph.graph.ops)
    for op in targets:
        for sub in plan.sub_ops(op.id):
            if len(sub.path) != len(levels):
                raise PlanError(
                    f"assign_mesh: sub-op {sub} of {op.where} is {len(sub.path)} levels deep; "
                    f"expected one level per mesh axis {list(levels)}"
                )
            coords = dict(zip(levels, sub.path))
            plan = op_assign(plan, SubOp(sub.op, sub.path), mesh.device_at(coords))
    return plan


def recompute_layers(plan: Plan, fraction) -> Plan:
    """Selective activation checkpointing: recompute a fraction of the repeated layers,
    evenly spread (1/2: every other layer, the second of each pair; 1: all of them)."""
    p = Fraction(fraction).limit_denominator(64)
    if not 0 <= p <= 1:
        raise PlanError(f"recompute={fraction!r}: expected a fraction between 0 and 1")
    if p == 0:
        return plan
    layers = plan.graph.layers()
    if not layers:
        raise PlanError(
            f"recompute={fraction}: the graph has no repeated layers (module lists such as "
            f"blocks/0, blocks/1, ...) to checkpoint"
        )
    for i, layer in enumerate(layers):
        if math.floor((i + 1) * p) > math.floor(i * p):
            plan, _ = op_trans(plan, layer.graph, recompute())
    return plan


def data_parallel(graph: Graph, n_devices: int) -> Plan:
    """Data parallelism: every op carrying the batch dim is split n ways; others replicate.

    Parameters are replicated; their gradients are all-reduced by the layouts.
    """
    mesh = MeshSpec.create(dp=n_devices)
    plan = Plan.create(graph, mesh, name=f"dp(dp={n_devices})")
    plan = split_classes(plan, batch_axes(graph, n_devices), n_devices)
    return assign_mesh(plan, ["dp"])
