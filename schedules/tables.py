"""The paper's schedules written as op_order constraints (nnScaler tables 4 and 7).

Each function states the table's rules for stage ``s`` (0-based; the paper's ``ofst =
|D| - i`` is ``p - 1 - s``) and micro-batch ``i``, and :func:`jscaler.order_schedule`
expands them into a :class:`jscaler.Schedule`. ``table4_1f1b`` pins every pair of a
stage's blocks and reproduces :func:`one_f_one_b` exactly; ``table7_3f1b`` orders
the three passes of consecutive micro-batches and the backward's offset, and leaves the
rest of the timing to the list scheduler (the paper leaves it to its solver).
"""

from __future__ import annotations

from jscaler import Block, Schedule, order_schedule
from schedules.classic import check_args

F, B = Block.F, Block.B


def rules_1f1b(p: int):
    """Table 4's rules for ``p`` stages: forwards in order, backwards in order, ``ofst``
    warm-up forwards before the first backward, then one forward after each backward."""

    def rules(s, i):
        ofst = p - 1 - s
        yield F(s, i), F(s, i + 1)
        yield B(s, i), B(s, i + 1)
        yield F(s, i + ofst), B(s, i)
        yield B(s, i), F(s, i + ofst + 1)

    return rules


def rules_3f1b(p: int):
    """Table 7's rules for ``p`` stages: pass k+1 of micro-batch i after pass k of
    micro-batch i+1, the backward of i after the last forward of ``i + ofst``, and the
    first forward of ``i + ofst + 3`` after that backward."""

    def rules(s, i):
        ofst = p - 1 - s
        for k in range(3):
            yield F(s, i, k), F(s, i + 1, k)
        yield B(s, i), B(s, i + 1)
        yield F(s, i + 1, 0), F(s, i, 1)
        yield F(s, i + 1, 1), F(s, i, 2)
        yield F(s, i + ofst, 2), B(s, i)
        yield B(s, i), F(s, i + ofst + 3, 0)

    return rules


def table4_1f1b(p: int, m: int) -> Schedule:
    """1F1B from table 4 (:func:`rules_1f1b`)."""
    check_args(p, m, "table4_1f1b")
    return order_schedule("table4_1f1b", p, m, rules_1f1b(p))


def table7_3f1b(p: int, m: int) -> Schedule:
    """3F1B from table 7 (:func:`rules_3f1b`)."""
    check_args(p, m, "table7_3f1b")
    return order_schedule("table7_3f1b", p, m, rules_3f1b(p), passes=3)
