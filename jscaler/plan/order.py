"""Schedules from op_order constraints between blocks: the paper's tables as code.

nnScaler writes a pipeline schedule as order constraints between stage sub-graphs on a
device (its tables 4 and 7): ``order(fG_i,m -> fG_i,n)`` for m < n, ``order(fG_i,m+ofst
-> bG_i,m)``, ... :func:`order_schedule` takes the same rules as a function of stage and
micro-batch yielding ``(a, b)`` pairs of :class:`Block` ("a runs before b on their
group") and expands them into a :class:`Schedule`:

1. the rules are instantiated for every stage and micro-batch (pairs naming a
   micro-batch outside 0..m-1 fall away, as the tables' ranges do);
2. constraints and data dependencies together must be acyclic (a cycle is reported
   block by block);
3. a list scheduler plays the groups in time (unit costs as :func:`simulate`): whenever
   a group is free it runs, of the blocks whose data and order predecessors are done,
   the one first in ``priority`` (oldest micro-batch first by default). Constraints that
   order every pair of a group's blocks (table 4) pin the order; looser ones (table 7)
   leave the timing to the scheduler, as the paper leaves it to its solver.

The result is :meth:`Schedule.check`-ed like any hand-written schedule.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from jscaler.errors import ScheduleError
from jscaler.plan.cycles import find_cycle
from jscaler.plan.schedule import Block, Schedule, block_deps, required_blocks
from jscaler.plan.timeline import occupies, unit_costs

__all__ = ["order_schedule"]

KIND_RANK = {"F": 0, "R": 1, "B": 2, "W": 3}


def oldest_first(b: Block) -> tuple:
    """Default priority: lower micro-batch, then later pass, then forward before
    backward (so a ready backward of an older micro-batch goes first)."""
    return (b.microbatch, -b.pass_, KIND_RANK[b.kind], b.stage)


def order_schedule(
    name: str,
    stages: int,
    microbatches: int,
    rules: Callable[[int, int], Iterable[tuple[Block, Block]]] | Iterable[tuple[Block, Block]],
    *,
    placement: tuple[int, ...] | None = None,
    passes: int = 1,
    split_backward: bool = False,
    whole: tuple[int, ...] = (),
    priority: Callable[[Block], tuple] = oldest_first,
) -> Schedule:
    """Expands order constraints into a :class:`Schedule` (see the module doc).

    Args:
      name: the schedule's name.
      stages, microbatches, passes, split_backward, whole: as :class:`Schedule`.
      rules: ``rules(stage, microbatch)`` yielding ``(a, b)`` pairs (or one iterable of
        pairs): ``a`` runs before ``b``; both must be on the same device group.
      placement: group of each stage (default: stage s on group s).
      priority: key choosing among a free group's runnable blocks (lowest first).

    Raises:
      ScheduleError: a constraint names blocks of different groups or a block the step
        does not have; the constraints and data dependencies form a cycle.
    """
    placement = tuple(range(stages)) if placement is None else tuple(placement)
    n_groups = max(placement) + 1 if placement else 0
    blocks = required_blocks(stages, microbatches, passes, split_backward)
    before = _constraints(name, rules, stages, microbatches, blocks, placement)
    preds = {b: set(block_deps(b, stages, passes)) | before.get(b, set()) for b in blocks}
    _acyclic(name, preds, before)

    cost = unit_costs(split_backward)
    todo = [
        sorted((b for b in blocks if placement[b.stage] == g), key=priority)
        for g in range(n_groups)
    ]
    end: dict[Block, float] = {}
    free = [0.0] * n_groups
    groups: list[list[Block]] = [[] for _ in range(n_groups)]
    t = 0.0
    while any(todo):
        progressed = False
        for g in range(n_groups):
            waits, holds = occupies(g, n_groups, whole)
            if any(free[k] > t for k in waits):
                continue
            ready = next(
                (b for b in todo[g] if all(end.get(p, t + 1) <= t for p in preds[b])), None
            )
            if ready is None:
                continue
            todo[g].remove(ready)
            groups[g].append(ready)
            end[ready] = t + cost[ready.kind]
            for k in holds:
                free[k] = end[ready]
            progressed = True
        if not progressed:
            later = [e for e in (*free, *end.values()) if e > t]
            if not later:  # cannot happen for acyclic constraints; kept as a guard
                raise ScheduleError(f"order_schedule {name!r}: no block can run at time {t}")
            t = min(later)
    return Schedule(
        name, stages, microbatches, groups, placement, passes=passes, whole=whole
    ).check()


def _constraints(name, rules, stages, microbatches, blocks, placement) -> dict:
    if callable(rules):
        pairs = [pair for s in range(stages) for i in range(microbatches) for pair in rules(s, i)]
    else:
        pairs = list(rules)
    before: dict[Block, set[Block]] = {}
    for pair in pairs:
        if not (isinstance(pair, tuple) and len(pair) == 2):
            raise ScheduleError(
                f"order_schedule {name!r}: a rule gave {pair!r}; rules yield (a, b) pairs of "
                f"Block meaning a runs before b"
            )
        a, b = pair
        if any(x.microbatch >= microbatches for x in (a, b)):
            continue  # outside the table's range of micro-batches
        for x in (a, b):
            if x not in blocks:
                raise ScheduleError(
                    f"order_schedule {name!r}: constraint {a} -> {b} names {x}, which this "
                    f"step does not have ({stages} stages, micro-batches 0..{microbatches - 1})"
                )
        if placement[a.stage] != placement[b.stage]:
            raise ScheduleError(
                f"order_schedule {name!r}: constraint {a} -> {b} orders blocks of groups "
                f"{placement[a.stage]} and {placement[b.stage]}; op_order orders blocks "
                f"that share a device group"
            )
        before.setdefault(b, set()).add(a)
    return before


def _acyclic(name, preds, before) -> None:
    """Raises naming a cycle of constraints and data dependencies, if there is one."""
    succ: dict[Block, set[Block]] = {b: set() for b in preds}
    for b, ps in preds.items():
        for p in ps:
            succ[p].add(b)
    cycle = find_cycle(succ, key=lambda b: b)
    if cycle is None:
        return
    steps = [
        f"{a} -> {b}" + (" (order)" if a in before.get(b, ()) else " (data)")
        for a, b in zip(cycle, cycle[1:])
    ]
    raise ScheduleError(
        f"order_schedule {name!r}: the order constraints contradict each other or the data "
        f"flow: {'; '.join(steps)}"
    )
