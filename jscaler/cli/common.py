"""Helpers the commands share: plan and schedule expressions, devices and pipeline
flags, building a trainer for a reference model."""

from __future__ import annotations

import argparse

from jscaler.cli.numbers import positive_int

__all__ = ["describe", "parse_schedule"]


def add_devices(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--devices",
        type=positive_int,
        default=None,
        help="number of devices (default: all; without an accelerator, that many simulated "
        "CPU devices, 8 if not given)",
    )


def add_plan(p: argparse.ArgumentParser, default: str | None, required: bool = True) -> None:
    p.add_argument(
        "--plan",
        default=default,
        required=default is None and required,
        help='a space call with literal arguments, e.g. "megatron(tp=2, dp=4)" or '
        '"zero(stage=3)"; a bare name means its defaults; or the path of a plan JSON'
        + (f" (default: {default})" if default else ""),
    )


def add_pipeline(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--microbatches",
        type=positive_int,
        default=None,
        help="micro-batches per step: gradient accumulation, or the pipeline's micro-batches "
        "(default: 1; 2*pp for a plan with pp > 1)",
    )
    p.add_argument(
        "--schedule",
        default=None,
        help="pipeline schedule for a plan with pp > 1: gpipe, one_f_one_b, "
        "interleaved_1f1b, zero_bubble, three_f_one_b, interlaced, interlaced_head, "
        "table4_1f1b, table7_3f1b; arguments as in "
        '"interleaved_1f1b(chunks=2)" (default: the plan\'s own, else one_f_one_b)',
    )


def parse_schedule(expr: str | None):
    """A schedule function ``(groups, microbatches) -> Schedule`` from ``"gpipe"`` or
    ``"interleaved_1f1b(chunks=2)"`` (literal keyword arguments); None for the default."""
    import functools

    from jscaler.errors import ScheduleError
    from schedules import SCHEDULES
    from spaces.parse import parse_call

    if expr is None:
        return None
    expected = f"one of {sorted(SCHEDULES)}"
    name, args, kwargs = parse_call(expr, "--schedule", SCHEDULES, ScheduleError, expected)
    if args is None:
        return SCHEDULES[name]
    if args:
        raise ScheduleError(f"--schedule {expr!r}: pass arguments by keyword, e.g. chunks=2")
    return functools.partial(SCHEDULES[name], **kwargs)


def describe(trainer) -> str:
    """``plan NAME on N devices (MESH)``, or for a pipeline its groups and schedule."""
    plan = trainer.plan
    if hasattr(plan, "mesh"):
        return f"plan {plan.name} on {plan.mesh.size} devices ({plan.mesh})"
    sched = trainer.program.schedule
    groups = ", ".join(
        f"{list(g.devices)[0]}-{list(g.devices)[-1]} ({g.plan.mesh})" for g in plan.groups
    )
    return (
        f"plan {plan.name} on {len(plan.devices)} devices: {sched.stages} stages on groups "
        f"{groups}; schedule {sched.name}, {sched.microbatches} micro-batches"
    )


def abstract_model(spec):
    """The model with shapes only, so inspecting a 7B config allocates nothing."""
    import jax

    if spec.kind == "nnx":
        from flax import nnx

        return nnx.eval_shape(lambda: spec.init(0))
    return jax.eval_shape(lambda: spec.init(0))


