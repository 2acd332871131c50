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

from jscaler.compile.comm import comm_table
from jscaler.compile.lower import lower
from jscaler.cost.cluster import get_cluster
from jscaler.cost.collective import collective_time
from jscaler.cost.estimate import Estimate, device_times, needs_grad, recomputed_ops
from jscaler.errors import PlanError
from jscaler.plan.plan import Plan

__all__ = ["spmd_events", "write_pipeline_timeline", "write_spmd_timeline"]

COLORS = {"forward": "#4c72b0", "backward": "#dd8452", "optimizer": "#55a868", "comm": "#c44e52"}


def spmd_events(plan: Plan, est: Estimate, precision: str, microbatches: int) -> list[dict]:
    """Chrome-trace complete events (µs) of one step of an SPMD plan."""
    cl = get_cluster(est.cluster)
    dtype = "bf16" if precision == "bf16" else "fp32"
    g = plan.pgraph.graph
    times = device_times(plan, cl, dtype, needs_grad(g), recomputed_ops(plan))
    optimizer = {v.id for v in (*plan.pgraph.grad_ops, *plan.pgraph.update_ops)}
    path = {o.id: o.path or o.primitive for o in g.ops}
    name = {o.id: o.primitive for o in g.ops}
    devices = list(plan.mesh.devices)
    clock = dict.fromkeys(devices, 0.0)
    events: list[dict] = []
    phase_span: dict = {}  # (phase, micro-batch) -> (start, end) over devices

    def put(dev, label, seconds, phase, mb, where):
        start = clock[dev]
        clock[dev] = start + seconds
        events.append(_event(label, start, seconds, dev, 0, phase, where, mb))
        s, e = phase_span.get((phase, mb), (start, clock[dev]))
        phase_span[(phase, mb)] = (min(s, start), max(e, clock[dev]))

    order = [o.id for o in g.ops if o.id in times]
    for mb in range(microbatches):
        for op in order:
            for dev, t in times[op][0].items():
                put(dev, name[op], t, "forward", mb, path[op])
        for op in reversed(order):
            if op in optimizer:
                continue
            for dev, t in times[op][1].items():
                put(dev, name[op], t, "backward", mb, path[op])
    for op, (_, bwd) in times.items():
        if op in optimizer:
            for dev, t in bwd.items():
                put(dev, "update", t, "optimizer", None, "optimizer")
    low = lower(plan, None)
    table = comm_table(low, microbatches)
    link = dict.fromkeys(devices, 0.0)
    for r in table.rows:
        fixed = {a: 0 for a in plan.mesh.names if a not in r.axes}
        t = collective_time(r.collective, r.bytes, plan.mesh.group(**fixed), cl)
        phase = {"update": "optimizer"}.get(r.phase, r.phase)
        phase = "backward" if phase == "recompute" else phase
        for mb in range(r.times if r.phase != "update" else 1):
            start_of_phase = phase_span.get((phase, mb if phase != "optimizer" else None))
            for dev in devices:
                start = max(link[dev], start_of_phase[0] if start_of_phase else 0.0)
                link[dev] = start + t
                events.append(_event(r.collective, start, t, dev, 1, "comm", r.path, mb, r.bytes))
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
    _write(events, path, title, lambda e: (f"device {e['pid']}", lanes[e["tid"]]))


def write_pipeline_timeline(timeline, path, title: str) -> None:
    """Writes a pipeline's simulated :class:`~jscaler.plan.timeline.Timeline` (seconds)."""
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
    _write(events, path, title, lambda e: (f"group {e['pid']}", "blocks"))


def _write(events, path, title, lane_name) -> None:
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
    _draw(events, path, title, lane_name)


def _draw(events, path, title, lane_name) -> None:
    lanes = sorted({(e["pid"], e["tid"]) for e in events})
    row = {lane: i for i, lane in enumerate(lanes)}
    fig = Figure(figsize=(12, 0.35 * len(lanes) + 1.2))
    ax = fig.add_subplot()
    bars: dict = {}  # (lane, colour) -> spans: one artist each (thousands of ops)
    for e in events:
        key = (row[(e["pid"], e["tid"])], COLORS.get(e["cat"], "#8172b3"))
        bars.setdefault(key, []).append((e["ts"] / 1e3, e["dur"] / 1e3))
    for (y, color), spans in bars.items():
        ax.broken_barh(spans, (y - 0.4, 0.8), facecolors=color, edgecolors="none")
    ax.set_yticks(range(len(lanes)))
    ax.set_yticklabels([" ".join(lane_name({"pid": p, "tid": t})) for p, t in lanes], fontsize=7)
    ax.invert_yaxis()
    ax.set_xlabel("ms (simulated)")
    ax.set_title(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
