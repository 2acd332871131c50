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
    setup_trainer,
    throughput,
)
from jscaler.cli.config import add_config, to_toml
from jscaler.cli.numbers import count, positive_int
from jscaler.cli.train_data import add_data, batches, check_data
from jscaler.cli.train_options import EVAL_SEED, add_metrics, add_recipe, recipe_of
from jscaler.report import explain


def register(sub) -> None:
    tr = sub.add_parser(
        "train",
        help="train a reference model under a plan, with a progress bar and the loss",
        description="Train a reference model on its synthetic data (or a token file, "
        "--data) under a plan (Adam at a constant --lr unless told otherwise). Batch s of "
        "the run is the model's synthetic batch with seed s (or the file's batch s for "
        "--seed), so a resumed run sees the same data as an uninterrupted one. "
        "Logs the loss, samples (or tokens) per second and MFU against --cluster's peak; a "
        "NaN or infinite loss stops the run (exit 2) with the step number, keeping the "
        "last good checkpoint. Every option can come from a TOML --config file instead.",
    )
    add_config(tr)
    tr.add_argument("--model", required=True, help="a reference model, e.g. gpt-tiny")
    add_data(tr)
    add_plan(tr, "dp")
    add_devices(tr)
    tr.add_argument(
        "--steps", type=positive_int, default=20, help="training steps in all (default 20)"
    )
    tr.add_argument(
        "--batch-size",
        type=positive_int,
        default=None,
        help="global batch size (default: the model's; times the micro-batches for pp > 1); "
        "each update trains on --grad-accum of them",
    )
    add_pipeline(tr)
    add_recipe(tr)
    add_metrics(tr)
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
        "--init-from",
        default=None,
        metavar="DIR",
        help="start from the weights of a Hugging Face safetensors checkpoint (DIR/"
        "model.safetensors, PyTorch or Flax names) instead of the model's initialisation; "
        "each device reads only its own slices. The model must have the checkpoint's "
        "shapes (build it from DIR/config.json); the config is copied into "
        "--checkpoint-dir for jscaler export",
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
    tr.set_defaults(run=lambda args: _train(args, tr))


def _recipe_line(recipe, args, precision: str) -> str:
    """``adamw, lr 0.001 cosine (warm-up 10) to 0 at step 100, clip grad norm 1, weight
    decay 0.1, seed 0, fp32``."""
    parts = [f"{recipe.optimizer}, lr {recipe.lr:g} {recipe.schedule}"]
    if recipe.warmup_steps:
        parts.append(f"(warm-up {recipe.warmup_steps})")
    if recipe.schedule != "constant":
        parts.append(f"to {recipe.min_lr:g} at step {recipe.steps}")
    line = " ".join(parts)
    if recipe.clip_grad_norm:
        line += f", clip grad norm {recipe.clip_grad_norm:g}"
    if recipe.weight_decay:
        line += f", weight decay {recipe.weight_decay:g}"
    if args.grad_accum > 1:
        line += f", {args.grad_accum} batches accumulated per update"
    return line + f", seed {args.seed}, {precision}"


def _init_from(trainer, args) -> None:
    """Loads ``--init-from``'s weights and copies its config.json beside the checkpoints."""
    import shutil
    from pathlib import Path

    report = trainer.load_safetensors(args.init_from)
    per_device = max(report.bytes_per_device.values(), default=0)
    unused = f"; {len(report.unused)} of its tensors unused" if report.unused else ""
    print(
        f"init from {args.init_from}: {report.tensors} tensors ({report.format} names), at "
        f"most {per_device / 1e6:.2f} MB read per device{unused}"
    )
    config = Path(args.init_from) / "config.json"
    if args.checkpoint_dir and config.is_file():
        shutil.copyfile(config, Path(args.checkpoint_dir) / "config.json")


def _memory() -> list[int] | None:
    """Bytes in use on each local device, where the device reports it (GPUs, TPUs; the
    CPU backend does not: None)."""
    import jax

    stats = [d.memory_stats() for d in jax.local_devices()]
    if any(s is None or "bytes_in_use" not in s for s in stats):
        return None
    return [int(s["bytes_in_use"]) for s in stats]


