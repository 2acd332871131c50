"""Solving the op-trans + op-assign problem: HiGHS, a brute-force check, and the Plan.

:func:`solve` runs HiGHS (single-threaded, seeded, stopped by a work limit that is the
same on every machine) on the model of :mod:`jscaler.search.milp`; when HiGHS proves
nothing within it, a greedy choice improved one cluster at a time (:func:`descent`) stands
in where it is faster, or where HiGHS found nothing. Every host derives the same plan,
unless HiGHS's wall-clock backstop (three times the work limit) cut it short on a slow or
loaded machine, which the solution says (``Solution.cut``) and the runtime's agreement
check (:func:`jscaler.runtime.distributed.check_plan_agreement`) reports; the search's plan
cache lets hosts share one.
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass

from jscaler.errors import PlanError
from jscaler.plan.helpers import assign_mesh, shard_dim, split_ops
from jscaler.plan.pieces import op_pieces
from jscaler.plan.plan import Plan
from jscaler.search.milp import Milp
from jscaler.search.problem import Problem, fits_at_all, no_fit, objective

__all__ = ["Solution", "brute_force", "explain", "solve", "to_plan"]


@dataclass(frozen=True)
class Solution:
    choice: tuple[int, ...]  # strategy index per cluster
    seconds: float
    memory: float
    status: str  # OPTIMAL | FEASIBLE | GREEDY | BRUTE_FORCE
    wall: float = 0.0
    phases: int = 0  # the memory phases in the model (the rest cannot bind)
    cut: str = ""  # what cut HiGHS short: "" | "work" | "wall clock" (milp.Result.cut)
    relaxed: bool = False  # optimal by the LP relaxation alone (milp.Result.relaxed)


def solve(p: Problem, *, time_limit: float = 30.0) -> Solution:
    """The cheapest strategy per cluster under the memory capacity: HiGHS on the model of
    :mod:`jscaler.search.milp` with the memory phases some choice could overfill, for at
    most ``time_limit`` seconds of its work (deterministic; about seconds of the 2-core
    CI machine, 0.6-2.3x across paper-scale problems: :mod:`jscaler.search.milp`).
    Past the limit, the better of the best choice found and the descent's (FEASIBLE), or,
    with none found, the descent's (GREEDY)."""
    start = time.perf_counter()
    if p.capacity is not None and not fits_at_all(p.memory, p.capacity, p.peaks):
        raise no_fit(p.mesh, p.capacity, p.memory, p.peaks)
    model = Milp(p)
    phases = model.binding_phases()
    res = model.solve(phases, time_limit)
    if res.infeasible:
        raise no_fit(p.mesh, p.capacity, p.memory, p.peaks)
    choice, status = res.choice, "OPTIMAL" if res.optimal else "FEASIBLE"
    if not res.optimal:  # cut short by the limit: the descent's choice where it is better
        first = descent(p, greedy(p))
        if choice is None:
            choice, status = first, "GREEDY"
        elif _better(p, first, choice):
            choice = first
    secs, mem = objective(p, list(choice))
    wall = time.perf_counter() - start
    return Solution(choice, secs, mem, status, wall, len(phases), res.cut, res.relaxed)


def _better(p: Problem, a: tuple[int, ...], b: tuple[int, ...]) -> bool:
    """Whether choice ``a`` fits and is faster than ``b``."""
    secs, mem = objective(p, list(a))
    return (p.capacity is None or mem <= p.capacity) and secs < objective(p, list(b))[0]


