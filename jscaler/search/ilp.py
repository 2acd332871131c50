"""Solving the op-trans + op-assign problem: CP-SAT, a brute-force check, and the Plan.

The model is Alpa's: a boolean ``x[c, s]`` per cluster and strategy (exactly one per
cluster), a boolean ``e[a, b, i, j]`` per edge and strategy pair, linked to the ``x`` by
``sum_j e[a, b, i, j] = x[a, i]`` and ``sum_i e[a, b, i, j] = x[b, j]``; minimise
``sum node * x + sum edge * e`` (integer nanoseconds) under ``sum memory * x + w <=
capacity``, ``w >= 0`` at least each phase's ``sum peak * x`` (a recomputed layer's
backward, the gradient reduction); a tied parameter's readers reading it in different
layouts (``d[t, s] >= x[first, s] - sum x[reader, agreeing]``) add its
:class:`~jscaler.search.problem.Tied` costs. CP-SAT runs with one worker, a fixed seed
and a deterministic-time limit, so every host derives the same plan; when it proves
nothing in time, the best solution found is used, and with none, the greedy choice (each
cluster's cheapest strategy, or its leanest when the cheapest do not fit).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

from jscaler.errors import PlanError
from jscaler.plan.helpers import assign_mesh, shard_dim, split_ops
from jscaler.plan.pieces import op_pieces
from jscaler.plan.plan import Plan
from jscaler.search.problem import Problem, fits_at_all, memory_unit, no_fit, objective

__all__ = ["Solution", "brute_force", "explain", "solve", "to_plan"]

NS = 1e9  # objective unit: nanoseconds


@dataclass(frozen=True)
class Solution:
    choice: tuple[int, ...]  # strategy index per cluster
    seconds: float
    memory: float
    status: str  # OPTIMAL | FEASIBLE | GREEDY | BRUTE_FORCE
    wall: float = 0.0


def solve(p: Problem, *, time_limit: float = 30.0) -> Solution:
    """The cheapest strategy per cluster under the memory capacity (CP-SAT)."""
    import time

    from ortools.sat.python import cp_model

    start = time.perf_counter()
    if p.capacity is not None and not fits_at_all(p.memory, p.capacity, p.peaks):
        # what CP-SAT finds, without building it
        raise no_fit(p.mesh, p.capacity, p.memory, p.peaks)
    m = cp_model.CpModel()
    x = [[m.new_bool_var(f"x{c}_{s}") for s in range(len(st))] for c, st in enumerate(p.strategies)]
    for row in x:
        m.add_exactly_one(row)
    terms = [(round(p.node[c][s] * NS), x[c][s]) for c in range(len(x)) for s in range(len(x[c]))]
    for (a, b), mat in sorted(p.edges.items()):
        e = {}
        for i, j in itertools.product(range(len(x[a])), range(len(x[b]))):
            e[i, j] = m.new_bool_var(f"e{a}_{b}_{i}_{j}")
            if mat[i][j]:
                terms.append((round(mat[i][j] * NS), e[i, j]))
        for i in range(len(x[a])):
            m.add(sum(e[i, j] for j in range(len(x[b]))) == x[a][i])
        for j in range(len(x[b])):
            m.add(sum(e[i, j] for i in range(len(x[a]))) == x[b][j])
    apart = []  # per tied parameter: its readers read it in different layouts
    for k, tie in enumerate(p.tied):
        first = x[tie.cluster]
        d = [m.new_bool_var(f"apart{k}_{s}") for s in range(len(first))]
        for s, v in enumerate(d):
            for c, same in tie.agree:
                m.add(v >= first[s] - sum(x[c][j] for j in same[s]))
            terms.append((round(tie.seconds[s] * NS), v))
        apart.append(d)
    if p.capacity is not None:
        unit = memory_unit(p.capacity)
        cap = int(p.capacity // unit)
        kept = sum(
            round(p.memory[c][s] / unit) * x[c][s] for c in range(len(x)) for s in range(len(x[c]))
        )
        if p.peaks:  # the fullest phase (a layer's backward, the reduction) beside the kept
            w = m.new_int_var(0, cap, "peak")
            for k, pk in enumerate(p.peaks):
                held = sum(
                    round(b / unit) * x[c][s] for c, row in pk.items() for s, b in enumerate(row)
                )
                if k == len(p.peaks) - 1:  # the gradient reduction
                    held += sum(
                        round(b / unit) * v
                        for tie, d in zip(p.tied, apart)
                        for b, v in zip(tie.held, d)
                    )
                m.add(w >= held)
            kept += w
        kept += sum(
            round(b / unit) * v for tie, d in zip(p.tied, apart) for b, v in zip(tie.kept, d)
        )
        m.add(kept <= cap)
    # gradient reductions hide behind the backward compute: z >= hidden - backward, z >= 0
    idx = [(c, s) for c in range(len(x)) for s in range(len(x[c]))]
    hidden = sum(round(p.hidden[c][s] * NS) * x[c][s] for c, s in idx)
    back = sum(round(p.backward[c][s] * NS) * x[c][s] for c, s in idx)
    z = m.new_int_var(0, max(1, round(sum(max(r) for r in p.hidden) * NS)), "exposed_grads")
    m.add(z >= hidden - back)
    m.minimize(sum(w * v for w, v in terms if w) + z)
    solver = cp_model.CpSolver()
    solver.parameters.num_workers = 1
    solver.parameters.random_seed = 0
    solver.parameters.max_deterministic_time = time_limit
    solver.parameters.linearization_level = 2  # the LP relaxation: optimal in seconds
    status = solver.solve(m)
    wall = time.perf_counter() - start
    if status in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        choice = tuple(next(s for s, v in enumerate(row) if solver.value(v)) for row in x)
        secs, mem = objective(p, list(choice))
        return Solution(choice, secs, mem, solver.status_name(status), wall)
    if status == cp_model.INFEASIBLE:
        raise no_fit(p.mesh, p.capacity, p.memory, p.peaks)
    choice = _greedy(p)
    secs, mem = objective(p, list(choice))
    return Solution(choice, secs, mem, "GREEDY", wall)


def _greedy(p: Problem) -> tuple[int, ...]:
    """Each cluster's cheapest strategy; if that exceeds the capacity, each cluster's
    leanest (ties to the cheaper)."""
    fast = tuple(
        min(range(len(row)), key=lambda s, c=c: (row[s] + p.hidden[c][s], s))
        for c, row in enumerate(p.node)
    )
    if p.capacity is None or objective(p, list(fast))[1] <= p.capacity:
        return fast
    peak = [[0.0] * len(row) for row in p.memory]  # each cluster's fullest phase
    for pk in p.peaks:
        for c, row in pk.items():
            peak[c] = [max(u, v) for u, v in zip(peak[c], row)]
    return tuple(
        min(range(len(row)), key=lambda s, c=c: (row[s] + peak[c][s], p.node[c][s], s))
        for c, row in enumerate(p.memory)
    )


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
        f"{len(problem.graph.ops)} ops, {problem.size} strategies, {sol.status} in "
        f"{sol.wall:.1f} s; contractions and lookups:"
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
