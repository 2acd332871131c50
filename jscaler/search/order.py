"""op-order search: the fastest block order under a memory bound (CP-SAT scheduling).

Every block a step needs (each stage's F per forward pass, B, and W when the backward is
split) becomes an interval on its stage's device group, with the duration the cost model
gives it. Constraints:

* a group runs one block at a time (``NoOverlap`` per group);
* a block starts after the blocks it reads (:func:`block_deps`: the previous stage's
  forward, the next stage's backward, the previous pass);
* memory: stage s holds a micro-batch's activations from the start of its last forward
  pass to the end of its backward; at most ``memory[s]`` at once (``Cumulative``);
* optional **order constraints** from a space (the paper's tables 4 and 7: ``rules(s, i)``
  yielding ``(a, b)`` block pairs, a before b), which prune the search: 1F1B's rules fix
  every order and leave the solver only timing to do.

The objective is the makespan. CP-SAT runs with one worker, a fixed seed and a
deterministic-time limit (the same schedule on every host). The schedule is the order of
blocks per group by start time, a :class:`Schedule` checked like any other. Tessel
composes a repeating steady-state pattern with warm-up and cool-down; this search plans
the whole horizon of ``microbatches`` at once (fine for the tens of micro-batches of a
step; the pattern is read off the result, not imposed).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from jscaler.errors import ScheduleError
from jscaler.plan.schedule import Block, Schedule, block_deps, required_blocks
from jscaler.plan.timeline import unit_costs

__all__ = ["OrderResult", "search_order"]

SCALE = 100  # durations become integers: cost * SCALE


@dataclass(frozen=True)
class OrderResult:
    schedule: Schedule
    makespan: float  # in the cost's units
    status: str  # OPTIMAL | FEASIBLE
    wall: float  # seconds the solver took
    constraints: int  # order constraints added from the rules


def search_order(
    stages: int,
    microbatches: int,
    *,
    placement: tuple[int, ...] | None = None,
    passes: int = 1,
    split_backward: bool = False,
    cost: Callable[[Block], float] | dict | None = None,
    memory: int | list[int] | None = None,
    rules: Callable[[int, int], Iterable[tuple[Block, Block]]] | None = None,
    time_limit: float = 60.0,
    name: str = "searched",
) -> OrderResult:
    """The block order minimising the makespan (see the module doc).

    Args:
      placement: the group of each stage (default stage s on group s).
      cost: block -> duration, or kind -> duration (default F=1, B=2, or B=W=1 split).
      memory: micro-batches a stage may hold at once (an int for all, or per stage;
        default unbounded).
      rules: order constraints ``rules(stage, microbatch) -> [(a, b), ...]``.
    """
    from ortools.sat.python import cp_model

    placement = tuple(placement) if placement is not None else tuple(range(stages))
    if len(placement) != stages:
        raise ScheduleError(f"placement names {len(placement)} groups for {stages} stages")
    if cost is None:
        cost = unit_costs(split_backward)
    duration = cost if callable(cost) else (lambda b: cost[b.kind])
    blocks = sorted(
        required_blocks(stages, microbatches, passes, split_backward),
        key=lambda b: (b.microbatch, b.pass_, b.kind, b.stage),
    )
    dur = {b: max(1, round(duration(b) * SCALE)) for b in blocks}
    horizon = sum(dur.values())
    m = cp_model.CpModel()
    start = {b: m.new_int_var(0, horizon, f"s_{b}") for b in blocks}
    end = {b: start[b] + dur[b] for b in blocks}
    on_group: dict[int, list] = {}
    for b in blocks:
        iv = m.new_fixed_size_interval_var(start[b], dur[b], f"i_{b}")
        on_group.setdefault(placement[b.stage], []).append(iv)
    for ivs in on_group.values():
        m.add_no_overlap(ivs)
    have = set(blocks)
    for b in blocks:
        for d in block_deps(b, stages, passes):
            if d in have:
                m.add(start[b] >= end[d])
    last = passes - 1
    if memory is not None:
        bound = [memory] * stages if isinstance(memory, int) else list(memory)
        for s in range(stages):
            held = []
            for i in range(microbatches):
                f, bw = Block(s, i, "F", last), Block(s, i, "B")
                size = m.new_int_var(0, horizon, f"hold_{s}_{i}")
                held.append(m.new_interval_var(start[f], size, end[bw], f"h_{s}_{i}"))
            m.add_cumulative(held, [1] * len(held), bound[s])
    added = 0
    for s in range(stages) if rules is not None else ():
        for i in range(microbatches):
            for a, b in rules(s, i):
                if a in have and b in have:
                    if placement[a.stage] != placement[b.stage]:
                        raise ScheduleError(
                            f"order constraint {a} -> {b} spans two device groups; op_order "
                            f"orders blocks on one group"
                        )
                    m.add(start[b] >= end[a])
                    added += 1
    makespan = m.new_int_var(0, horizon, "makespan")
    for b in blocks:
        m.add(makespan >= end[b])
    m.minimize(makespan)
    solver = cp_model.CpSolver()
    solver.parameters.num_workers = 1
    solver.parameters.random_seed = 0
    solver.parameters.max_deterministic_time = time_limit
    t0 = time.perf_counter()
    status = solver.solve(m)
    wall = time.perf_counter() - t0
    if status not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        raise ScheduleError(
            f"no order of {stages} stages x {microbatches} micro-batches meets the "
            f"constraints ({solver.status_name(status)} after {wall:.1f} s): the memory "
            f"bound {memory} or the order rules leave no schedule; loosen them"
        )
    groups: list[list[Block]] = [[] for _ in range(max(placement) + 1)]
    for b in sorted(blocks, key=lambda b: (solver.value(start[b]), b.stage)):
        groups[placement[b.stage]].append(b)
    sched = Schedule(name, stages, microbatches, groups, placement, passes)
    sched.check()
    return OrderResult(
        sched, solver.value(makespan) / SCALE, solver.status_name(status), wall, added
    )