def _train(args, parser) -> int:
    recipe = recipe_of(args)  # a bad combination of options fails before any tracing
    if args.print_config:
        header = "jscaler train: the options after --config and the command line"
        print(to_toml(parser, args, header), end="")
        return 0
    import jax
    from tqdm import tqdm

    from jscaler.errors import CheckpointError, NonFiniteLossError, PlanError
    from jscaler.runtime.metrics_log import MetricsLog

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
    check_data(args)  # a file that does not fit the model: before the model is built
    if args.init_from:  # and a folder that holds no weights
        from jscaler.runtime.safetensors_io import weight_files

        weight_files(args.init_from)
    spec, _, trainer, batch_size = setup_trainer(args, recipe.build())
    train_data, eval_data = batches(args, spec, batch_size)

    def batch(step: int, data, seed: int):  # the synthetic batch, or the file's rows
        if data is None:
            return spec.batch(batch_size, seed)
        rows = data(step)
        return trainer.global_batch(rows) if jax.process_count() > 1 else rows

    if args.checkpoint_dir:  # and room for one checkpoint of this trainer's state
        from jscaler.runtime.checkpoint import check_directory

        check_directory(args.checkpoint_dir, trainer.checkpoint_bytes())
    print(f"{spec.name}: {spec.description}")
    if args.data:
        held = f"; eval on {args.eval_data}" if args.eval_data else ""
        print(f"data: {args.data}, shuffled with seed {args.seed}{held}")
    print(describe(trainer))
    print(f"recipe: {_recipe_line(recipe, args, trainer.precision)}")
    if args.explain:
        if trainer.plan.searched is not None:
            print(trainer.plan.searched.explain())
        for plan in trainer.plan.spmd_plans:
            print(explain(plan))
    start_step = 0
    if args.init_from:
        _init_from(trainer, args)
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
    evals: list[tuple[int, float]] = []  # (step, eval loss)
    held_out: list = []  # the eval batches, made on first use
    show_lr = recipe.schedule != "constant" or recipe.warmup_steps > 0
    log = MetricsLog(args.metrics_dir) if args.metrics_dir and jax.process_index() == 0 else None

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

    def eval_loss() -> float:  # the mean loss over the held-out batches, no update
        if not held_out:
            held_out.extend(batch(k, eval_data, EVAL_SEED + k) for k in range(args.eval_batches))
        return sum(trainer.eval(b)["loss"] for b in held_out) / len(held_out)

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
                metrics = trainer.step(batch(step, train_data, step))
                took = time.perf_counter() - t0
                if step > start_step:  # the first step compiles
                    timed.append(took)
                first = metrics["loss"] if first is None else first
                last = metrics["loss"]
                lr = recipe.learning_rate(step)  # the rate this update used
                post = {"loss": f"{last:.4f}", "grad_norm": f"{metrics['grad_norm']:.3f}"}
                if show_lr:
                    post["lr"] = f"{lr:.3g}"
                record = {"loss": last, "grad_norm": metrics["grad_norm"], "lr": lr}
                if timed:
                    rate = per_step / took
                    mfu = est.model_flops / (took * devices * est.peak)
                    post[f"{unit}/s"] = f"{rate:,.0f}"
                    post["MFU"] = f"{mfu:.1%}"
                    record |= {"step_s": took, f"{unit}_per_s": rate, "mfu": mfu}
                bar.set_postfix(post)
                done = step + 1
                logged = args.log_every and done % args.log_every == 0
                if logged:
                    bar.write(f"step {done}: " + ", ".join(f"{k} {v}" for k, v in post.items()))
                # the JSONL has the logged steps (every step with --log-every 0)
                if args.log_every and not logged:
                    record = {}
                elif log is not None:
                    record["memory_bytes"] = _memory()
                if args.eval_every and done % args.eval_every == 0:
                    evals.append((done, eval_loss()))
                    bar.write(f"step {done}: eval loss {evals[-1][1]:.4f}")
                    record["eval_loss"] = evals[-1][1]
                every = args.checkpoint_every and done % args.checkpoint_every == 0
                if args.checkpoint_dir and (every or done == args.steps):  # and at the end
                    saved = save()
                    record["checkpoint_s"] = saving[-1]
                if log is not None and record:
                    log.write(done, record)
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
        if log is not None:
            log.close()
    took = time.perf_counter() - began
    if first is None:
        print(f"nothing to do: the checkpoint is at step {start_step} of --steps {args.steps}")
        return 0
    print(
        f"loss {first:.4f} -> {last:.4f} in {args.steps - start_step} steps ({took:.1f} s, "
        f"including compilation)"
    )
    if evals:
        print(f"eval loss {evals[-1][1]:.4f} at step {evals[-1][0]} ({args.eval_batches} "
              f"held-out batches)")  # fmt: skip
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
    if args.metrics_dir and log is not None:
        print(f"metrics: {log.path} and TensorBoard events (tensorboard --logdir "
              f"{args.metrics_dir})")  # fmt: skip
    if profiling:
        print(f"profile: {args.profile} (jax.profiler trace)")
    return 0