def descent(p: Problem, choice: tuple[int, ...], sweeps: int = 8) -> tuple[int, ...]:
    """``choice`` improved one cluster at a time (coordinate descent on the step time: its
    node cost and parameter-gradient reduction, and its edges' conversions with its
    neighbours' strategies as they stand), a cluster moving only to a strategy that holds
    no more than its own in the kept state, in every phase and in the activations kept
    gathered between it and its neighbours, so a choice that fits keeps fitting. The
    solver's answer where HiGHS, cut short, found nothing better."""
    near: list[list[tuple[list, bool, int]]] = [[] for _ in p.strategies]
    for (a, b), mat in p.edges.items():
        near[a].append((mat, True, b))
        near[b].append((mat, False, a))
    rows: list[list[list[float]]] = [[row] for row in p.memory]
    for pk in p.peaks:
        for c, row in pk.items():
            rows[c].append(row)
    choice = list(choice)
    touching = _regathers_of(p)
    for _ in range(sweeps):
        moved = False
        for c, own in enumerate(p.node):
            if len(own) < 2:
                continue

            def cost(s, c=c, own=own) -> float:
                t = own[s] + p.hidden[c][s]
                for mat, first, d in near[c]:
                    t += mat[s][choice[d]] if first else mat[choice[d]][s]
                return t

            now = choice[c]
            held = _gathered(touching[c], choice, c, now)
            best = min(
                (
                    s
                    for s in range(len(own))
                    if all(r[s] <= r[now] for r in rows[c])
                    and _gathered(touching[c], choice, c, s) <= held
                ),
                key=lambda s: (cost(s), s),
            )
            if cost(best) < cost(now):
                choice[c], moved = best, True
        if not moved:
            break
    return tuple(choice)


def _regathers_of(p: Problem) -> list[list]:
    """Per cluster, the :class:`~jscaler.search.problem.Regather` s it makes or reads."""
    out: list[list] = [[] for _ in p.strategies]
    for r in p.regathers:
        for c in {r.cluster, *(c for c, _ in r.readers)}:
            out[c].append(r)
    return out


def _gathered(regathers, choice: list[int], c: int, s: int) -> float:
    """The bytes ``regathers`` keep gathered with cluster ``c`` at strategy ``s``."""
    was, choice[c] = choice[c], s
    try:
        return sum(b for r in regathers for b in r.layouts(choice).values())
    finally:
        choice[c] = was


def _fullest_phases(p: Problem) -> list[list[float]]:
    """Per cluster and strategy, its bytes in the phase it fills most (0 where none)."""
    peak = [[0.0] * len(row) for row in p.memory]
    for pk in p.peaks:
        for c, row in pk.items():
            peak[c] = [max(u, v) for u, v in zip(peak[c], row)]
    return peak


def leaner(p: Problem, choice: tuple[int, ...], sweeps: int = 8) -> tuple[int, ...]:
    """``choice`` made leaner one cluster at a time: each moves to the strategy holding
    least of its kept bytes, its fullest phase and the activations kept gathered between
    it and its neighbours as they stand (ties to the cheaper)."""
    touching = _regathers_of(p)
    peak = _fullest_phases(p)
    choice = list(choice)
    for _ in range(sweeps):
        moved = False
        for c, row in enumerate(p.memory):
            best = min(
                range(len(row)),
                key=lambda s, c=c, row=row: (
                    row[s] + peak[c][s] + _gathered(touching[c], choice, c, s),
                    p.node[c][s],
                    s,
                ),
            )
            if best != choice[c]:
                choice[c], moved = best, True
        if not moved:
            break
    return tuple(choice)


def greedy(p: Problem) -> tuple[int, ...]:
    """Each cluster's cheapest strategy; if that exceeds the capacity, each cluster's
    leanest (ties to the cheaper), made leaner where neighbours keep activations
    gathered between them (:func:`leaner`)."""
    fast = tuple(
        min(range(len(row)), key=lambda s, c=c: (row[s] + p.hidden[c][s], s))
        for c, row in enumerate(p.node)
    )
    if p.capacity is None or objective(p, list(fast))[1] <= p.capacity:
        return fast
    peak = _fullest_phases(p)
    lean = tuple(
        min(range(len(row)), key=lambda s, c=c: (row[s] + peak[c][s], p.node[c][s], s))
        for c, row in enumerate(p.memory)
    )
    return leaner(p, lean) if p.regathers else lean


