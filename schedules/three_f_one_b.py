"""3F1B (nnScaler, AlphaFold2): three forward passes per micro-batch, then one backward.

AlphaFold2 recycles: a micro-batch runs the whole model three times, the first two passes
without gradients (their outputs feed the next pass at stage 0), the third with them, then
the backward. nnScaler's table 7 interleaves the passes of consecutive micro-batches in
decreasing order and starts the backward of micro-batch m ``ofst = p - 1 - s`` groups
after its last forward on stage s: in steady state every stage runs, per group,
``F1(g) F2(g-1) F3(g-2) B(g-2-ofst)``, with no bubble and at most p micro-batches holding
activations on stage 0 (1F1B's memory).
"""

from __future__ import annotations

from jscaler import Block, Schedule
from schedules.classic import check_args

PASSES = 3


def three_f_one_b(p: int, m: int) -> Schedule:
    """The 3F1B schedule for ``p`` stages and ``m`` micro-batches (PAPER_NOTES section 5)."""
    check_args(p, m, "three_f_one_b")
    groups = []
    for s in range(p):
        ofst = p - 1 - s
        order = []
        for g in range(m + PASSES - 1 + ofst + 1):
            for k in range(PASSES):
                if 0 <= g - k < m:
                    order.append(Block(s, g - k, "F", k))
            b = g - (PASSES - 1) - ofst
            if 0 <= b < m:
                order.append(Block(s, b, "B"))
        groups.append(order)
    return Schedule("three_f_one_b", p, m, groups, tuple(range(p)), passes=PASSES).check()
