"""The classic pipeline schedules, each a plain function returning a Schedule.

``one_f_one_b`` is jscaler's own (``jscaler.one_f_one_b``, the default schedule of a
pipeline plan), re-exported here with the others.

``p`` device groups (pipeline stages), ``m`` micro-batches. Each group's list is the order
its blocks run in; :meth:`Schedule.check` proves the order runs without deadlock.
"""

from __future__ import annotations

from jscaler import Block, Schedule, ScheduleError, one_f_one_b

__all__ = ["gpipe", "interleaved_1f1b", "one_f_one_b", "zero_bubble"]


def check_args(p: int, m: int, name: str) -> None:
    """A schedule's stage and micro-batch counts: positive ints, or a ScheduleError."""
    for what, v in (("stages", p), ("microbatches", m)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ScheduleError(f"{name}: {what} must be a positive int, got {v!r}")


def gpipe(p: int, m: int) -> Schedule:
    """GPipe: every stage runs all m forwards, then all m backwards. Holds m micro-batches'
    activations per stage."""
    check_args(p, m, "gpipe")
    groups = [
        [Block(s, i, "F") for i in range(m)] + [Block(s, i, "B") for i in range(m)]
        for s in range(p)
    ]
    return Schedule("gpipe", p, m, groups, tuple(range(p))).check()


def interleaved_1f1b(p: int, m: int, chunks: int = 2) -> Schedule:
    """Megatron's interleaved 1F1B: each group holds ``chunks`` virtual stages (stage s on
    group s mod p), micro-batches run in rounds of p, and the bubble shrinks by the number
    of chunks. Needs m divisible by p."""
    check_args(p, m, "interleaved_1f1b")
    if isinstance(chunks, bool) or not isinstance(chunks, int) or chunks < 1:
        raise ScheduleError(f"interleaved_1f1b: chunks must be a positive int, got {chunks!r}")
    if m % p:
        raise ScheduleError(
            f"interleaved_1f1b: {m} micro-batches do not form rounds of {p} (one per group); "
            f"use a multiple of {p}"
        )
    total = m * chunks

    def unit(k: int, backward: bool):
        chunk = (k // p) % chunks
        if backward:
            chunk = chunks - 1 - chunk
        mb = (k // (p * chunks)) * p + k % p
        return chunk, mb

    groups = []
    for g in range(p):
        warm = min((p - g - 1) * 2 + (chunks - 1) * p, total)
        fwd = [unit(k, False) for k in range(total)]
        bwd = [unit(k, True) for k in range(total)]
        order = [Block(c * p + g, mb, "F") for c, mb in fwd[:warm]]
        f, b = warm, 0
        while f < total:
            c, mb = fwd[f]
            order.append(Block(c * p + g, mb, "F"))
            c, mb = bwd[b]
            order.append(Block(c * p + g, mb, "B"))
            f, b = f + 1, b + 1
        order += [Block(c * p + g, mb, "B") for c, mb in bwd[b:]]
        groups.append(order)
    placement = tuple(s % p for s in range(p * chunks))
    return Schedule(f"interleaved_1f1b(chunks={chunks})", p * chunks, m, groups, placement).check()


def zero_bubble(p: int, m: int) -> Schedule:
    """ZB-H1 (zero-bubble pipeline, Qi et al. 2024): the backward is split into B (input
    gradient, on the critical path) and W (weight gradient, free to wait); each stage runs
    1F1B's forwards and B's and puts its W's where it would otherwise idle, keeping 1F1B's
    activation memory (at most p - s micro-batches on stage s). Built by playing the
    stages in unit time: a free stage runs a ready B, else a ready F while under the
    memory cap, else its oldest pending W."""
    check_args(p, m, "zero_bubble")
    cost = {"F": 1, "B": 1, "W": 1}
    order = [[] for _ in range(p)]
    end: dict[Block, int] = {}
    free = [0] * p
    nf, nb, nw = [0] * p, [0] * p, [0] * p
    while any(nw[s] < m for s in range(p)):
        t = min(free[s] for s in range(p) if nw[s] < m)
        progressed = False
        for s in range(p):
            if free[s] > t or nw[s] >= m:
                continue
            choice = None
            b = Block(s, nb[s], "B")
            need_b = [Block(s, nb[s], "F")] + ([Block(s + 1, nb[s], "B")] if s + 1 < p else [])
            f = Block(s, nf[s], "F")
            need_f = [Block(s - 1, nf[s], "F")] if s else []
            if nb[s] < nf[s] and all(end.get(d, t + 1) <= t for d in need_b):
                choice = b
                nb[s] += 1
            elif (
                nf[s] < m and nf[s] - nb[s] < p - s and all(end.get(d, t + 1) <= t for d in need_f)
            ):
                choice = f
                nf[s] += 1
            elif nw[s] < nb[s]:
                choice = Block(s, nw[s], "W")
                nw[s] += 1
            if choice is None:
                continue
            order[s].append(choice)
            end[choice] = t + cost[choice.kind]
            free[s] = end[choice]
            progressed = True
        if not progressed:
            for s in range(p):
                if free[s] <= t:
                    free[s] = t + 1
    return Schedule("zero_bubble", p, m, order, tuple(range(p))).check()
