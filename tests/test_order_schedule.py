"""Schedules written as op_order constraints (the paper's tables 4 and 7), expanded."""

import pytest

import jscaler
from jscaler import Block, ScheduleError, order_schedule, simulate
from schedules import one_f_one_b, table4_1f1b, table7_3f1b, three_f_one_b

F, B = Block.F, Block.B


@pytest.mark.parametrize("p, m", [(1, 3), (2, 2), (3, 7), (4, 4), (4, 8)])
def test_table4_constraints_expand_to_one_f_one_b(p, m):
    assert table4_1f1b(p, m).groups == one_f_one_b(p, m).groups


@pytest.mark.parametrize("p, m", [(2, 4), (3, 5), (4, 8)])
def test_table7_constraints_give_a_3f1b_as_good_as_the_hand_written_one(p, m):
    sched = table7_3f1b(p, m)
    hand = three_f_one_b(p, m)
    assert sched.passes == 3
    assert sched.in_flight() == hand.in_flight() == [p - s for s in range(p)]
    assert simulate(sched).makespan == simulate(hand).makespan
    # the table's rules hold in the expanded order
    for s, group in enumerate(sched.groups):
        pos = {b: k for k, b in enumerate(group)}
        ofst = p - 1 - s
        for i in range(m - 1):
            assert pos[F(s, i + 1, 0)] < pos[F(s, i, 1)]
            assert pos[F(s, i + 1, 1)] < pos[F(s, i, 2)]
        for i in range(m - ofst):
            assert pos[F(s, i + ofst, 2)] < pos[B(s, i)]


def test_a_custom_schedule_from_a_few_rules():
    # GPipe as constraints: backwards in order, every forward before the first of them
    def rules(s, i):
        yield F(s, i), B(s, 0)
        yield B(s, i), B(s, i + 1)

    sched = order_schedule("my_gpipe", 2, 4, rules)
    assert sched.in_flight() == [4, 4]
    assert [b.kind for b in sched.groups[0]] == ["F"] * 4 + ["B"] * 4


def test_contradicting_constraints_name_the_cycle():
    def rules(s, i):
        yield F(s, 1), F(s, 0)
        yield B(s, 0), F(s, 1)  # B0 needs F0, which waits for F1, which waits for B0

    with pytest.raises(ScheduleError, match=r"contradict.*F0\.1 -> F0\.0 \(order\)"):
        order_schedule("bad", 2, 2, rules)


def test_constraints_must_stay_on_one_group_and_name_real_blocks():
    with pytest.raises(ScheduleError, match="groups 0 and 1"):
        order_schedule("x", 2, 2, [(F(0, 0), F(1, 1))])
    with pytest.raises(ScheduleError, match="does not have"):
        order_schedule("x", 2, 2, [(F(0, 0), F(3, 1))])
    with pytest.raises(ScheduleError, match=r"\(a, b\) pairs"):
        order_schedule("x", 2, 2, [F(0, 0)])


def test_table_schedules_are_named_on_the_command_line():
    import schedules

    assert schedules.SCHEDULES["table7_3f1b"] is table7_3f1b
    assert "order_schedule" in jscaler.__all__
