"""``jscaler profile``: measure a plan's step and hold it against the cost model."""

from __future__ import annotations

import json
import os
import time

from jscaler.cli.common import (
    add_cluster,
    add_devices,
    add_pipeline,
    add_plan,
    describe,
    setup_trainer,
    throughput,
)
from jscaler.cli.numbers import positive_int


def register(sub) -> None:
    pr = sub.add_parser(
        "profile",
        help="measure a plan's step (time, memory, collectives, MFU) beside the cost "
        "model's prediction; write a jax.profiler trace and the simulated timeline",
        description="Train a reference model under a plan for a few steps (SGD) and print, "
        "measured beside predicted: step time (median after the first, compiling step), "
        "samples or tokens per second and MFU against --cluster's peak, and for SPMD "
        "plans per-device memory (XLA's memory_analysis) and collective bytes per step (the "
        "compiled HLO). The timed steps run untraced, on batches made beforehand. Writes "
        "OUT/trace, a jax.profiler trace of as many steps again, their median printed "
        "apart (TensorBoard's profile plugin or https://ui.perfetto.dev), and "
        "OUT/timeline.json (the cost model's timeline of the step, one lane per device or "
        "device group).",
    )
    pr.add_argument("--model", required=True, help="a reference model, e.g. gpt-tiny")
    add_plan(pr, "dp")
    add_devices(pr)
    pr.add_argument("--steps", type=positive_int, default=5, help="timed steps (default 5)")
    pr.add_argument(
        "--batch-size",
        type=positive_int,
        default=None,
        help="global batch size (default: the model's)",
    )
    add_pipeline(pr)
    add_cluster(pr)
    pr.add_argument(
        "--out", default="profile", metavar="DIR", help="output folder (default ./profile)"
    )
    pr.add_argument("--json", action="store_true", help="print the figures as JSON")
    pr.set_defaults(run=_profile)


def _profile(args) -> int:
    import jax
    import optax

    spec, _, trainer, batch_size = setup_trainer(args, optax.sgd(1e-3))
    batch = spec.batch(batch_size, 0)
    os.makedirs(args.out, exist_ok=True)
    est = trainer.timeline(os.path.join(args.out, "timeline.json"), args.cluster)
    row = {"model": spec.name, "plan": describe(trainer), "cluster": est.cluster}
    if hasattr(trainer, "compiled"):  # one SPMD program: XLA's own figures
        from jscaler.compile.hlo import collectives

        compiled = trainer.compiled(batch)
        mem = compiled.memory_analysis()
        row["memory_mib"] = (
            mem.argument_size_in_bytes + mem.output_size_in_bytes + mem.temp_size_in_bytes
            - mem.alias_size_in_bytes
        ) / 2**20  # fmt: skip
        found = collectives(compiled.as_text(), trainer.plan.mesh.axes)
        row["comm_mb"] = sum(c.bytes * c.times for c in found) / 1e6
    trainer.step(batch)  # compiles
    # the timed steps run outside the profiler, on batches made beforehand (the tracer
    # and making a batch each slow a step: docs/cli.md has the H200 figures); the trace
    # is of as many steps again
    batches = [spec.batch(batch_size, s + 1) for s in range(args.steps)]
    step_s = _median_step(trainer, batches)
    with jax.profiler.trace(os.path.join(args.out, "trace")):
        traced_s = _median_step(trainer, batches)
    samples, tokens = throughput(batch)
    unit, per_step = ("tokens", tokens) if tokens else ("samples", samples)
    row |= {
        "step_ms": step_s * 1e3,
        "traced_step_ms": traced_s * 1e3,
        "predicted_step_ms": est.step_time * 1e3,
        f"{unit}_per_s": per_step / step_s,
        "mfu": est.model_flops / (step_s * est.devices * est.peak),
        "predicted_mfu": est.mfu,
        "predicted_memory_mib": est.memory["total"] / 2**20,
        "predicted_comm_mb": est.comm_bytes / 1e6,
        "trace": os.path.join(args.out, "trace"),
        "timeline": os.path.join(args.out, "timeline.json"),
    }
    if args.json:
        print(json.dumps(row, indent=1))
        return 0
    print(f"profile {spec.name}: {row['plan']}; {args.steps} timed steps (SGD)")
    print(f"{'':<22} {'measured':>12} {'predicted':>12}")
    print(f"{'step ms':<22} {row['step_ms']:>12.2f} {row['predicted_step_ms']:>12.2f}")
    print(f"{'step ms, traced':<22} {row['traced_step_ms']:>12.2f}")
    print(f"{'MFU (' + est.cluster + ' peak)':<22} {row['mfu']:>12.2%} {est.mfu:>12.2%}")
    if "memory_mib" in row:
        print(
            f"{'memory MiB/device':<22} {row['memory_mib']:>12.1f} "
            f"{row['predicted_memory_mib']:>12.1f}"
        )
        print(
            f"{'collectives MB/device':<22} {row['comm_mb']:>12.2f} "
            f"{row['predicted_comm_mb']:>12.2f}"
        )
    print(f"{unit}/s: {row[f'{unit}_per_s']:,.0f}")
    print(f"wrote {row['trace']} (jax.profiler) and {row['timeline']} (SIMULATED timeline)")
    return 0


def _median_step(trainer, batches) -> float:
    """Median seconds of one step over ``batches`` (each step waits for its loss)."""
    times = []
    for b in batches:
        t0 = time.perf_counter()
        trainer.step(b)
        times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2]
