"""nnScaler's interlaced pipeline (1F1B+): an all-device segment time-shared with 1F1B.

T5's embedding table is too big for one pipeline stage, so it is split by vocabulary over
*every* device while the layers run as a 1F1B pipeline on disjoint groups; the two share
the devices in time. Stage 0 (the embedding) lives on group p, which spans all devices
(``Schedule.whole``); stages 1..p are the pipeline on groups 0..p-1. Following the
artifact's ``1f1b_plus``, micro-batch i's embedding forward runs right before its
first-stage forward and its embedding backward right after its first-stage backward.

``interlaced_head`` adds the tied LM head (with the loss) as a last stage p+1 on the same
all-device group: micro-batch i's head forward and backward run right after its last
pipeline stage's forward, before that stage's backward (in 1F1B the last stage turns a
forward straight into its backward, so the head sits in between).
"""

from __future__ import annotations

from jscaler import Block, Schedule, one_f_one_b, simulate

__all__ = ["interlaced", "interlaced_head"]


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


def interlaced_head(p: int, m: int) -> Schedule:
    """The interlaced pipeline with the LM head on every device too: stage 0 (embedding)
    and stage p+1 (head and loss) on the all-device group p, stages 1..p on groups
    0..p-1 running 1F1B."""
    base = one_f_one_b(p, m)
    spans = simulate(base).spans  # when each pipeline block runs, to slot the whole group in
    groups = [[Block(b.stage + 1, b.microbatch, b.kind) for b in g] for g in base.groups]
    slots = []
    for i in range(m):
        first_f, first_b = spans[Block(0, i, "F")], spans[Block(0, i, "B")]
        last_f = spans[Block(p - 1, i, "F")]
        slots.append((first_f[0], 0, Block(0, i, "F")))
        slots.append((last_f[1], 1, Block(p + 1, i, "F")))
        slots.append((last_f[1], 2, Block(p + 1, i, "B")))
        slots.append((first_b[1], 3, Block(0, i, "B")))
    whole = [b for *_, b in sorted(slots, key=lambda x: (x[0], x[1], x[2].microbatch))]
    placement = (p, *range(p), p)
    return Schedule("interlaced_head", p + 2, m, [*groups, whole], placement, whole=(p,)).check()
