"""Drawing a schedule as a timeline: one row per device group, one box per block.

:func:`plot` plays a schedule with :func:`~jscaler.plan.timeline.simulate` and draws each
block from its start to its end time on its group's row. The fill colour names the
micro-batch (a qualitative colormap, so neighbouring micro-batches differ); the kind sets
the style: ``F`` solid, ``B`` darker and hatched ``//``, ``W`` lighter and dotted ``..``,
``R`` lighter with a dotted edge; the forward passes of a recycling schedule (3F1B) that
keep no gradient are paler, the first palest. A box that is wide enough carries the
block's name (``F1.3``: forward of stage 1 on micro-batch 3; ``F1.3/1``: its pass 1), or
without the stage (``F3/1``) when only that fits. The title gives the schedule's name and
its bubble (the fraction of group-time spent idle).

Drawn on a bare :class:`matplotlib.figure.Figure` with the Agg canvas: no pyplot, no
display, nothing global, so it runs on a headless machine and inside tests.
"""

from __future__ import annotations

import os

from matplotlib import colormaps
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.font_manager import FontProperties
from matplotlib.patches import Patch, Rectangle
from matplotlib.textpath import TextPath
from matplotlib.ticker import MaxNLocator

from jscaler.plan.schedule import Block, Schedule
from jscaler.plan.timeline import Timeline, simulate

__all__ = ["figure", "plot"]

# layout, in inches: fixed margins so a box's width in points is known before drawing
ROW = 0.5
LEFT, RIGHT, TOP, BOTTOM = 0.9, 1.5, 0.5, 0.55
MIN_WIDTH, MAX_WIDTH, PER_UNIT = 4.0, 30.0, 0.3
BOX = 0.8  # a box's height, in rows
FONT = 7.0  # points
DPI = 100

KIND_LABEL = {"F": "F forward", "B": "B backward", "W": "W weight grad", "R": "R recompute"}


def plot(schedule: Schedule, path: str | os.PathLike, cost=None) -> Timeline:
    """Simulates ``schedule`` and draws its timeline to an image at ``path``.

    Args:
      schedule: a checked schedule.
      path: where to write; a PNG unless the extension names another format matplotlib
        writes (``.svg``, ``.pdf``).
      cost: kind -> duration, as :func:`~jscaler.plan.timeline.simulate` takes (default:
        unit costs).

    Returns:
      The simulated :class:`~jscaler.plan.timeline.Timeline`.
    """
    timeline = simulate(schedule, cost)
    figure(timeline, unit_costs=cost is None).savefig(path, dpi=DPI)
    return timeline


def figure(timeline: Timeline, unit_costs: bool = True) -> Figure:
    """The timeline drawn on a new Figure (Agg canvas), for saving or embedding."""
    schedule = timeline.schedule
    n = len(schedule.groups)
    width = min(max(LEFT + RIGHT + PER_UNIT * timeline.makespan, MIN_WIDTH), MAX_WIDTH)
    height = TOP + BOTTOM + ROW * n
    fig = Figure(figsize=(width, height))
    FigureCanvasAgg(fig)
    fig.subplots_adjust(
        left=LEFT / width,
        right=1 - RIGHT / width,
        top=1 - TOP / height,
        bottom=BOTTOM / height,
    )
    ax = fig.add_subplot()
    points_per_unit = (width - LEFT - RIGHT) * 72 / timeline.makespan
    for block, (start, end) in sorted(timeline.spans.items(), key=lambda kv: kv[1]):
        _draw_block(ax, block, start, end, schedule, points_per_unit)
    _axes(ax, timeline, unit_costs)
    ax.legend(
        handles=_legend_handles(schedule),
        loc="upper left",
        bbox_to_anchor=(1.01, 1.0),
        fontsize=8,
        frameon=False,
        borderaxespad=0.0,
    )
    return fig


def _title(timeline: Timeline) -> str:
    """``one_f_one_b: 4 groups, 8 micro-batches, bubble 27.3%``."""
    s = timeline.schedule
    return (
        f"{s.name}: {len(s.groups)} groups, {s.microbatches} micro-batches, "
        f"bubble {timeline.bubble():.1%}"
    )


