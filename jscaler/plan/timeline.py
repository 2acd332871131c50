"""Playing a schedule in time: when each block runs, the bubble, activations in flight.

Each group runs its blocks in its order; a block starts when its group is free and the
blocks it needs have finished. With unit costs (F = 1, B = 2, or B = W = 1 when the
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
        return sum(e - s for b, (s, e) in self.spans.items() if self._group(b) == group)

    def bubble(self) -> float:
        """The fraction of group-time spent idle."""
        n = len(self.schedule.groups)
        return 1 - sum(self.busy(g) for g in range(n)) / (n * self.makespan)

    def in_flight(self) -> list[int]:
        """Per stage, the most micro-batches whose activations are held at once
        (:meth:`Schedule.in_flight`)."""
        return self.schedule.in_flight()

    def _group(self, b: Block) -> int:
        return self.schedule.placement[b.stage]


def simulate(schedule: Schedule, cost=None) -> Timeline:
    """Times every block of a checked schedule (``cost``: kind -> duration)."""
    if cost is None:
        cost = dict(UNIT, B=1.0) if schedule.split_backward else UNIT
    free = [0.0] * len(schedule.groups)
    spans: dict[Block, tuple[float, float]] = {}
    for rnd in schedule.order():
        for b in rnd:
            g = schedule.placement[b.stage]
            start = max([free[g], *(spans[d][1] for d in schedule.deps(b))])
            spans[b] = (start, start + cost[b.kind])
            free[g] = start + cost[b.kind]
    return Timeline(schedule, spans)
