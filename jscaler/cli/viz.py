"""``jscaler viz``: draw a pipeline schedule, or a plan's simulated step and memory."""

from __future__ import annotations

from jscaler.cli.common import add_cluster, add_devices, add_plan, parse_schedule
from jscaler.cli.numbers import positive_int


def register(sub) -> None:
    vz = sub.add_parser(
        "viz",
        help="draw a pipeline schedule's timeline, or a plan's simulated step and memory "
        "per device, to PNGs",
        description="Two modes. Schedule mode (--schedule, --stages, --microbatches): build "
        "a pipeline schedule for P device groups and M micro-batches, simulate it in unit "
        "time (F = 1, B = 2; B = W = 1 when the backward is split) and draw one row per "
        "group, one box per block coloured by micro-batch; prints the bubble (beside "
        "(p-1)/(m+p-1) for GPipe/1F1B-shaped schedules) and the activations each stage "
        "holds at once. Plan mode (--model, --plan): build the trainer (nothing is "
        "compiled or run) and draw the plan's step as the cost model predicts it on "
        "--cluster: OUT/timeline.png (an SPMD plan: each device's forward, backward and "
        "optimizer ops and its collectives; a pipeline: each device group's blocks) and "
        "OUT/memory.png (each device's memory: parameters, optimizer state, batch, "
        "gradients, activations, the predicted peak and the device's capacity); prints "
        "the predicted step and memory. Every figure of plan mode is SIMULATED, not "
        "measured (jscaler profile measures).",
    )
    vz.add_argument(
        "--schedule",
        default=None,
        metavar="NAME",
        help="gpipe, one_f_one_b, interleaved_1f1b, zero_bubble, three_f_one_b, interlaced, "
        'interlaced_head, table4_1f1b, table7_3f1b; arguments as in "interleaved_1f1b(chunks=2)"'
        " (schedule mode: the schedule drawn; plan mode: a pipeline plan's schedule, default "
        "the plan's own, else one_f_one_b)",
    )
    vz.add_argument(
        "--stages",
        type=positive_int,
        default=None,
        metavar="P",
        help="schedule mode: device groups, one per pipeline stage (interleaved schedules "
        "put several virtual stages on each)",
    )
    vz.add_argument(
        "--microbatches",
        type=positive_int,
        default=None,
        metavar="M",
        help="micro-batches per step (schedule mode: required; plan mode: default 1, 2*pp "
        "for a plan with pp > 1)",
    )
    vz.add_argument("--model", default=None, help="plan mode: a reference model, e.g. gpt-tiny")
    add_plan(vz, None, required=False)
    add_devices(vz)
    add_cluster(vz)
    vz.add_argument(
        "--out",
        default=None,
        metavar="PATH",
        help="schedule mode: the PNG to write (default schedule.png); plan mode: the folder "
        "for timeline.png and memory.png (default viz); missing folders are created",
    )
    vz.set_defaults(run=_viz)


def _viz(args) -> int:
    if _mode(args) == "plan":
        return _viz_plan(args)
    return _viz_schedule(args)


def _mode(args) -> str:
    """ "schedule" or "plan", from the options given; a usage error (ConfigError, exit 2)
    when they mix the modes or name neither."""
    from jscaler.errors import ConfigError

    plan_opts = [f"--{k}" for k in ("model", "plan", "cluster") if getattr(args, k) is not None]
    plan_opts += ["--devices"] if args.devices is not None else []
    how = (
        "draw a schedule with --schedule NAME --stages P --microbatches M, or a plan with "
        "--model M --plan P [--devices N] [--cluster C] [--schedule S] [--microbatches M]"
    )
    if plan_opts:
        if args.stages is not None:
            raise ConfigError(
                f"--stages is schedule mode's, but {' and '.join(plan_opts)} "
                f"{'is' if len(plan_opts) == 1 else 'are'} plan mode's: {how}"
            )
        missing = [f"--{k}" for k in ("model", "plan") if getattr(args, k) is None]
        if missing:
            raise ConfigError(f"plan mode needs {' and '.join(missing)}: {how}")
        return "plan"
    missing = [f"--{k}" for k in ("schedule", "stages", "microbatches") if getattr(args, k) is None]
    if len(missing) == 3:
        raise ConfigError(f"nothing to draw: {how}")
    if missing:
        raise ConfigError(f"schedule mode needs {' and '.join(missing)}: {how}")
    return "schedule"


