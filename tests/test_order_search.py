"""The op-order search: CP-SAT over pipeline blocks under a memory bound."""

import pytest

import jscaler
from jscaler.search import search_order
from schedules.classic import one_f_one_b
from schedules.tables import rules_1f1b, rules_3f1b
from schedules.three_f_one_b import three_f_one_b


@pytest.mark.parametrize("p, m", [(2, 4), (3, 6), (4, 5)])
def test_under_1f1b_memory_the_search_matches_1f1b(p, m):
    bound = [p - s for s in range(p)]
    free = search_order(p, m, memory=bound)
    assert free.status == "OPTIMAL"
    assert free.makespan == jscaler.simulate(one_f_one_b(p, m)).makespan
    assert all(h <= b for h, b in zip(free.schedule.in_flight(), bound))
    pinned = search_order(p, m, memory=bound, rules=rules_1f1b(p))
    assert pinned.schedule.groups == one_f_one_b(p, m).groups  # table 4 fixes the order
    assert pinned.constraints > 0


def test_tighter_memory_costs_time_and_costs_are_per_block():
    loose = search_order(3, 6)  # GPipe's memory: every micro-batch in flight
    tight = search_order(3, 6, memory=1)
    assert max(tight.schedule.in_flight()) == 1 and tight.makespan > loose.makespan
    slow_last = search_order(3, 6, cost=lambda b: (3.0 if b.stage == 2 else 1.0) * (
        2 if b.kind == "B" else 1))  # fmt: skip
    assert slow_last.makespan >= 6 * 9  # the slow stage's work bounds the step
    with pytest.raises(jscaler.ScheduleError, match="meets the constraints"):
        search_order(2, 3, memory=0)


def test_3f1b_rules_reproduce_3f1b_and_the_free_search_is_no_worse():
    p, m = 4, 6
    bound = [p - s for s in range(p)]
    ref = jscaler.simulate(three_f_one_b(p, m)).makespan
    ruled = search_order(p, m, passes=3, memory=bound, rules=rules_3f1b(p))
    free = search_order(p, m, passes=3, memory=bound)
    assert ruled.makespan == ref and ruled.schedule.passes == 3
    assert free.makespan <= ref
    assert search_order(p, m, passes=3, memory=bound).schedule == free.schedule  # deterministic


def test_a_searched_3f1b_order_trains_a_recycling_model_like_one_device():
    from spaces import alphafold_3f1b

    from parity import assert_parity

    found = search_order(2, 2, passes=3, memory=[2, 1], name="searched_3f1b")
    trainer = assert_parity(
        "recycler-tiny", alphafold_3f1b(pp=2), microbatches=2, schedule=found.schedule
    )
    assert trainer.program.schedule.name == "searched_3f1b"
