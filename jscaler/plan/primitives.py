"""The three primitives, pure functions on a frozen Plan, and their algorithms.

* ``op_trans(plan, target, algo, n) -> (plan, sub_ops)``: split a sub-op into n
  (``split(dim)``, ``replicate()``), split it into pieces that stay on its device and run
  one after another (``coshard(dim, colocate)``), mark it for recomputation
  (``recompute()``) or for a hand-lowered region (``manual(kind)``), or insert an
  identity that decouples a tensor's layout from its consumers' (``decouple()``).
* ``op_assign(plan, sub_op, device_or_group) -> plan``: run a sub-op on a device; a group
  of devices replicates it over the group.
* ``op_order(plan, a, b) -> plan``: a runs before b where they share devices.

A target is an op id, an :class:`Op`, a :class:`SubOp`, or a :class:`Graph` (every op
in it). Transforming an op that is already split transforms each of its current leaves.

Example (data parallelism over 4 devices, by hand)::

    plan = Plan.create(graph, MeshSpec.create(dp=4))
    batch_axis = (graph.inputs[-1], 0)                 # a batch leaf, axis 0
    plan, subs = op_trans(plan, graph, split(batch_axis), 4)
    for s in subs:
        plan = op_assign(plan, s, s.path[-1])          # piece i -> device i
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass

from jscaler.errors import AssignmentError, PlanError, SplitError
from jscaler.ir.graph import Graph, Op, Tensor
from jscaler.plan.classes import DimClasses
from jscaler.plan.plan import Node, Plan, Region, SubOp

__all__ = [
    "Algorithm",
    "coshard",
    "decouple",
    "manual",
    "node_with_leaves",
    "op_assign",
    "op_order",
    "op_trans",
    "recompute",
    "replicate",
    "split",
    "split_problem",
]


@dataclass(frozen=True)
class Algorithm:
    """How op_trans transforms a sub-op. Build with split/replicate/recompute/decouple."""

    kind: str
    dim: str | tuple[int, int] | None = None


def split(dim: str | tuple[int, int]) -> Algorithm:
    """Split along an annotation dim (by name), or along the dim that a tensor axis
    ``(tensor id, axis)`` carries in each op (found through the graph's dim classes).

    A '+' dim splits into partial sums. Applied to a subgraph with a tensor axis, ops
    that do not carry that dim, or cannot split it n ways, are replicated instead.
    """
    return Algorithm("split", dim)


def replicate() -> Algorithm:
    """Every piece computes the whole op."""
    return Algorithm("replicate")


def recompute() -> Algorithm:
    """Activation checkpointing: the op (or subgraph) is recomputed in the backward pass."""
    return Algorithm("recompute")


def decouple() -> Algorithm:
    """Insert an identity between a tensor and its consumers, so the tensor (e.g. a
    parameter's storage) can be laid out apart from how its consumers need it. The
    target is a tensor id (or Tensor), or a list of them (one identity each)."""
    return Algorithm("decouple")


def manual(kind: str = "shard_map", axis: str | None = None) -> Algorithm:
    """Lower the target subgraph by hand, as one ``shard_map`` region.

    ``"shard_map"`` (the default) runs the ops on each device's local pieces and moves data
    between them with the collectives the pieces imply (all-gather, all-to-all, psum,
    psum_scatter, local slices), chosen by jscaler rather than by XLA's partitioner.
    ``"ring_attention"`` runs blockwise attention passing keys and values around mesh axis
    ``axis``. The ops keep their pieces (and their validation) either way."""
    return Algorithm("manual", (kind, axis))


def coshard(dim: str | tuple[int, int], colocate: int) -> Algorithm:
    """Coshard (nnScaler): split each target leaf along ``dim`` into ``colocate`` pieces
    that stay on the leaf's device and run one after another, each recomputed in the
    backward pass, so a device holds one piece's activations at a time. Split over the
    devices first (``split``, n ways), then coshard: n x colocate pieces in all. The target
    ops become one manual region; partial sums over ``dim`` are added up on the device
    and reduced across devices once."""
    if isinstance(colocate, bool) or not isinstance(colocate, int) or colocate < 1:
        raise PlanError(f"coshard: colocate must be a positive int, got {colocate!r}")
    return Algorithm("coshard", (dim, colocate))


# ---- op_trans ------------------------------------------------------------------------


def op_trans(plan: Plan, target, algo: Algorithm, n: int = 1) -> tuple[Plan, tuple[SubOp, ...]]:
    """Transforms ``target`` with ``algo`` into ``n`` sub-ops each; returns the new leaves."""
    if not isinstance(algo, Algorithm):
        raise PlanError(f"op_trans: algo must be split(...)/replicate()/..., got {algo!r}")
    if algo.kind == "decouple":
        return _decouple(plan, target)
    if algo.kind == "coshard":
        return _coshard(plan, target, *algo.dim, n)
    if algo.kind == "manual":
        kind, axis = algo.dim
        if axis is not None and axis not in plan.mesh.names:
            raise PlanError(
                f"manual({kind!r}, {axis!r}): the plan's mesh ({plan.mesh}) has no axis {axis!r}"
            )
        ops = tuple(sorted({s.op for s in _target_ops(plan, target)}))
        taken = [o for o in ops if plan.region_of(o) is not None]
        if taken:
            raise PlanError(
                f"manual({kind!r}): {plan.pgraph.op(taken[0]).where} is already in a manual region"
            )
        region = Region(kind, ops, axis)
        return plan.evolve(regions=plan.regions + (region,)), tuple(SubOp(o) for o in ops)
    if algo.kind == "recompute":
        ops = _target_ops(plan, target)
        group = tuple(sorted({s.op for s in ops}))
        return plan.evolve(recompute=plan.recompute + (group,)), tuple(ops)
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise PlanError(f"op_trans: n must be a positive int, got {n!r}")
    leaves = _target_ops(plan, target)
    lenient = isinstance(target, Graph)
    classes = None
    if algo.kind == "split" and isinstance(algo.dim, tuple):
        classes = DimClasses.for_graph(plan.pgraph.graph)
        cls = classes.of(*algo.dim)
    trees = dict(plan.trees)
    made: list[SubOp] = []
    for sub in leaves:
        op = plan.pgraph.op(sub.op)
        tree = trees.get(sub.op, Node())
        if algo.kind == "replicate":
            node = node_with_leaves("replicate", None, n)
        else:
            dim = algo.dim if classes is None else classes.dim_of(op, cls)
            problem = split_problem(op, tree, sub.path, dim, n)
            if problem and not lenient:
                raise SplitError(problem)
            node = (
                node_with_leaves("replicate", None, n)
                if problem
                else node_with_leaves("split", dim, n)
            )
        trees[sub.op] = tree.replace(sub.path, node)
        made.extend(SubOp(sub.op, sub.path + (i,)) for i in range(n))
    return plan.evolve(trees=trees), tuple(made)


@functools.lru_cache(maxsize=1024)
def node_with_leaves(algo: str, dim, n: int) -> Node:
    """A ``split`` (along ``dim``) or ``replicate`` node with ``n`` leaf pieces (nodes
    are immutable: one per arguments, made once, its hash and leaves walked once)."""
    return Node(algo, dim, tuple(Node() for _ in range(n)))


def _target_ops(plan: Plan, target) -> list[SubOp]:
    """The leaf sub-ops a target names."""
    if isinstance(target, Graph):
        ops = [o.id for o in target.ops]
    elif isinstance(target, tuple | list | frozenset | set):
        ops = [getattr(o, "id", o) for o in target]
    elif isinstance(target, Op):
        ops = [target.id]
    elif isinstance(target, SubOp):
        node = plan.tree(target.op).at(target.path) if plan.pgraph.has(target.op) else None
        if node is None:
            raise PlanError(f"op_trans: no op {target.op} in this plan's graph")
        return [SubOp(target.op, target.path + p) for p, _ in node.leaves()]
    elif isinstance(target, int) and not isinstance(target, bool):
        ops = [target]
    else:
        raise PlanError(f"op_trans: cannot transform {target!r}; give an op, SubOp or Graph")
    out = []
    for op_id in ops:
        if not plan.pgraph.has(op_id):
            raise PlanError(f"op_trans: no op {op_id} in this plan's graph")
        out.extend(plan.sub_ops(op_id))
    return out


def dim_extent(op: Op, tree: Node, path: tuple[int, ...], dim: str) -> int:
    """The size of ``dim`` left for the sub-op at ``path`` after the splits above it."""
    size = op.annotation.sizes[dim]
    node = tree
    for i in path:
        if node.algo == "split" and node.dim == dim:
            size //= len(node.children)
        node = node.children[i]
    return size


def split_problem(op: Op, tree: Node, path, dim, n: int) -> str | None:
    """Why the sub-op of ``op`` at ``path`` in ``tree`` cannot be split ``n`` ways along
    ``dim`` (a message naming the op), or None when it can."""
    where = op.where
    ann = op.annotation
    if ann is None:
        return f"{where} has no dim annotation, so it cannot be split; replicate it instead"
    if dim is None:
        return f"{where} does not carry the dim to split along"
    if dim not in ann.kinds:
        return f"{where} has no dim {dim!r}; its annotation is {ann} (dims {list(ann.dims)})"
    if dim not in ann.splittable():
        why = "is marked '^'" if ann.kinds[dim] == "^" else "is not first in its axis group"
        return (
            f"{where}: dim {dim!r} {why} in {ann}, so it cannot be split; "
            f"splittable dims: {list(ann.splittable())}"
        )
    size = dim_extent(op, tree, path, dim)
    if size % n:
        divisors = [k for k in range(2, size + 1) if size % k == 0]
        return (
            f"{where}: dim {dim!r} has size {size} here, which {n} does not divide. "
            f"Use a degree among {divisors or [1]}, or pad that dim to a multiple of {n}."
        )
    return None


def _coshard(plan: Plan, target, dim, colocate: int, n: int) -> tuple[Plan, tuple[SubOp, ...]]:
    if n != 1:
        raise PlanError(
            f"coshard: split over devices first (op_trans with split(dim), n={n}), then "
            f"coshard(dim, colocate) with n=1 to colocate each device's piece"
        )
    leaves = _target_ops(plan, target)
    ops = tuple(sorted({s.op for s in leaves}))
    taken = [o for o in ops if plan.region_of(o) is not None]
    if taken:
        raise PlanError(f"coshard: {plan.pgraph.op(taken[0]).where} is already in a manual region")
    classes = DimClasses.for_graph(plan.pgraph.graph) if isinstance(dim, tuple) else None
    cls = classes.of(*dim) if classes else None
    trees = dict(plan.trees)
    made: list[SubOp] = []
    for sub in leaves:
        op = plan.pgraph.op(sub.op)
        tree = trees.get(sub.op, Node())
        d = dim if classes is None else classes.dim_of(op, cls)
        problem = split_problem(op, tree, sub.path, d, colocate)
        if problem:
            raise SplitError(f"coshard: {problem}")
        device = tree.at(sub.path).device
        kids = tuple(Node(device=device) for _ in range(colocate))
        trees[sub.op] = tree.replace(sub.path, Node("split", d, kids))
        made.extend(SubOp(sub.op, sub.path + (i,)) for i in range(colocate))
    region = Region("coshard", ops)
    return plan.evolve(trees=trees, regions=plan.regions + (region,)), tuple(made)


def _decouple(plan: Plan, target) -> tuple[Plan, tuple[SubOp, ...]]:
    many = isinstance(target, tuple | list)
    tids = [t.id if isinstance(t, Tensor) else t for t in (target if many else [target])]
    for tid in tids:
        if isinstance(tid, bool) or not isinstance(tid, int) or tid not in plan.graph.tensors:
            raise PlanError(f"decouple() applies to a tensor of the graph; got {tid!r}")
        if tid in plan.identities or tids.count(tid) > 1:
            raise PlanError(f"tensor {tid} ({plan.graph.tensors[tid].name}) is already decoupled")
    new = plan.evolve(identities=plan.identities + tuple(tids))
    return new, tuple(SubOp(new.pgraph.identity_of[t]) for t in tids)


# ---- op_assign / op_order ------------------------------------------------------------


def op_assign(plan: Plan, sub_op: SubOp | Op | int, device: int | Sequence[int]) -> Plan:
    """Runs a leaf sub-op on ``device``; a sequence of devices replicates it over them."""
    sub = sub_op if isinstance(sub_op, SubOp) else SubOp(getattr(sub_op, "id", sub_op))
    if not plan.pgraph.has(sub.op):
        raise AssignmentError(f"op_assign: no op {sub.op} in this plan's graph")
    tree = plan.tree(sub.op)
    node = tree.at(sub.path)
    op = plan.pgraph.op(sub.op)
    if node.algo != "leaf":
        raise AssignmentError(
            f"op_assign: sub-op {sub} of {op.where} is split further; assign its leaves "
            f"{[str(s) for s in plan.sub_ops(sub.op) if s.path[: len(sub.path)] == sub.path]}"
        )
    group = [device] if isinstance(device, int) else list(device)
    for d in group:
        if isinstance(d, bool) or not isinstance(d, int) or d not in plan.mesh.devices:
            raise AssignmentError(
                f"op_assign: device {d!r} for sub-op {sub} of {op.where} does not exist; "
                f"the plan's mesh ({plan.mesh}) has devices 0..{plan.mesh.size - 1}"
            )
    trees = dict(plan.trees)
    trees[sub.op] = tree.replace(sub.path, _placed(group))
    return plan.evolve(trees=trees)


def _placed(group: Sequence[int]) -> Node:
    if len(group) == 1:
        return Node(device=group[0])
    return Node("replicate", None, tuple(Node(device=d) for d in group))


def op_order(plan: Plan, first: SubOp | Op | int, then: SubOp | Op | int) -> Plan:
    """Orders ``first`` before ``then`` on the devices they share (checked by validate)."""

    def ref(x):
        if isinstance(x, SubOp):
            return x
        return SubOp(getattr(x, "id", x))

    a, b = ref(first), ref(then)
    for s in (a, b):
        if not plan.pgraph.has(s.op):
            raise PlanError(f"op_order: no op {s.op} in this plan's graph")
    return plan.evolve(orders=plan.orders + ((a, b),))
