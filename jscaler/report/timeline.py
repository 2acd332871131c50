"""A trainer's step as a timeline, SIMULATED by the cost model.

SPMD plans: one lane per device with each op's forward (graph order) then backward (reverse
order), micro-batch after micro-batch, then the optimizer side; a second lane per device
with the plan's collectives in the phase they belong to. Pipelines: one lane per device
group with the schedule's blocks at their predicted durations. Written as a Chrome trace
(``.json``, for https://ui.perfetto.dev or chrome://tracing) or drawn as a PNG (``.png``).
"""

from __future__ import annotations

import json
import os

from matplotlib.figure import Figure
from matplotlib.lines import Line2D
from matplotlib.patches import Patch

from jscaler.compile.comm import comm_table, from_params_only, needs_grad
from jscaler.compile.lower import lower
from jscaler.cost.cluster import get_cluster
from jscaler.cost.collective import Combined, collective_time
from jscaler.cost.estimate import Estimate, device_times
from jscaler.cost.memory import recomputed_ops
from jscaler.cost.precision import value_scale
from jscaler.errors import PlanError
from jscaler.plan.plan import Plan

__all__ = ["spmd_events", "write_pipeline_timeline", "write_spmd_timeline"]

COLORS = {
    "forward": "#4c72b0",
    "backward": "#dd8452",
    "optimizer": "#55a868",
    "comm": "#c44e52",
    "grad_comm": "#937860",
}
LABELS = {
    "forward": "forward",
    "backward": "backward",
    "optimizer": "optimizer",
    "comm": "collective",
    "grad_comm": "gradient reduction",
}


def spmd_events(plan: Plan, est: Estimate, precision: str, microbatches: int) -> list[dict]:
    """Chrome-trace complete events (µs) of one step of an SPMD plan, timed as
    :func:`jscaler.cost.estimate` times it: the activations' collectives (tensor and
    sequence parallel) block the compute after their phase of each micro-batch; the
    parameter gradients' reductions run once, merged into buckets, behind the backward;
    the optimizer side's merged collectives follow the update."""
    cl = get_cluster(est.cluster)
    dtype = "bf16" if precision == "bf16" else "fp32"
    g = plan.pgraph.graph
    times = device_times(plan, cl, dtype, needs_grad(g), recomputed_ops(plan))
    optimizer = {v.id for v in (*plan.pgraph.grad_ops, *plan.pgraph.update_ops)}
    path = {o.id: o.path or o.primitive for o in g.ops}
    name = {o.id: o.primitive for o in g.ops}
    devices = list(plan.mesh.devices)
    clock = dict.fromkeys(devices, 0.0)  # compute lane; blocking collectives advance it
    link = dict.fromkeys(devices, 0.0)  # the merged gradient reductions' lane
    events: list[dict] = []

    def put(dev, label, seconds, phase, mb, where):
        events.append(_event(label, clock[dev], seconds, dev, 0, phase, where, mb))
        clock[dev] += seconds

    def blocking(rows, mb):
        for label, seconds, where, nbytes in rows:
            for dev in devices:
                events.append(_event(label, clock[dev], seconds, dev, 1, "comm", where, mb, nbytes))
                clock[dev] += seconds
                link[dev] = max(link[dev], clock[dev])

    scale = value_scale(dtype)
    params = from_params_only(g)
    combined = Combined(cl)
    exposed: dict = {}  # (phase, micro-batch) -> [(collective, seconds, path, bytes)]
    for r in comm_table(lower(plan, None), microbatches).rows:
        group = plan.mesh.group(**{a: 0 for a in plan.mesh.names if a not in r.axes})
        if (r.phase == "backward" and r.tensor in params) or r.phase == "update":
            nbytes = r.bytes * (scale if r.phase != "update" else 1.0)
            combined.add(r.phase == "backward", r.collective, group, nbytes)
            continue
        t = collective_time(r.collective, r.bytes * scale, group, cl)
        phase = "forward" if r.phase == "forward" else "backward"
        for k in range(r.times):
            exposed.setdefault((phase, k % microbatches), []).append(
                (r.collective, t, r.path, r.bytes * scale)
            )
    merged = combined.buckets()
    order = [o.id for o in g.ops if o.id in times]
    for mb in range(microbatches):
        for op in order:
            for dev, t in times[op][0].items():
                put(dev, name[op], t, "forward", mb, path[op])
        blocking(exposed.get(("forward", mb), ()), mb)
        if mb == 0:  # the gradient reductions start with the backward
            for grad, kind, _, nbytes, t in merged:
                if grad:
                    for dev in devices:
                        start = max(link[dev], clock[dev])
                        label = f"{kind} (gradients, merged)"
                        ev = _event(label, start, t, dev, 1, "grad_comm", label, None, nbytes)
                        events.append(ev)
                        link[dev] = start + t
        for op in reversed(order):
            if op in optimizer:
                continue
            for dev, t in times[op][1].items():
                put(dev, name[op], t, "backward", mb, path[op])
        blocking(exposed.get(("backward", mb), ()), mb)
    for dev in devices:  # the update waits for the gradients
        clock[dev] = max(clock[dev], link[dev])
    for op, (_, bwd) in times.items():
        if op in optimizer:
            for dev, t in bwd.items():
                put(dev, "update", t, "optimizer", None, "optimizer")
    rows = [
        (f"{kind} (optimizer, merged)", t, "optimizer", nbytes)
        for grad, kind, _, nbytes, t in merged
        if not grad
    ]
    blocking(rows, None)
    return events