def brute_force(p: Problem) -> Solution:
    """Every combination of strategies (for checking the solver on small graphs)."""
    best = None
    for choice in itertools.product(*(range(len(s)) for s in p.strategies)):
        secs, mem = objective(p, list(choice))
        if p.capacity is not None and mem > p.capacity:
            continue
        if best is None or secs < best[0] - 1e-15:
            best = (secs, mem, choice)
    if best is None:
        raise PlanError(f"no strategy choice fits {p.capacity} bytes per device")
    return Solution(best[2], best[0], best[1], "BRUTE_FORCE")


def to_plan(p: Problem, sol: Solution, name: str = "") -> Plan:
    """The plan of a solution: each op split per mesh axis as its cluster's strategy says;
    where the strategy says ZeRO, the gradient and update of the parameters the op reads
    first (whole) split over every mesh axis along their largest divisible dim."""
    plan = Plan.create(p.graph, p.mesh, name=name)
    chosen, sharded = {}, []
    for c, ids in enumerate(p.clusters):
        for op in ids:
            chosen[op] = p.strategies[c][sol.choice[c]]
        if p.zero and p.zero[c][sol.choice[c]]:
            sharded.extend(ids)
    for level, (_, size) in enumerate(p.mesh.axes):
        plan = split_ops(plan, {op: s[level] for op, s in chosen.items()}, size)
    plan = assign_mesh(plan, p.mesh.names)
    return _zero(plan, p, sharded) if sharded else plan


def _zero(plan: Plan, p: Problem, ops: list[int]) -> Plan:
    pg = plan.pgraph
    index = {o.inputs[0]: k for k, o in enumerate(pg.update_ops)}
    seen, first = set(), {}
    for op in p.graph.ops:
        for x in op.tensor_inputs:
            first.setdefault(x, op.id)
    vops = []
    for op_id in ops:
        op = pg.op(op_id)
        for x in op.tensor_inputs:
            if x in seen or first.get(x) != op_id or p.graph.tensors[x].role != "param":
                continue
            k = op.inputs.index(x)
            if len({q.inputs[k].slices for q in op_pieces(plan, op)}) > 1:
                continue  # read split: not ZeRO-sharded
            dim = shard_dim(p.graph.tensors[x].shape, p.mesh.size)
            if dim is None:
                continue
            seen.add(x)
            vops += [(pg.grad_ops[index[x]], dim), (pg.update_ops[index[x]], dim)]
    for _, size in p.mesh.axes:
        plan = split_ops(plan, {v.id: "abcdefgh"[dim] for v, dim in vops}, size)
    return assign_mesh(plan, p.mesh.names, ops=[v for v, _ in vops])


def explain(problem: Problem, sol: Solution) -> str:
    """The searched strategy of each weight op cluster (and how many ops it stands for)."""
    ops = {o.id: o for o in problem.graph.ops}
    lines = [
        f"searched on mesh {problem.mesh}: {len(problem.clusters)} clusters of "
        f"{len(problem.graph.ops)} ops, {problem.size} strategies, {sol.status}{_cut(sol)} "
        f"in {sol.wall:.1f} s; contractions and lookups:"
    ]
    for c, ids in enumerate(problem.clusters):
        op = ops[ids[0]]
        if op.primitive not in (
            "dot_general",
            "ragged_dot_general",
            "conv_general_dilated",
            "gather",
        ):
            continue
        strategy = problem.strategies[c][sol.choice[c]]
        splits = ", ".join(
            f"{a}: {d}={op.annotation.sizes[d]}" if d else f"{a}: whole"
            for (a, _), d in zip(problem.mesh.axes, strategy)
        )
        if problem.zero and problem.zero[c][sol.choice[c]]:
            splits += ", weight ZeRO-2"
        lines.append(f"  {op.path or '(root)':<28} {str(op.annotation):<36} {splits}  x{len(ids)}")
    return "\n".join(lines)


def _cut(sol: Solution) -> str:
    if sol.relaxed:
        return " (by the LP relaxation alone: its choice is within 0.01% of its bound)"
    if sol.cut == "wall clock":
        return " (HiGHS cut by its wall-clock backstop: another machine may end elsewhere)"
    return " (HiGHS cut by its work limit)" if sol.cut else ""
