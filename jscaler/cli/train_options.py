"""``jscaler train``'s recipe and metrics options: the optimizer and its learning-rate
schedule, clipping, weight decay, gradient accumulation, seed and precision; the metrics
directory and the eval loop."""

from __future__ import annotations

import argparse

from jscaler.cli.numbers import count, non_negative_float, positive_int
from jscaler.runtime.recipe import OPTIMIZERS, SCHEDULES, Recipe

__all__ = ["EVAL_SEED", "add_metrics", "add_recipe", "recipe_of"]

# the eval batches' seeds: EVAL_SEED + k, disjoint from the training batches' (the step
# numbers) in any run of fewer than 2**30 steps
EVAL_SEED = 2**30


def add_recipe(p: argparse.ArgumentParser) -> None:
    """The training recipe's options (see :class:`jscaler.Recipe`)."""
    p.add_argument(
        "--seed",
        type=int,
        default=0,
        help="the model's initialisation seed and --data's shuffle seed (default 0); "
        "without --data, batch s of the run stays the synthetic batch with seed s",
    )
    p.add_argument(
        "--optimizer",
        choices=OPTIMIZERS,
        default="adam",
        help="adam, adamw (decoupled --weight-decay) or sgd (default adam)",
    )
    p.add_argument(
        "--lr",
        type=float,
        default=1e-2,
        help="the learning rate: the peak after --warmup-steps (default 1e-2)",
    )
    p.add_argument(
        "--lr-schedule",
        choices=SCHEDULES,
        default="constant",
        help="after the warm-up the rate stays at --lr (constant, the default) or decays to "
        "--min-lr at the last of --steps (cosine, linear)",
    )
    p.add_argument(
        "--warmup-steps",
        type=count,
        default=0,
        metavar="N",
        help="raise the rate linearly from 0 to --lr over the first N updates (default 0)",
    )
    p.add_argument(
        "--min-lr",
        type=non_negative_float,
        default=0.0,
        help="the rate a cosine or linear schedule ends at (default 0)",
    )
    p.add_argument(
        "--clip-grad-norm",
        type=non_negative_float,
        default=0.0,
        metavar="MAX",
        help="scale the gradients down to global norm MAX when above it "
        "(optax.clip_by_global_norm; the logged grad_norm is before clipping; default 0: off)",
    )
    p.add_argument(
        "--weight-decay",
        type=non_negative_float,
        default=0.0,
        help="adamw's decoupled weight decay, or sgd's (added to the gradient); adam takes "
        "none (default 0)",
    )
    p.add_argument(
        "--grad-accum",
        type=positive_int,
        default=1,
        metavar="N",
        help="accumulate the gradients of N batches of --batch-size into each update: a step "
        "trains on N x --batch-size rows, N times the micro-batches, at one micro-batch's "
        "activation memory (default 1)",
    )
    p.add_argument(
        "--precision",
        choices=("fp32", "bf16"),
        default=None,
        help="compute in bf16 (fp32 master parameters and optimizer state) or fp32: sets "
        "the --plan space's precision= (default: the plan's own, fp32 unless it says)",
    )


def add_metrics(p: argparse.ArgumentParser) -> None:
    """The metrics directory and the eval loop's options."""
    p.add_argument(
        "--metrics-dir",
        default=None,
        metavar="DIR",
        help="write DIR/metrics.jsonl (a line per logged step: loss, grad_norm, lr, "
        "tokens/s or samples/s, MFU, per-device memory where the device reports it, "
        "checkpoint time, eval loss; appended to on --resume) and TensorBoard event files "
        "with the same scalars (tensorboard --logdir DIR)",
    )
    p.add_argument(
        "--eval-every",
        type=count,
        default=0,
        metavar="N",
        help="every N steps, the loss on --eval-batches held-out synthetic batches (seeds "
        "from 2**30, never trained on), without an update (default 0: off)",
    )
    p.add_argument(
        "--eval-batches",
        type=positive_int,
        default=4,
        metavar="K",
        help="held-out batches per eval, each of the training batch's size (default 4)",
    )


def recipe_of(args) -> Recipe:
    """The :class:`~jscaler.Recipe` that ``jscaler train``'s options ask for."""
    return Recipe(
        optimizer=args.optimizer,
        lr=args.lr,
        schedule=args.lr_schedule,
        warmup_steps=args.warmup_steps,
        steps=args.steps,
        min_lr=args.min_lr,
        clip_grad_norm=args.clip_grad_norm,
        weight_decay=args.weight_decay,
    )
