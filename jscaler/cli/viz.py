"""``jscaler viz``: draw a pipeline schedule."""

from __future__ import annotations

from jscaler.cli.common import parse_schedule
from jscaler.cli.numbers import positive_int


def register(sub) -> None:
    vz = sub.add_parser(
        "viz",
        help="draw a pipeline schedule's timeline to a PNG and print its bubble",
        description="Build a pipeline schedule for P device groups and M micro-batches, "
        "simulate it in unit time (F = 1, B = 2; B = W = 1 when the backward is split) and "
        "draw one row per group, one box per block coloured by micro-batch. Prints the "
        "bubble (beside (p-1)/(m+p-1) for GPipe/1F1B-shaped schedules) and the "
        "activations each stage holds at once.",
    )
    vz.add_argument(
        "--schedule",
        required=True,
        metavar="NAME",
        help="gpipe, one_f_one_b, interleaved_1f1b, zero_bubble, three_f_one_b, interlaced, "
        'interlaced_head, table4_1f1b, table7_3f1b; arguments as in "interleaved_1f1b(chunks=2)"',
    )
    vz.add_argument(
        "--stages",
        type=positive_int,
        required=True,
        metavar="P",
        help="device groups, one per pipeline stage (interleaved schedules put several "
        "virtual stages on each)",
    )
    vz.add_argument(
        "--microbatches",
        type=positive_int,
        required=True,
        metavar="M",
        help="micro-batches per step",
    )
    vz.add_argument(
        "--out",
        default="schedule.png",
        metavar="PATH",
        help="PNG to write (default schedule.png; missing folders are created)",
    )
    vz.set_defaults(run=_viz, devices=None)


def _viz(args) -> int:
    from pathlib import Path

    from jscaler.errors import ScheduleError
    from jscaler.report.plot import plot

    try:
        schedule = parse_schedule(args.schedule)(args.stages, args.microbatches)
    except TypeError as e:
        raise ScheduleError(f"--schedule {args.schedule!r}: {e}") from None
    Path(args.out).absolute().parent.mkdir(parents=True, exist_ok=True)
    timeline = plot(schedule, args.out)
    p, m = len(schedule.groups), schedule.microbatches
    print(f"{schedule.name}: {schedule.stages} stages on {p} device groups, {m} micro-batches")
    line = f"bubble {timeline.bubble():.1%} (simulated, unit costs)"
    if _classic_shape(schedule):
        line += f"; (p-1)/(m+p-1) = {p - 1}/{m + p - 1} = {(p - 1) / (m + p - 1):.1%}"
    print(line)
    print(f"activations in flight per stage: {', '.join(map(str, schedule.in_flight()))}")
    print(f"wrote {args.out}")
    return 0


def _classic_shape(schedule) -> bool:
    """One stage per group, one forward pass, whole backwards, no recompute, no
    all-device group: the shape of GPipe and 1F1B, whose unit-cost bubble is
    (p-1)/(m+p-1)."""
    return (
        schedule.stages == len(schedule.groups)
        and not getattr(schedule, "whole", ())
        and schedule.passes == 1
        and not schedule.split_backward
        and not any(b.kind == "R" for g in schedule.groups for b in g)
    )