def _axes(ax, timeline: Timeline, unit_costs: bool) -> None:
    n = len(timeline.schedule.groups)
    ax.set_xlim(0, timeline.makespan)
    ax.set_ylim(n - 0.5, -0.5)  # group 0 on top
    whole = getattr(timeline.schedule, "whole", ())
    ax.set_yticks(
        range(n), [f"group {g}" + ("\n(all devices)" if g in whole else "") for g in range(n)]
    )
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("time (unit costs)" if unit_costs else "time")
    ax.set_axisbelow(True)
    ax.grid(axis="x", color="0.9", linewidth=0.6)
    ax.tick_params(axis="y", length=0)
    ax.set_title(_title(timeline), loc="left", fontsize=10)


def _draw_block(ax, block: Block, start, end, schedule: Schedule, points_per_unit) -> None:
    group = schedule.placement[block.stage]
    color = _microbatch_color(block.microbatch, schedule.microbatches)
    if block.kind == "F" and block.pass_ < schedule.passes - 1:  # no gradient kept: paler
        color = _mix(color, 1.0, 0.3 + 0.3 * (schedule.passes - 2 - block.pass_) / schedule.passes)
    style = _style(block.kind, color)
    ax.add_patch(Rectangle((start, group - BOX / 2), end - start, BOX, **style))
    p = f"/{block.pass_}" if block.pass_ else ""
    room = (end - start) * points_per_unit
    label = next(
        (
            t
            for t in (str(block), f"{block.kind}{block.microbatch}{p}")
            if _text_width(t) + 3 <= room
        ),
        None,
    )
    if label is not None:
        ax.text(
            (start + end) / 2,
            group,
            label,
            ha="center",
            va="center",
            fontsize=FONT,
            color=_ink(style["facecolor"]),
            bbox=dict(boxstyle="square,pad=0.1", facecolor=style["facecolor"], edgecolor="none"),
        )


def _microbatch_color(microbatch: int, microbatches: int) -> tuple:
    """A qualitative colour per micro-batch (tab10, or tab20 beyond 10; then repeating)."""
    cmap = colormaps["tab10" if microbatches <= 10 else "tab20"]
    return cmap(microbatch % cmap.N)[:3]


def _style(kind: str, color: tuple) -> dict:
    """Rectangle keyword arguments for a block of ``kind`` in micro-batch colour ``color``."""
    if kind == "F":
        return dict(facecolor=color, edgecolor="black", linewidth=0.6)
    if kind == "B":
        return dict(facecolor=_mix(color, 0.0, 0.35), edgecolor="black", linewidth=0.6, hatch="//")
    if kind == "W":
        return dict(facecolor=_mix(color, 1.0, 0.55), edgecolor="0.35", linewidth=0.6, hatch="..")
    return dict(facecolor=_mix(color, 1.0, 0.4), edgecolor="black", linewidth=1.0, linestyle=":")


def _mix(color: tuple, toward: float, amount: float) -> tuple:
    """``color`` moved ``amount`` of the way to black (0.0) or white (1.0)."""
    return tuple(c + (toward - c) * amount for c in color)


def _ink(face: tuple) -> str:
    """Black text on a light fill, white on a dark one."""
    r, g, b = face[:3]
    return "black" if 0.299 * r + 0.587 * g + 0.114 * b > 0.5 else "white"


def _text_width(text: str) -> float:
    """The width of ``text`` at the label font size, in points."""
    return TextPath((0, 0), text, size=FONT, prop=FontProperties()).get_extents().width


def _legend_handles(schedule: Schedule) -> list[Patch]:
    """One neutral patch per kind the schedule uses, styled as its blocks are."""
    used = {b.kind for g in schedule.groups for b in g}
    grey = (0.62, 0.62, 0.62)
    handles = []
    for kind in ("F", "B", "W", "R"):
        if kind in used:
            label = KIND_LABEL[kind]
            if kind == "B" and schedule.split_backward:
                label = "B input grad"
            handles.append(Patch(label=label, **_style(kind, grey)))
    if schedule.passes > 1:
        handles.insert(1, Patch(label="F/k no-grad pass", **_style("F", _mix(grey, 1.0, 0.45))))
    return handles
