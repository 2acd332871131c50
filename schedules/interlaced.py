"""nnScaler's interlaced pipeline (1F1B+): an all-device segment time-shared with 1F1B.

T5's embedding table is too big for one pipeline stage, so it is split by vocabulary over
*every* device while the layers run as a 1F1B pipeline on disjoint groups; the two share
the devices in time. Stage 0 (the embedding) lives on group p, which spans all devices
(``Schedule.whole``); stages 1..p are the pipeline on groups 0..p-1. Following the
artifact's ``1f1b_plus``, micro-batch i's embedding forward runs right before its
first-stage forward and its embedding backward right after its first-stage backward.
"""

from __future__ import annotations

from jscaler import Block, Schedule, one_f_one_b

__all__ = ["interlaced"]


def interlaced(p: int, m: int) -> Schedule:
    """p pipeline groups running 1F1B over stages 1..p, plus the all-device group p
    running the embedding (stage 0) between them."""
    base = one_f_one_b(p, m)
    groups = [[Block(b.stage + 1, b.microbatch, b.kind) for b in g] for g in base.groups]
    embed = []
    for b in base.groups[0]:
        if b.kind == "F":
            embed.append(Block(0, b.microbatch, "F"))
        else:
            embed.append(Block(0, b.microbatch, "B"))
    placement = (p, *range(p))
    return Schedule("interlaced", p + 1, m, [*groups, embed], placement, whole=(p,)).check()
