"""``jscaler.validate(plan)``: a plan is checked whole before anything is lowered or run.

Checks, in order: every split names a splittable dim and divides it; every assigned
device exists; every consumed piece of every tensor is produced on some device (partial
sums complete; an unassigned sub-op leaves its piece missing); every other sub-op is
assigned too; and data dependencies (piece masks that intersect) together with op_order
constraints form no cycle.
"""

from __future__ import annotations

from jscaler.errors import AssignmentError, CoverageError, CycleError, PlanError, SplitError
from jscaler.ir.graph import Literal
from jscaler.ir.vtensor import Mask, uncovered
from jscaler.plan.cycles import find_cycle
from jscaler.plan.pieces import op_pieces
from jscaler.plan.plan import Node, Plan, SubOp
from jscaler.plan.primitives import split_problem

__all__ = ["validate"]

FORWARD_KINDS = ("op", "call", "loop", "identity")


def validate(plan: Plan, *, n_devices: int | None = None) -> Plan:
    """Checks a plan; returns it unchanged, or raises a :class:`PlanError` subclass.

    Args:
      n_devices: the number of devices the plan will run on, when known.
    """
    if n_devices is not None and plan.mesh.size != n_devices:
        raise AssignmentError(
            f"the plan needs {plan.mesh.size} devices (mesh {plan.mesh}) but {n_devices} "
            f"were given; make the plan for {n_devices} devices or pass {plan.mesh.size}"
        )
    pg = plan.pgraph
    for op_id in plan.trees:
        if not pg.has(op_id):
            raise PlanError(f"the plan transforms op {op_id}, which its graph does not have")
    for op in pg.all_ops:
        _check_splits_and_devices(plan, op)
    _check_coverage(plan)
    for op in pg.all_ops:
        _check_assigned(plan, op)
    for group in plan.recompute:
        for op_id in group:
            if not pg.has(op_id):
                raise PlanError(f"recompute names op {op_id}, which the graph does not have")
    for region in plan.regions:
        for op_id in region.ops:
            if not pg.has(op_id):
                raise PlanError(f"{region.kind} region names op {op_id}, which the graph lacks")
        if region.axis is not None and region.axis not in plan.mesh.names:
            raise PlanError(
                f"{region.kind} region at {pg.op(region.ops[0]).where} runs over mesh axis "
                f"{region.axis!r}, which the plan's mesh ({plan.mesh}) does not have"
            )
    _check_cycles(plan)
    return plan


def _check_splits_and_devices(plan: Plan, op) -> None:
    tree = plan.tree(op.id)
    for path, node in _nodes(tree):
        if node.algo == "split":
            problem = split_problem(op, tree, path, node.dim, len(node.children))
            if problem:
                raise SplitError(problem)
    for path, leaf in tree.leaves():
        if leaf.device is not None and leaf.device not in plan.mesh.devices:
            raise AssignmentError(
                f"sub-op {SubOp(op.id, path)} of {op.where} is assigned to device "
                f"{leaf.device}, which the plan's mesh ({plan.mesh}, devices "
                f"0..{plan.mesh.size - 1}) does not have"
            )


def _check_assigned(plan: Plan, op) -> None:
    """Sub-ops whose outputs nobody consumes must still run somewhere (or be untouched
    grad/update ops, which follow their parameter)."""
    if op.kind not in FORWARD_KINDS and op.id not in plan.trees:
        return
    for path, leaf in plan.tree(op.id).leaves():
        if leaf.device is None:
            raise AssignmentError(
                f"sub-op {SubOp(op.id, path)} of {op.where} is assigned to no device; give "
                f"it one with op_assign(plan, SubOp({op.id}, {path}), device)"
            )


def _nodes(node: Node, path=()):
    yield path, node
    for i, c in enumerate(node.children):
        yield from _nodes(c, path + (i,))


def _check_coverage(plan: Plan) -> None:
    g = plan.pgraph.graph
    consumed = {t for o in g.ops for t in o.tensor_inputs}
    consumed |= {t for t in g.outputs if not isinstance(t, Literal)}
    for op in g.ops:
        pieces = op_pieces(plan, op)
        for k, t in enumerate(op.outputs):
            if t not in consumed:
                continue
            made = [p.outputs[k] for p in pieces if p.device is not None]
            missing = uncovered(made, Mask.full(g.tensors[t].shape))
            if missing:
                unassigned = [str(p.sub) for p in pieces if p.device is None]
                raise CoverageError(
                    f"output {k} of {op.where} is consumed, but its piece {missing[0]} "
                    f"(of shape {list(g.tensors[t].shape)}) is produced on no device"
                    + (
                        f": sub-ops {unassigned} are assigned to no device; op_assign them"
                        if unassigned
                        else ""
                    )
                )


def _check_cycles(plan: Plan) -> None:
    """Sub-ops with data edges from intersecting masks, plus op_order: no cycle."""
    g = plan.pgraph.graph
    pieces = {o.id: op_pieces(plan, o) for o in g.ops}
    producer = {t: o for o in g.ops for t in o.outputs}
    succ: dict[SubOp, set[SubOp]] = {p.sub: set() for ps in pieces.values() for p in ps}
    for o in g.ops:
        for k, t in enumerate(o.inputs):
            if isinstance(t, Literal) or t not in producer:
                continue
            src = producer[t]
            idx = src.outputs.index(t)
            for cp in pieces[o.id]:
                for pp in pieces[src.id]:
                    if cp.inputs[k] is not None and pp.outputs[idx].intersects(cp.inputs[k]):
                        succ[pp.sub].add(cp.sub)
    for a, b in plan.orders:
        for sa in _leaves_under(plan, a):
            for sb in _leaves_under(plan, b):
                succ.setdefault(sa, set()).add(sb)
                succ.setdefault(sb, set())
    cycle = find_cycle(succ, key=lambda s: (s.op, s.path))
    if cycle is None:
        return
    names = " -> ".join(f"{plan.pgraph.op(s.op).path or '<root>'} (sub-op {s})" for s in cycle)
    raise CycleError(
        f"data dependencies and op_order constraints form a cycle: {names}. Remove or flip "
        f"one of the op_order constraints on it."
    )


def _leaves_under(plan: Plan, s: SubOp):
    node = plan.tree(s.op).at(s.path)
    return [SubOp(s.op, s.path + p) for p, _ in node.leaves()]
