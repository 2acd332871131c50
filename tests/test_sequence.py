"""Sequence parallelism spaces: parity with one device and the collectives they imply.

Parity: SGD, 3 steps; loss, gradients and updated params per leaf within the fp32
tolerance of ``jscaler.runtime.reference`` (rtol 1e-5; atol 1e-5*max|g|, 1e-6*max|p|).
"""

import jax
import pytest
from jax.sharding import PartitionSpec as P

import jscaler
import models
from jscaler.compile.hlo import collectives, summarize
from spaces import ulysses

from parity import assert_parity, run_plan


@pytest.mark.parametrize("plan", [ulysses(sp=4), ulysses(sp=2, dp=4)], ids=str)
def test_ulysses_matches_one_device(plan):
    assert_parity("gpt-tiny", plan)


def test_ulysses_switches_layouts_with_all_to_alls_and_splits_no_weight():
    spec = models.get("gpt-tiny")
    trainer, _ = run_plan("gpt-tiny", ulysses(sp=4), steps=1)
    kinds = summarize(collectives(trainer.hlo(spec.batch(8, 0))))
    assert kinds.get("all-to-all", (0, 0))[0] >= 4 * 4  # q, k, v in and out, per layer
    assert "all-gather" not in kinds  # no activation is gathered whole
    specs = {sh.spec for sh in jax.tree_util.tree_leaves(trainer.shardings())}
    assert specs == {P()}  # parameters replicated


@pytest.mark.parametrize(
    "model, plan, message",
    [
        ("gpt-tiny", ulysses(sp=8), "has 4 heads, which 8 does not divide"),
        ("mlp-tiny", ulysses(sp=2), "no attention"),
        ("convnet-tiny", ulysses(sp=2), "no attention"),
    ],
)
def test_ulysses_says_why_it_does_not_apply(model, plan, message):
    with pytest.raises(jscaler.PlanError, match=message):
        run_plan(model, plan, steps=1)
