"""Shared parity machinery for the tests: run a plan and the single-device reference."""

import functools

import jax
import optax

import jscaler
import models
from jscaler.runtime.reference import compare, reference_steps, trainer_steps

LR = 0.1
STEPS = 3


def batches(spec, steps=STEPS):
    return [spec.batch(spec.batch_size, seed) for seed in range(steps)]


@functools.cache
def reference(model_name: str):
    spec = models.get(model_name)
    return reference_steps(spec.init(0), spec.loss, optax.sgd(LR), batches(spec))


def run_plan(model_name: str, plan, *, devices=8, microbatches=1, schedule=None, steps=STEPS):
    """Trains ``steps`` SGD steps under ``plan`` (a pipeline plan: with ``microbatches``
    and ``schedule``, default the plan's own or 1F1B); returns (trainer, per-step
    results)."""
    spec = models.get(model_name)
    trainer = jscaler.parallelize(
        spec.init(0),
        spec.loss,
        optax.sgd(LR),
        spec.batch(spec.batch_size, 0),
        devices=devices,
        plan=plan,
        microbatches=microbatches,
        schedule=schedule,
    )
    return trainer, trainer_steps(trainer, batches(spec, steps))


def assert_parity(model_name, plan, **kw):
    trainer, got = run_plan(model_name, plan, **kw)
    mm = compare(got, reference(model_name)[: len(got)])
    assert mm.ok, "\n".join(mm.lines[:10])
    return trainer


def leaves(tree):
    return jax.tree_util.tree_leaves(tree)