def _viz_plan(args) -> int:
    import os

    import optax

    from jscaler.cli.common import describe, setup_trainer
    from jscaler.cost import get_cluster
    from jscaler.report.memory import PARTS, device_memory, unit_of, write_memory_breakdown

    out = args.out or "viz"
    os.makedirs(out, exist_ok=True)
    # Adam: the memory breakdown shows the two moments an optimizer commonly keeps
    spec, _, trainer, _ = setup_trainer(args, optax.adam(1e-3))
    timeline_png = os.path.join(out, "timeline.png")
    memory_png = os.path.join(out, "memory.png")
    est = trainer.timeline(timeline_png, args.cluster)
    cluster = get_cluster(est.cluster)
    plan = trainer.plan
    devices = plan.mesh.devices if hasattr(plan, "mesh") else plan.devices
    per_device = device_memory(est, devices)
    title = (
        f"{spec.name}, {plan.name} on {est.devices} x {est.cluster}\nmemory per device "
        f"(Adam optimizer state), SIMULATED by the cost model"
    )
    # the capacity line only for a cluster named: the cpu preset's is a placeholder
    capacity = cluster.memory if args.cluster is not None else None
    labels = None
    if hasattr(plan, "groups"):  # a pipeline: which stage group each device is in
        groups = {
            d: [str(gi) for gi, g in enumerate(plan.groups) if d in g.devices] for d in per_device
        }
        labels = {d: f"dev {d}\ngroup {'+'.join(gs)}" for d, gs in groups.items()}
    write_memory_breakdown(per_device, memory_png, title, capacity, labels)
    print(f"viz {spec.name}: {describe(trainer)}; SIMULATED by the cost model on {est.cluster}")
    print(
        f"predicted step {est.step_time * 1e3:.3f} ms (compute {est.compute * 1e3:.3f}, "
        f"collectives {est.comm * 1e3:.3f}, exposed {est.exposed_comm * 1e3:.3f}"
        + (f", bubble {est.bubble:.1%}" if est.bubble else "")
        + f"), MFU {est.mfu:.1%}"
    )
    unit, size = unit_of(max(est.memory["total"], 1.0))
    parts = ", ".join(f"{p} {est.memory[p] / size:.3f}" for p in PARTS)
    print(
        f"memory per device ({unit}, Adam; the fullest device): {parts}; peak "
        f"{est.memory['total'] / size:.3f}"
        + (f" of {cluster.memory / 2**30:.0f} GiB" if capacity else "")
    )
    print(f"wrote {timeline_png} and {memory_png}")
    return 0


def _viz_schedule(args) -> int:
    from pathlib import Path

    from jscaler.errors import ScheduleError
    from jscaler.report.plot import plot

    try:
        schedule = parse_schedule(args.schedule)(args.stages, args.microbatches)
    except TypeError as e:
        raise ScheduleError(f"--schedule {args.schedule!r}: {e}") from None
    out = args.out or "schedule.png"
    Path(out).absolute().parent.mkdir(parents=True, exist_ok=True)
    timeline = plot(schedule, out)
    p, m = len(schedule.groups), schedule.microbatches
    print(f"{schedule.name}: {schedule.stages} stages on {p} device groups, {m} micro-batches")
    line = f"bubble {timeline.bubble():.1%} (simulated, unit costs)"
    if _classic_shape(schedule):
        line += f"; (p-1)/(m+p-1) = {p - 1}/{m + p - 1} = {(p - 1) / (m + p - 1):.1%}"
    print(line)
    print(f"activations in flight per stage: {', '.join(map(str, schedule.in_flight()))}")
    print(f"wrote {out}")
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
