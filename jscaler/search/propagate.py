"""Sharding propagation (MindSpore's idea): complete a partial plan from the ops it fixes.

The user splits a few ops by hand (weights, dimension-changing ops, the boundary between
two parallel styles) with ``op_trans`` on a plan over a mesh, one tree level per mesh
axis; :func:`propagate` gives every other op a strategy too. Starting from the fixed
ops, it walks the graph's producer/consumer edges outward (breadth first, in graph
order, so the result is deterministic) and gives each newly reached op the strategy with
the least cost against its already decided neighbours: the redistribution of the tensors
they share (the search problem's edge costs) plus its own compute and reductions (node
costs). Ops the walk never reaches take their cheapest strategy. Repeated layers share
a strategy as in the search, so fixing one layer's ops fixes every layer's.

Cheap and predictable (no solver), and a seed for the ILP.
"""

from __future__ import annotations

from collections import deque

from jscaler.cost.cluster import Cluster
from jscaler.errors import PlanError
from jscaler.plan.plan import Plan
from jscaler.search.ilp import Solution, to_plan
from jscaler.search.problem import build_problem, objective

__all__ = ["propagate"]


def _strategy(plan: Plan, op_id: int, depth: int):
    """The per-mesh-axis strategy an op's tree states, or None when the op is untouched."""
    if op_id not in plan.trees:
        return None
    node, out = plan.tree(op_id), []
    for _ in range(depth):
        if node.algo == "leaf":
            break
        if len({(c.algo, c.dim) for c in node.children}) > 1:
            raise PlanError(
                f"propagate: {plan.pgraph.op(op_id).where} is split unevenly (its pieces are "
                f"transformed differently); propagation takes one split per mesh axis"
            )
        out.append(node.dim if node.algo == "split" else None)
        node = node.children[0]
    if node.algo != "leaf" or len(out) != depth:
        raise PlanError(
            f"propagate: {plan.pgraph.op(op_id).where} is transformed {len(out)} level(s) "
            f"deep; expected one level per mesh axis of {plan.mesh}"
        )
    return tuple(out)


def propagate(plan: Plan, cluster: str | Cluster = "cpu") -> Plan:
    """Every op of ``plan`` not yet transformed gets a strategy (see the module doc); the
    fixed ops keep theirs. Returns a plan assigned over the plan's mesh."""
    g = plan.pgraph.graph
    depth = len(plan.mesh.axes)
    p = build_problem(g, plan.mesh, cluster)
    choice: dict[int, int] = {}
    for c, ids in enumerate(p.clusters):
        fixed = {s for s in (_strategy(plan, o, depth) for o in ids) if s is not None}
        if len(fixed) > 1:
            where = plan.pgraph.op(ids[0]).where
            raise PlanError(
                f"propagate: the copies of {where} in the repeated layers are split "
                f"differently ({sorted(map(str, fixed))}); fix them alike"
            )
        if fixed:
            s = fixed.pop()
            if s not in p.strategies[c]:
                raise PlanError(
                    f"propagate: {plan.pgraph.op(ids[0]).where} is split {s}, which is not "
                    f"a strategy on mesh {plan.mesh} (a dim the axis size does not divide?)"
                )
            choice[c] = p.strategies[c].index(s)
    if not choice:
        raise PlanError(
            "propagate: the plan fixes no op; split a few with op_trans (one level per mesh "
            "axis) first, or search with jscaler.intra_op()"
        )
    neighbours: dict[int, list[tuple[int, list[list[float]], bool]]] = {}
    for (a, b), mat in p.edges.items():
        neighbours.setdefault(a, []).append((b, mat, True))
        neighbours.setdefault(b, []).append((a, mat, False))
    queue = deque(sorted(choice))
    while queue:
        c = queue.popleft()
        for n, _, _ in sorted(neighbours.get(c, ()), key=lambda x: x[0]):
            if n in choice:
                continue

            def cost(s, n=n):
                t = p.node[n][s] + p.hidden[n][s]
                for m, mat, n_is_src in neighbours[n]:
                    if m in choice:
                        t += mat[s][choice[m]] if n_is_src else mat[choice[m]][s]
                return t

            choice[n] = min(range(len(p.strategies[n])), key=lambda s: (cost(s), s))
            queue.append(n)
    for c in range(len(p.clusters)):
        if c not in choice:
            choice[c] = min(range(len(p.node[c])), key=lambda s: (p.node[c][s], s))
    picked = tuple(choice[c] for c in range(len(p.clusters)))
    secs, mem = objective(p, list(picked))
    name = f"propagate({plan.name})" if plan.name else "propagated"
    done = to_plan(p, Solution(picked, secs, mem, "PROPAGATED"))
    # the input plan's other decisions (recompute, regions, orders, identities) stay
    return plan.evolve(trees=done.trees, name=name)