def setup_trainer(args, optimizer):
    import dataclasses

    import jscaler
    import jscaler.search
    import models
    from spaces.parse import parse_plan

    spec = models.get(args.model)
    model = spec.init(getattr(args, "seed", 0))
    plan = parse_plan(args.plan)
    skew = getattr(args, "expert_skew", None)
    if isinstance(plan, jscaler.search.Auto):  # the joint search shows its progress
        plan = dataclasses.replace(
            plan, progress=True, **({"expert_skew": skew} if skew is not None else {})
        )
    elif skew is not None:
        raise jscaler.PlanError(
            f"--expert-skew {skew:g} steers the search of --plan auto, but the plan is "
            f"{args.plan!r}; drop --expert-skew, or use --plan auto (jscaler plan "
            f"--plan {args.plan!r} --expert-skew {skew:g} predicts this plan under it)"
        )
    if (precision := getattr(args, "precision", None)) is not None:
        plan = with_precision(plan, precision, args.plan)
    pp = getattr(plan, "pp", 1)
    microbatches = args.microbatches or (2 * pp if pp > 1 else 1)
    # a pipeline's micro-batches each get the model's default batch size unless told
    default = spec.batch_size * (microbatches if pp > 1 else 1)
    batch_size = getattr(args, "batch_size", None) or default
    # gradient accumulation: N batches of batch_size in one step, N times the micro-batches
    accum = getattr(args, "grad_accum", 1)
    batch_size, microbatches = batch_size * accum, microbatches * accum
    trainer = jscaler.parallelize(
        model,
        spec.loss,
        optimizer,
        spec.batch(batch_size, 0),
        devices=args.devices,
        plan=plan,
        microbatches=microbatches,
        schedule=parse_schedule(args.schedule),
        cluster=getattr(args, "cluster", None),
    )
    return spec, model, trainer, batch_size


def with_precision(plan, precision: str, expr: str):
    """The space ``plan`` with its ``precision=`` knob set (``--precision``)."""
    import dataclasses

    from jscaler.errors import PlanError

    if not dataclasses.is_dataclass(plan) or "precision" not in {
        f.name for f in dataclasses.fields(plan)
    }:
        raise PlanError(
            f"--precision {precision}: the plan {expr!r} has no precision knob (a plan JSON "
            f"keeps the precision it was made with; the auto search takes none); drop "
            f"--precision or name a space such as dp or megatron(...)"
        )
    return dataclasses.replace(plan, precision=precision)


def add_expert_skew(p: argparse.ArgumentParser, default: float | None) -> None:
    """``--expert-skew S``: ``jscaler plan``'s predictions and every command's ``--plan
    auto`` search take the router's imbalance (``default`` None: the plan's own)."""
    from jscaler.cli.numbers import at_least_one

    p.add_argument(
        "--expert-skew",
        type=at_least_one,
        default=default,
        metavar="S",
        help="a mixture-of-experts router's load imbalance: the busiest expert-parallel "
        "device's rows over the mean (>= 1; 1: balanced; models.moe.expert_skew measures "
        "it). A dropless model's experts split over ep wait for the busiest device, so "
        "--plan auto predicts every candidate under it and a skewed router steers the "
        "search away from high ep"
        + (f" (default {default:g})" if default is not None else " (default 1)"),
    )


def add_cluster(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--cluster",
        default=None,
        help="the machine the plan is for (dgx2_v100, dgx1_v100, a100_80g, h100_sxm, h200, cpu): "
        "the predicted memory per device is checked against its memory before anything "
        "runs, and MFU is reported against its peak (default: the local GPU's preset when one "
        "describes it; on CPU no memory check and MFU against the cpu preset)",
    )


def local_cluster() -> str | None:
    """``--cluster``'s default: the preset of the local GPU when one describes it (H200,
    H100, A100, V100), else None (on CPU: no memory check, MFU against the cpu preset)."""
    import jax

    from jscaler.cost.cluster import preset_of

    preset = preset_of(jax.devices()[0])
    return None if preset == "cpu" else preset


def throughput(batch) -> tuple[int, int | None]:
    """(samples, tokens) in a batch: samples are axis 0 of its first leaf; tokens its
    first two axes when that leaf is an integer (token ids) array of rank 2, else None."""
    import jax
    import numpy as np

    first = jax.tree_util.tree_leaves(batch)[0]
    samples = int(first.shape[0])
    is_tokens = first.ndim == 2 and np.issubdtype(first.dtype, np.integer)
    return samples, samples * int(first.shape[1]) if is_tokens else None
