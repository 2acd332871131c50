"""Pipeline schedules as data: the classic ones, their timelines, and bad schedules.

Timelines use unit costs (F = 1, B = 2; B = W = 1 when the backward is split), under which
GPipe and 1F1B idle (p-1)/(m+p-1) of the time.
"""

import pytest

import jscaler
from jscaler import Block, Schedule, ScheduleError
from schedules import gpipe, interleaved_1f1b, one_f_one_b, three_f_one_b, zero_bubble

GRID = [(2, 4), (4, 8), (4, 4), (3, 7)]


@pytest.mark.parametrize("p, m", GRID)
def test_gpipe_and_1f1b_idle_the_textbook_fraction(p, m):
    for make in (gpipe, one_f_one_b):
        timeline = jscaler.simulate(make(p, m))
        assert timeline.bubble() == pytest.approx((p - 1) / (m + p - 1))


@pytest.mark.parametrize("p, m", GRID)
def test_activations_in_flight_m_for_gpipe_p_minus_s_for_1f1b(p, m):
    assert jscaler.simulate(gpipe(p, m)).in_flight() == [m] * p
    want = [min(p - s, m) for s in range(p)]
    assert jscaler.simulate(one_f_one_b(p, m)).in_flight() == want
    assert jscaler.simulate(zero_bubble(p, m)).in_flight() == want  # ZB-H1: 1F1B's memory


@pytest.mark.parametrize("p, m", GRID)
def test_zero_bubble_fills_the_cooldown_with_weight_gradients(p, m):
    zb = jscaler.simulate(zero_bubble(p, m))
    assert zb.bubble() < jscaler.simulate(one_f_one_b(p, m)).bubble()
    assert zb.schedule.split_backward
    for group in zb.schedule.groups:  # each W after its B, on the same group
        seen = set()
        for b in group:
            if b.kind == "W":
                assert Block(b.stage, b.microbatch, "B") in seen
            seen.add(b)


@pytest.mark.parametrize("p, m", [(2, 4), (4, 8)])
def test_interleaving_shrinks_the_bubble(p, m):
    sched = interleaved_1f1b(p, m, chunks=2)
    assert sched.stages == 2 * p and sched.placement == tuple(s % p for s in range(2 * p))
    assert jscaler.simulate(sched).bubble() < jscaler.simulate(one_f_one_b(p, m)).bubble()


def test_schedules_round_trip_through_json():
    for sched in (gpipe(2, 3), one_f_one_b(4, 8), interleaved_1f1b(2, 4), zero_bubble(3, 5)):
        again = Schedule.from_json(sched.to_json())
        assert again == sched
        again.check()


def test_a_custom_schedule_is_a_plain_function():
    """Backward-first GPipe: forwards in order, backwards newest first."""

    def reverse_gpipe(p, m):
        groups = [
            [Block(s, i, "F") for i in range(m)] + [Block(s, i, "B") for i in reversed(range(m))]
            for s in range(p)
        ]
        return Schedule("reverse_gpipe", p, m, groups, tuple(range(p))).check()

    timeline = jscaler.simulate(reverse_gpipe(2, 4))
    assert timeline.bubble() == pytest.approx(1 / 5)


# ---- bad schedules -------------------------------------------------------------------


def _edit(sched, group, blocks):
    groups = list(sched.groups)
    groups[group] = tuple(blocks)
    return Schedule(sched.name, sched.stages, sched.microbatches, groups, sched.placement)


def test_a_missing_block_is_named():
    sched = one_f_one_b(2, 2)
    broken = _edit(sched, 1, [b for b in sched.groups[1] if b != Block(1, 1, "B")])
    with pytest.raises(ScheduleError, match=r"missing 1 block\(s\): B1\.1"):
        broken.check()


def test_a_repeated_block_is_named():
    sched = gpipe(2, 2)
    broken = _edit(sched, 0, [*sched.groups[0], Block(0, 0, "F")])
    with pytest.raises(ScheduleError, match="F0.0 appears twice"):
        broken.check()


