"""``jscaler train``: train a reference model under a plan, with checkpoints, a progress
bar, the loss, throughput and MFU, and an optional profiler trace."""

from __future__ import annotations

import sys
import time

from jscaler.cli.common import (
    add_cluster,
    add_devices,
    add_expert_skew,
    add_pipeline,
    add_plan,
    describe,
    plans_of,
    setup_trainer,
    throughput,
)
from jscaler.cli.numbers import count, positive_int
from jscaler.report import explain


def register(sub) -> None:
    tr = sub.add_parser(
        "train",
        help="train a reference model under a plan, with a progress bar and the loss",
        description="Train a reference model on its synthetic data under a plan (Adam). "
        "Batch s of the run is the model's synthetic batch with seed s, so a resumed run "
        "sees the same data as an uninterrupted one. Logs the loss, samples (or tokens) "
        "per second and MFU against --cluster's peak; a NaN or infinite loss stops the run "
        "(exit 2) with the step number, keeping the last good checkpoint.",
    )
    tr.add_argument("--model", required=True, help="a reference model, e.g. gpt-tiny")
    add_plan(tr, "dp")
    add_devices(tr)
    tr.add_argument(
        "--steps", type=positive_int, default=20, help="training steps in all (default 20)"
    )
    tr.add_argument(
        "--batch-size",
        type=positive_int,
        default=None,
        help="global batch size (default: the model's; times the micro-batches for pp > 1)",
    )
    add_pipeline(tr)
    tr.add_argument("--lr", type=float, default=1e-2, help="Adam learning rate (default 1e-2)")
    tr.add_argument("--explain", action="store_true", help="print the plan's table first")
    tr.add_argument(
        "--log-every",
        type=count,
        default=10,
        metavar="N",
        help="print a line with the loss, throughput and MFU every N steps (default 10; 0: "
        "only the progress bar)",
    )
    add_cluster(tr)
    add_expert_skew(tr, None)
    tr.add_argument(
        "--checkpoint-dir",
        default=None,
        metavar="DIR",
        help="write checkpoints to DIR/<step> (orbax; atomic: a killed save leaves the "
        "previous one intact); one at the end of the run, and every --checkpoint-every steps",
    )
    tr.add_argument(
        "--checkpoint-every",
        type=count,
        default=0,
        metavar="N",
        help="also checkpoint every N steps (default 0: only at the end)",
    )
    tr.add_argument(
        "--keep-checkpoints",
        type=count,
        default=0,
        metavar="N",
        help="after each save, delete all but the newest N checkpoints (default 0: keep all)",
    )
    tr.add_argument(
        "--async-checkpoints",
        action="store_true",
        help="write checkpoints in the background while training goes on (each save "
        "waits for the one before; the run waits for the last before it exits)",
    )
    tr.add_argument(
        "--resume",
        action="store_true",
        help="continue from the latest complete checkpoint in --checkpoint-dir (its "
        "parameters, optimizer state and step; the plan and device count may differ); "
        "starts from scratch when there is none",
    )
    tr.add_argument(
        "--profile",
        default=None,
        metavar="DIR",
        help="write a jax.profiler trace of the steps after the first (compilation) to DIR "
        "(open it with TensorBoard's profile plugin or https://ui.perfetto.dev)",
    )
    tr.set_defaults(run=_train)