def _event(label, start, seconds, dev, lane, phase, where, mb, nbytes=None) -> dict:
    args = {"module": where, "phase": phase}
    if mb is not None:
        args["microbatch"] = mb
    if nbytes is not None:
        args["bytes"] = nbytes
    return {
        "name": label,
        "cat": phase,
        "ph": "X",
        "ts": start * 1e6,
        "dur": max(seconds * 1e6, 1e-3),
        "pid": int(dev),
        "tid": lane,
        "args": args,
    }


def write_spmd_timeline(plan: Plan, est: Estimate, path, precision: str, microbatches: int):
    """Writes one step of an SPMD plan to ``path`` (``.json`` or ``.png``)."""
    events = spmd_events(plan, est, precision, microbatches)
    lanes = {0: "compute", 1: "collectives"}
    title = f"{est.plan} on {est.devices} x {est.cluster}, SIMULATED by the cost model"

    def name(e):
        return f"device {e['pid']}", lanes[e["tid"]]

    _write(events, path, title, name, est.step_time)


def write_pipeline_timeline(timeline, path, title: str, step: float | None = None) -> None:
    """Writes a pipeline's simulated :class:`~jscaler.plan.timeline.Timeline` (seconds);
    ``step``, the predicted step (seconds), is marked on a PNG."""
    events = []
    placement = timeline.schedule.placement
    for b, (s, e) in sorted(timeline.spans.items(), key=lambda kv: kv[1]):
        group = placement[b.stage]
        label = f"{b.kind}{b.microbatch}" + (f" s{b.stage}" if b.stage != group else "")
        events.append(
            {
                "name": label,
                "cat": {"F": "forward", "R": "forward", "B": "backward", "W": "backward"}[b.kind],
                "ph": "X",
                "ts": s * 1e6,
                "dur": max((e - s) * 1e6, 1e-3),
                "pid": group,
                "tid": 0,
                "args": {"stage": b.stage, "microbatch": b.microbatch, "kind": b.kind},
            }
        )
    _write(events, path, title, lambda e: (f"group {e['pid']}", "blocks"), step, labelled=True)


def _write(events, path, title, lane_name, step=None, labelled=False) -> None:
    ext = os.path.splitext(str(path))[1].lower()
    if ext == ".json":
        names = {}
        for e in events:
            proc, thread = lane_name(e)
            names[(e["pid"], e["tid"])] = (proc, thread)
        meta = []
        for (pid, tid), (proc, thread) in sorted(names.items()):
            meta.append({"name": "process_name", "ph": "M", "pid": pid, "args": {"name": proc}})
            meta.append(
                {"name": "thread_name", "ph": "M", "pid": pid, "tid": tid, "args": {"name": thread}}
            )
        with open(path, "w") as f:
            json.dump({"traceEvents": meta + events, "otherData": {"title": title}}, f)
        return
    if ext != ".png":
        raise PlanError(f"timeline path {str(path)!r}: expected a .json (Chrome trace) or .png")
    _draw(events, path, title, lane_name, step, labelled)


def _draw(events, path, title, lane_name, step, labelled=False) -> None:
    """``labelled``: each bar outlined and named (a pipeline's blocks, ``F0``, ``B1``, so
    back-to-back blocks of one kind stay apart); otherwise one artist per lane and colour
    (an SPMD step's thousands of ops)."""
    lanes = sorted({(e["pid"], e["tid"]) for e in events})
    row = {lane: i for i, lane in enumerate(lanes)}
    fig = Figure(figsize=(12, 0.35 * len(lanes) + 1.2))
    ax = fig.add_subplot()
    bars: dict = {}  # (lane, colour) -> spans: one artist each (thousands of ops)
    for e in events:
        key = (row[(e["pid"], e["tid"])], COLORS.get(e["cat"], "#8172b3"))
        bars.setdefault(key, []).append((e["ts"] / 1e3, e["dur"] / 1e3))
    for (y, color), spans in bars.items():
        edge = ("white", 1.0) if labelled else ("none", 0.0)
        ax.broken_barh(
            spans, (y - 0.4, 0.8), facecolors=color, edgecolors=edge[0], linewidth=edge[1]
        )
    if labelled:
        end = max(e["ts"] + e["dur"] for e in events) / 1e3
        for e in events:
            start, width = e["ts"] / 1e3, e["dur"] / 1e3
            if width > end / 60:  # room for the name
                y = row[(e["pid"], e["tid"])]
                ax.text(start + width / 2, y, e["name"], ha="center", va="center", fontsize=6)
    drawn = {e["cat"] for e in events}
    key = [Patch(color=c, label=LABELS[cat]) for cat, c in COLORS.items() if cat in drawn]
    if step is not None:
        ax.axvline(step * 1e3, color="black", linestyle="--", linewidth=1)
        key.append(Line2D([], [], color="black", linestyle="--", label="predicted step"))
    ax.legend(handles=key, fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    ax.set_yticks(range(len(lanes)))
    ax.set_yticklabels([" ".join(lane_name({"pid": p, "tid": t})) for p, t in lanes], fontsize=7)
    ax.invert_yaxis()
    ax.set_xlabel("ms (simulated)")
    ax.set_title(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