def test_a_deadlock_names_the_blocked_blocks():
    sched = one_f_one_b(2, 2)
    # stage 1 tries the backward of micro-batch 1 before its forward of micro-batch 0
    broken = _edit(
        sched, 1, [Block(1, 1, "F"), Block(1, 0, "F"), Block(1, 0, "B"), Block(1, 1, "B")]
    )
    broken = _edit(
        broken, 0, [Block(0, 0, "F"), Block(0, 0, "B"), Block(0, 1, "F"), Block(0, 1, "B")]
    )
    with pytest.raises(
        ScheduleError,
        match=r"deadlocks.*group 0 waits at B0\.0 for B1\.0.*group 1 waits at F1\.1 for F0\.1",
    ):
        broken.check()


def test_a_block_on_the_wrong_group_or_a_missing_group_is_refused():
    sched = gpipe(2, 2)
    moved = Schedule("x", 2, 2, (sched.groups[1], sched.groups[0]), (0, 1))
    with pytest.raises(ScheduleError, match="stage 1 lives on group 1"):
        moved.check()
    with pytest.raises(ScheduleError, match="there are 2 device groups"):
        Schedule("x", 2, 2, sched.groups, (0, 2))


def test_interleaving_needs_rounds_of_one_micro_batch_per_group():
    with pytest.raises(ScheduleError, match="use a multiple of 4"):
        interleaved_1f1b(4, 6)
    with pytest.raises(ScheduleError, match="positive int"):
        one_f_one_b(0, 4)


# ---- 3F1B ----------------------------------------------------------------------------

TABLE7_S0 = (
    "1:0 | 1:1 2:0 | 1:2 2:1 3:0 | 1:3 2:2 3:1 | 1:4 2:3 3:2 | 1:5 2:4 3:3 B:0 | "
    "1:6 2:5 3:4 B:1 | 1:7 2:6 3:5 B:2 | 2:7 3:6 B:3 | 3:7 B:4 | B:5 | B:6 | B:7"
)
TABLE7_S3 = (
    "1:0 | 1:1 2:0 | 1:2 2:1 3:0 B:0 | 1:3 2:2 3:1 B:1 | 1:4 2:3 3:2 B:2 | 1:5 2:4 3:3 B:3 | "
    "1:6 2:5 3:4 B:4 | 1:7 2:6 3:5 B:5 | 2:7 3:6 B:6 | 3:7 B:7"
)


def _notation(group):
    return " ".join(
        f"{b.pass_ + 1}:{b.microbatch}" if b.kind == "F" else f"B:{b.microbatch}" for b in group
    )


def test_three_f_one_b_is_the_papers_table_7():
    sched = three_f_one_b(4, 8)
    assert _notation(sched.groups[0]) == TABLE7_S0.replace(" |", "")
    assert _notation(sched.groups[3]) == TABLE7_S3.replace(" |", "")
    assert sched.passes == 3 and Schedule.from_json(sched.to_json()) == sched


def test_three_f_one_b_holds_1f1b_memory():
    timeline = jscaler.simulate(three_f_one_b(4, 8))
    assert timeline.in_flight() == [4, 3, 2, 1]


def test_recycling_passes_chain_through_the_last_stage():
    sched = three_f_one_b(2, 2)
    assert sched.deps(Block(0, 1, "F", 2)) == [Block(1, 1, "F", 1)]
    with pytest.raises(ScheduleError, match="micro-batches take 1 pass"):
        extra = _edit(gpipe(2, 2), 0, [*gpipe(2, 2).groups[0], Block(0, 0, "F", 1)])
        extra.check()


def test_interlaced_time_shares_every_device_with_the_pipeline():
    from schedules import interlaced

    sched = interlaced(2, 4)
    assert sched.stages == 3 and sched.whole == (2,) and sched.placement == (2, 0, 1)
    assert jscaler.Schedule.from_json(sched.to_json()) == sched
    tl = jscaler.simulate(sched)
    spans = sorted(tl.spans.values())
    embed = [tl.spans[b] for b in sched.groups[2]]
    for s, e in embed:  # an embedding block overlaps no other block
        assert all(e2 <= s or s2 >= e for s2, e2 in spans if (s2, e2) != (s, e))
    # the embedding time adds to every group's busy time
    assert tl.busy(0) == sum(e - s for s, e in embed) + 3 * 4  # F=1 + B=2 per micro-batch