def _train(args) -> int:
    import jax
    import optax
    from tqdm import tqdm

    from jscaler.errors import CheckpointError, NonFiniteLossError, PlanError

    if (args.checkpoint_every or args.resume or args.keep_checkpoints) and not args.checkpoint_dir:
        raise PlanError(
            "--checkpoint-every, --keep-checkpoints and --resume need --checkpoint-dir DIR"
        )
    if args.checkpoint_dir:  # before any training: a checkpoint that cannot be written
        import warnings

        from jscaler.runtime.checkpoint import check_directory, latest_step, prune

        check_directory(args.checkpoint_dir)
        # latest_step and restore both scan the folder: say each skipped step once
        warnings.filterwarnings("once", message="skipping checkpoint")
    if args.checkpoint_dir and not args.resume:
        if (found := latest_step(args.checkpoint_dir)) is not None:
            raise CheckpointError(
                f"--checkpoint-dir {args.checkpoint_dir} already holds step {found}; add "
                f"--resume to continue from it, or name an empty directory"
            )
    spec, _, trainer, batch_size = setup_trainer(args, optax.adam(args.lr))
    if args.checkpoint_dir:  # and room for one checkpoint of this trainer's state
        from jscaler.runtime.checkpoint import check_directory

        check_directory(args.checkpoint_dir, trainer.checkpoint_bytes())
    print(f"{spec.name}: {spec.description}")
    print(describe(trainer))
    if args.explain:
        if (searched := trainer.plan.__dict__.get("auto")) is not None:
            print(searched.explain())
        for plan in plans_of(trainer):
            print(explain(plan))
    start_step = 0
    if args.resume:
        if latest_step(args.checkpoint_dir) is not None:
            start_step = trainer.restore(args.checkpoint_dir)
            print(f"resumed from {args.checkpoint_dir}/{start_step} (step {start_step})")
        else:
            print(f"no checkpoint in {args.checkpoint_dir}; starting from step 0")
    est = trainer.estimate(args.cluster)
    samples, tokens = throughput(spec.batch(batch_size, 0))
    unit, per_step = ("tokens", tokens) if tokens else ("samples", samples)
    devices = est.devices
    first = last = None
    saved = None
    timed: list[float] = []
    saving: list[float] = []  # seconds per checkpoint save

    def save():  # seconds the training loop waits for it (the blocking part)
        t0 = time.perf_counter()  # save() waits for the one before, so pruning counts it
        path = trainer.save(args.checkpoint_dir, wait=not args.async_checkpoints)
        if args.keep_checkpoints:
            prune(args.checkpoint_dir, args.keep_checkpoints)
        saving.append(time.perf_counter() - t0)
        return path

    def finish_saves():  # the last background save, counted with it
        if args.checkpoint_dir and saving:
            t0 = time.perf_counter()
            trainer.wait_for_save()
            if args.keep_checkpoints:
                prune(args.checkpoint_dir, args.keep_checkpoints)
            saving[-1] += time.perf_counter() - t0

    began = time.perf_counter()
    profiling = False
    try:
        with tqdm(
            range(start_step, args.steps), desc="train", unit="step", dynamic_ncols=True
        ) as bar:
            for step in bar:
                if args.profile and step == start_step + 1:
                    jax.profiler.start_trace(args.profile)
                    profiling = True
                t0 = time.perf_counter()
                metrics = trainer.step(spec.batch(batch_size, step))
                took = time.perf_counter() - t0
                if step > start_step:  # the first step compiles
                    timed.append(took)
                first = metrics["loss"] if first is None else first
                last = metrics["loss"]
                post = {"loss": f"{last:.4f}", "grad_norm": f"{metrics['grad_norm']:.3f}"}
                if timed:
                    rate = per_step / took
                    post[f"{unit}/s"] = f"{rate:,.0f}"
                    post["MFU"] = f"{est.model_flops / (took * devices * est.peak):.1%}"
                bar.set_postfix(post)
                if args.log_every and (step + 1) % args.log_every == 0:
                    bar.write(f"step {step + 1}: " + ", ".join(f"{k} {v}" for k, v in post.items()))
                done = step + 1
                if args.checkpoint_every and done % args.checkpoint_every == 0:
                    saved = save()
            unsaved = saved is None or saved.name != str(trainer.step_count)
            if args.checkpoint_dir and trainer.step_count > start_step and unsaved:
                saved = save()
        finish_saves()
    except NonFiniteLossError as e:
        finish_saves()  # the last good step, if it was still being written
        print(f"jscaler train: stopped: {e}", file=sys.stderr)
        if args.checkpoint_dir:
            from jscaler.runtime.checkpoint import latest_step

            good = latest_step(args.checkpoint_dir)
            kept = f"{args.checkpoint_dir}/{good}" if good is not None else "none written"
            print(f"last good checkpoint: {kept} (resume with --resume)", file=sys.stderr)
        return 2
    finally:
        if profiling:
            jax.profiler.stop_trace()
    took = time.perf_counter() - began
    if first is None:
        print(f"nothing to do: the checkpoint is at step {start_step} of --steps {args.steps}")
        return 0
    print(
        f"loss {first:.4f} -> {last:.4f} in {args.steps - start_step} steps ({took:.1f} s, "
        f"including compilation)"
    )
    if timed:
        step_s = sorted(timed)[len(timed) // 2]
        mfu = est.model_flops / (step_s * devices * est.peak)
        print(
            f"steady state: {step_s * 1e3:.1f} ms/step (median of {len(timed)}), "
            f"{per_step / step_s:,.0f} {unit}/s, MFU {mfu:.2%} of {devices} x {est.cluster} "
            f"peak ({est.peak / 1e9:.0f} GFLOP/s per device)"
        )
    if saved is not None:
        spent = sum(saving)
        print(
            f"checkpoint: {saved} ({len(saving)} saves, {spent:.1f} s, {spent / took:.0%} of "
            f"the run's {took:.1f} s; the steady state above leaves them out)"
        )
    if profiling:
        print(f"profile: {args.profile} (jax.profiler trace)")
    return 0
