"""Pipeline schedules as data: per device group, the blocks it runs, in order.

A block is one stage's work on one micro-batch: ``F`` (forward; ``pass`` numbers the
forward passes of a micro-batch when there are several, as AlphaFold2's recycling), ``B``
(backward; only the input gradient when the schedule splits the backward), ``W`` (the
weight gradient of a split backward) or ``R`` (recompute the forward before ``B``). A
:class:`Schedule` lists, for each device group, its blocks in the order it runs them, and
which group holds each stage. It is frozen, round-trips through JSON, and is what the
pipeline runtime executes (and what op_order constraints between stages compile to).

:meth:`Schedule.check` proves a schedule can run: every block exactly once, on the group
holding its stage; then it plays the groups' queues against the data dependencies (a
block runs when the blocks it needs have run) and names the blocked blocks if the groups
deadlock. Dependencies, for stage s of S and micro-batch m:

* ``F(s, m, k)`` after ``F(s-1, m, k)``; ``F(0, m, k)`` after ``F(S-1, m, k-1)`` (the
  next pass reads the previous pass's output);
* ``R(s, m)`` after ``F(s, m, last)``; ``B(s, m)`` after ``F(s, m, last)`` (and ``R(s, m)``
  if recomputed) and after ``B(s+1, m)``;
* ``W(s, m)`` after ``B(s, m)``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from functools import cached_property

from jscaler.errors import ScheduleError

__all__ = ["Block", "Schedule", "one_f_one_b"]

KINDS = ("F", "B", "W", "R")
SCHEDULE_FORMAT = 1


@dataclass(frozen=True, order=True)
class Block:
    """One stage's ``kind`` of work on one micro-batch (``pass_``: which forward pass)."""

    stage: int
    microbatch: int
    kind: str
    pass_: int = 0

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ScheduleError(f"block kind {self.kind!r} is not one of {list(KINDS)}")
        for name in ("stage", "microbatch", "pass_"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise ScheduleError(f"block {name} must be an int >= 0, got {v!r}")

    def __str__(self):
        p = f"/{self.pass_}" if self.pass_ else ""
        return f"{self.kind}{self.stage}.{self.microbatch}{p}"

    def to_json(self):
        return [self.stage, self.microbatch, self.kind, self.pass_]

    # shorthands for writing order constraints: Block.F(s, m), Block.B(s, m), ...
    @classmethod
    def F(cls, stage: int, microbatch: int, pass_: int = 0) -> Block:  # noqa: N802
        return cls(stage, microbatch, "F", pass_)

    @classmethod
    def B(cls, stage: int, microbatch: int) -> Block:  # noqa: N802
        return cls(stage, microbatch, "B")

    @classmethod
    def W(cls, stage: int, microbatch: int) -> Block:  # noqa: N802
        return cls(stage, microbatch, "W")


@dataclass(frozen=True)
class Schedule:
    """Per device group, its blocks in run order; ``placement[s]``: the group of stage s.

    Args:
      stages: number of stages (virtual stages included: interleaved 1F1B has
        groups x chunks of them).
      microbatches: micro-batches per step.
      passes: forward passes per micro-batch (3 for AlphaFold2's 3F1B); only the last
        keeps activations for the backward.
      whole: groups whose devices are every device (the interlaced schedule's
        all-device embedding): their blocks time-share the devices with every other group.
    """

    name: str
    stages: int
    microbatches: int
    groups: tuple[tuple[Block, ...], ...]
    placement: tuple[int, ...]
    passes: int = 1
    whole: tuple[int, ...] = ()
    meta: dict = field(default_factory=dict, compare=False, hash=False)

    def __post_init__(self):
        object.__setattr__(self, "groups", tuple(tuple(g) for g in self.groups))
        object.__setattr__(self, "placement", tuple(self.placement))
        if len(self.placement) != self.stages:
            raise ScheduleError(
                f"schedule {self.name!r}: placement names a group for {len(self.placement)} "
                f"stages; the schedule has {self.stages}"
            )
        object.__setattr__(self, "whole", tuple(self.whole))
        bad = [g for g in (*self.placement, *self.whole) if not 0 <= g < len(self.groups)]
        if bad:
            raise ScheduleError(
                f"schedule {self.name!r}: stage placed on group {bad[0]}, but there are "
                f"{len(self.groups)} device groups (0..{len(self.groups) - 1})"
            )

    # ---- what a schedule must contain ---------------------------------------------------

    @cached_property
    def split_backward(self) -> bool:
        return any(b.kind == "W" for g in self.groups for b in g)

    def required(self) -> set[Block]:
        """Every block a step needs (recompute blocks are optional, at most once)."""
        return required_blocks(self.stages, self.microbatches, self.passes, self.split_backward)

    def deps(self, b: Block) -> list[Block]:
        """The blocks ``b`` reads the results of (see the module doc)."""
        return block_deps(b, self.stages, self.passes, self.recomputed(b.stage, b.microbatch))

    def in_flight(self, release: str = "B") -> list[int]:
        """Per stage, the most micro-batches whose activations are held at once: from the
        last forward pass (or R, when recomputed) to the ``release`` block (B: the
        activations the backward consumes, as the schedules' memory bounds count them;
        W: until the weight gradient, as the runtime holds a split backward's residuals).
        GPipe holds m, 1F1B and ZB-H1 at most p - s."""
        if release not in ("B", "W"):
            raise ScheduleError(f"release must be 'B' or 'W', got {release!r}")
        last = self.passes - 1
        frees = "W" if release == "W" and self.split_backward else "B"
        held, peak = [0] * self.stages, [0] * self.stages
        for group in self.groups:
            for b in group:
                keeps = b.kind == "R" or (
                    b.kind == "F" and b.pass_ == last and not self.recomputed(b.stage, b.microbatch)
                )
                if keeps:
                    held[b.stage] += 1
                    peak[b.stage] = max(peak[b.stage], held[b.stage])
                elif b.kind == frees:
                    held[b.stage] -= 1
        return peak

    def recomputed(self, stage: int, microbatch: int) -> bool:
        return (stage, microbatch) in self._recomputed

    @cached_property
    def _recomputed(self) -> frozenset[tuple[int, int]]:
        return frozenset((b.stage, b.microbatch) for g in self.groups for b in g if b.kind == "R")

    # ---- checking ---------------------------------------------------------------------

    def check(self) -> Schedule:
        """Raises :class:`ScheduleError` unless every group can run its list to the end."""
        seen: dict[Block, int] = {}
        for gi, group in enumerate(self.groups):
            for b in group:
                if b in seen:
                    raise ScheduleError(
                        f"schedule {self.name!r}: block {b} appears twice (groups {seen[b]} "
                        f"and {gi}); every block runs exactly once"
                    )
                seen[b] = gi
                if b.stage >= self.stages or b.microbatch >= self.microbatches:
                    raise ScheduleError(
                        f"schedule {self.name!r}: block {b} names stage {b.stage} / "
                        f"micro-batch {b.microbatch}; the schedule has {self.stages} stages "
                        f"and {self.microbatches} micro-batches"
                    )
                if self.placement[b.stage] != gi:
                    raise ScheduleError(
                        f"schedule {self.name!r}: block {b} is listed for group {gi}, but "
                        f"stage {b.stage} lives on group {self.placement[b.stage]}"
                    )
        missing = sorted(self.required() - set(seen))
        if missing:
            shown = ", ".join(map(str, missing[:8])) + (", ..." if len(missing) > 8 else "")
            raise ScheduleError(
                f"schedule {self.name!r} is missing {len(missing)} block(s): {shown}; "
                f"each stage needs F (x{self.passes}), B"
                f"{' and W' if self.split_backward else ''} for every micro-batch"
            )
        extra = sorted(b for b in seen if b.kind == "F" and b.pass_ >= self.passes)
        if extra:
            raise ScheduleError(
                f"schedule {self.name!r}: block {extra[0]} is forward pass {extra[0].pass_}, "
                f"but micro-batches take {self.passes} pass(es)"
            )
        self.order()
        return self

    def order(self) -> tuple[tuple[Block, ...], ...]:
        """Plays the groups' queues in rounds (each group runs its next block once the
        blocks it needs ran in an earlier round); returns the blocks run in each round
        (played once per schedule: checking and every simulation ask).

        Raises:
          ScheduleError: the groups deadlock; names each blocked group's next block and
            the blocks it waits for.
        """
        return self._rounds

    @cached_property
    def _rounds(self) -> tuple[tuple[Block, ...], ...]:
        heads = [0] * len(self.groups)
        done: set[Block] = set()
        rounds = []
        total = sum(len(g) for g in self.groups)
        while len(done) < total:
            ran = []
            for gi, group in enumerate(self.groups):
                if heads[gi] < len(group):
                    b = group[heads[gi]]
                    if all(d in done for d in self.deps(b)):
                        ran.append(b)
            if not ran:
                lines = []
                for gi, group in enumerate(self.groups):
                    if heads[gi] < len(group):
                        b = group[heads[gi]]
                        waits = [str(d) for d in self.deps(b) if d not in done]
                        lines.append(f"group {gi} waits at {b} for {', '.join(waits)}")
                raise ScheduleError(
                    f"schedule {self.name!r} deadlocks after {len(done)} of {total} blocks: "
                    + "; ".join(lines)
                )
            for b in ran:
                heads[self.placement[b.stage]] += 1
            done.update(ran)
            rounds.append(tuple(ran))
        return tuple(rounds)

    # ---- JSON -------------------------------------------------------------------------

    def to_json(self) -> str:
        return json.dumps(
            {
                "format": SCHEDULE_FORMAT,
                "name": self.name,
                "stages": self.stages,
                "microbatches": self.microbatches,
                "passes": self.passes,
                "placement": list(self.placement),
                "whole": list(self.whole),
                "groups": [[b.to_json() for b in g] for g in self.groups],
            }
        )

    @classmethod
    def from_json(cls, text: str) -> Schedule:
        d = json.loads(text)
        if d.get("format") != SCHEDULE_FORMAT:
            raise ScheduleError(f"schedule format {d.get('format')!r} is not {SCHEDULE_FORMAT}")
        groups = tuple(tuple(Block(s, m, k, p) for s, m, k, p in g) for g in d["groups"])
        return cls(
            d["name"],
            d["stages"],
            d["microbatches"],
            groups,
            tuple(d["placement"]),
            d["passes"],
            tuple(d.get("whole", ())),
        )

    def __str__(self):
        lines = [f"{self.name}: {self.stages} stages, {self.microbatches} micro-batches"]
        for gi, g in enumerate(self.groups):
            lines.append(f"  group {gi}: " + " ".join(map(str, g)))
        return "\n".join(lines)


def required_blocks(stages: int, microbatches: int, passes: int, split: bool) -> set[Block]:
    """Every F (each pass), B and (``split``) W block of a step."""
    out = set()
    for s in range(stages):
        for m in range(microbatches):
            out |= {Block(s, m, "F", k) for k in range(passes)}
            out.add(Block(s, m, "B"))
            if split:
                out.add(Block(s, m, "W"))
    return out


def block_deps(b: Block, stages: int, passes: int, recomputed: bool = False) -> list[Block]:
    """The blocks ``b`` reads the results of (see the module doc); ``recomputed``: its
    micro-batch's activations on its stage come from an R block."""
    last = passes - 1
    s, m = b.stage, b.microbatch
    if b.kind == "F":
        if s > 0:
            return [Block(s - 1, m, "F", b.pass_)]
        return [Block(stages - 1, m, "F", b.pass_ - 1)] if b.pass_ else []
    if b.kind == "R":
        return [Block(s, m, "F", last)]
    if b.kind == "W":
        return [Block(s, m, "B")]
    out = [Block(s, m, "F", last)]
    if recomputed:
        out.append(Block(s, m, "R"))
    if s + 1 < stages:
        out.append(Block(s + 1, m, "B"))
    return out


def one_f_one_b(p: int, m: int) -> Schedule:
    """1F1B (PipeDream-Flush): stage s runs p-s-1 warm-up forwards, then alternates one
    forward and one backward, then drains the backwards. Holds at most p - s micro-batches'
    activations on stage s (GPipe: m), with GPipe's bubble."""
    for what, v in (("stages", p), ("microbatches", m)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ScheduleError(f"one_f_one_b: {what} must be a positive int, got {v!r}")
    groups = []
    for s in range(p):
        warm = min(p - s - 1, m)
        order = [Block(s, i, "F") for i in range(warm)]
        f, b = warm, 0
        while f < m:
            order += [Block(s, f, "F"), Block(s, b, "B")]
            f, b = f + 1, b + 1
        order += [Block(s, i, "B") for i in range(b, m)]
        groups.append(order)
    return Schedule("one_f_one_b", p, m, groups, tuple(range(p))).check()
