"""Playing a schedule in time: when each block runs, the bubble, activations in flight.

Each group runs its blocks in its order; a block starts when its group is free and the
blocks it needs have finished. A block of an all-device group (``Schedule.whole``) waits
for every device and occupies them all. With unit costs (F = 1, B = 2, or B = W = 1 when the
backward is split, R = 1) GPipe and 1F1B idle a fraction (p-1)/(m+p-1) of the time.
"""

from __future__ import annotations

from dataclasses import dataclass

from jscaler.plan.schedule import Block, Schedule

__all__ = ["Timeline", "simulate"]

UNIT = {"F": 1.0, "B": 2.0, "W": 1.0, "R": 1.0}


@dataclass(frozen=True)
class Timeline:
    """Start and end time of every block, per group; and what they imply."""

    schedule: Schedule
    spans: dict  # Block -> (start, end)

    @property
    def makespan(self) -> float:
        return max(end for _, end in self.spans.values())

    def busy(self, group: int) -> float:
        """Time the group's devices compute (an all-device group's blocks included)."""
        whole = self.schedule.whole
        return sum(
            e - s
            for b, (s, e) in self.spans.items()
            if self._group(b) == group or (self._group(b) in whole and group not in whole)
        )

    def bubble(self) -> float:
        """The fraction of device-time spent idle (over the groups that partition the
        devices; an all-device group's blocks keep all of them busy)."""
        sched = self.schedule
        groups = [g for g in range(len(sched.groups)) if g not in sched.whole]
        return 1 - sum(self.busy(g) for g in groups) / (len(groups) * self.makespan)

    def in_flight(self) -> list[int]:
        """Per stage, the most micro-batches whose activations are held at once
        (:meth:`Schedule.in_flight`)."""
        return self.schedule.in_flight()

    def _group(self, b: Block) -> int:
        return self.schedule.placement[b.stage]


def occupies(group: int, n_groups: int, whole) -> tuple[list[int], list[int]]:
    """The groups a block of ``group`` waits to be free, and those it then keeps busy: an
    all-device group (in ``whole``) waits for every device and holds them all; any other
    group waits for itself and the all-device groups, and holds itself."""
    if group in whole:
        return list(range(n_groups)), list(range(n_groups))
    return [group, *whole], [group]


def unit_costs(split_backward: bool) -> dict[str, float]:
    """Duration per block kind: F = 1, B = 2 (B = W = 1 when the backward is split), R = 1."""
    return dict(UNIT, B=1.0) if split_backward else UNIT


def simulate(schedule: Schedule, cost=None) -> Timeline:
    """Times every block of a checked schedule (``cost``: kind -> duration, or a
    function ``block -> duration``, e.g. per stage from the cost model)."""
    if cost is None:
        cost = unit_costs(schedule.split_backward)
    duration = cost if callable(cost) else (lambda b: cost[b.kind])
    free = [0.0] * len(schedule.groups)
    spans: dict[Block, tuple[float, float]] = {}
    for rnd in schedule.order():
        for b in rnd:
            waits, holds = occupies(schedule.placement[b.stage], len(free), schedule.whole)
            start = max([*(free[k] for k in waits), *(spans[d][1] for d in schedule.deps(b))])
            spans[b] = (start, start + duration(b))
            for k in holds:
                free[k] = spans[b][1]
    return Timeline(schedule, spans)
