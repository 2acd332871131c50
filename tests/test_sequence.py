"""Sequence parallelism spaces: parity with one device and the collectives they imply.

Parity: SGD, 3 steps; loss, gradients and updated params per leaf within the fp32
tolerance of ``jscaler.runtime.reference`` (rtol 1e-5; atol 1e-5*max|g|, 1e-6*max|p|).
"""

import jax
import optax
import pytest
from jax.sharding import PartitionSpec as P

import jscaler
import models
from jscaler.compile.hlo import collectives, summarize
from spaces import ring, ulysses, usp
from spaces.sequence import USP, Ring, Ulysses

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


@pytest.mark.parametrize(
    "plan",
    [ring(sp=4), ring(sp=8), ring(sp=2, dp=4), usp(ulysses=2, ring=2), usp(ulysses=2, ring=4)],
    ids=str,
)
def test_ring_and_usp_match_one_device(plan):
    assert_parity("gpt-tiny", plan)


def test_ring_passes_key_value_blocks_and_never_gathers_the_sequence():
    spec = models.get("gpt-tiny")
    trainer, _ = run_plan("gpt-tiny", ring(sp=4), steps=1)
    assert [r.kind for r in trainer.plan.regions] == ["ring_attention"] * 4
    kinds = summarize(collectives(trainer.hlo(spec.batch(8, 0)), trainer.plan.mesh.axes))
    # 4 layers x (sp-1) hops x (k, v) x (forward, backward)
    assert kinds["collective-permute"][0] == 4 * 3 * 2 * 2
    assert "all-gather" not in kinds and "all-to-all" not in kinds


def test_usp_trades_the_minor_sequence_split_for_heads_with_one_all_to_all_each_way():
    spec = models.get("gpt-tiny")
    trainer, _ = run_plan("gpt-tiny", usp(ulysses=2, ring=2), steps=1)
    kinds = summarize(collectives(trainer.hlo(spec.batch(8, 0)), trainer.plan.mesh.axes))
    assert kinds["all-to-all"][0] == 4 * 4 * 2  # q, k, v in and out, per layer, each way
    assert kinds["collective-permute"][0] == 4 * 1 * 2 * 2
    assert "all-gather" not in kinds


def test_a_ring_region_round_trips_through_json():
    spec = models.get("gpt-tiny")
    graph = jscaler.trace(spec.loss, spec.init(0), spec.batch(8, 0))
    plan = ring(sp=4)(graph, 8)
    again = jscaler.Plan.from_json(plan.to_json(), graph)
    assert again == plan and again.regions == plan.regions


def test_a_manual_region_that_is_not_an_attention_is_a_clear_error():
    spec = models.get("gpt-tiny")
    graph = jscaler.trace(spec.loss, spec.init(0), spec.batch(8, 0))
    plan = ulysses(sp=4)(graph, 8)
    mlp = graph.select("blocks/0/mlp/*")
    plan, _ = jscaler.op_trans(plan, mlp, jscaler.manual("ring_attention", "sp"))
    with pytest.raises(jscaler.LayoutError, match="blocks/0/mlp.*holds 0 attentions"):
        jscaler.parallelize(
            spec.init(0), spec.loss, optax.sgd(0.1), spec.batch(8, 0), devices=8, plan=plan
        )
    with pytest.raises(jscaler.PlanError, match="has no axis 'ring'"):
        jscaler.op_trans(plan, mlp, jscaler.manual("ring_attention", "ring"))


@pytest.mark.parametrize("model", ["mlp-tiny", "convnet-tiny"])
def test_ring_needs_an_attention(model):
    with pytest.raises(jscaler.PlanError, match="found no attention to run as a ring"):
        run_plan(model, ring(sp=2), steps=1)


@pytest.mark.parametrize(
    "plan",
    [
        ulysses(sp=4, zero=3),
        ring(sp=2, dp=4, zero=1),
        usp(ulysses=2, ring=2, zero=2),
        ring(sp=4, recompute=0.5),
    ],
    ids=str,
)
def test_sequence_parallelism_combines_with_zero_and_recompute(plan):
    trainer = assert_parity("gpt-tiny", plan)
    if plan.zero == 3:  # weights stored split over dp, replicated over sp
        specs = {sh.spec for sh in jax.tree_util.tree_leaves(trainer.shardings())}
        assert P("dp") in specs or P(None, "dp") in specs


def test_zero_needs_a_data_parallel_axis():
    with pytest.raises(jscaler.PlanError, match="shards over the 'dp' axis, which has 1"):
        run_plan("gpt-tiny", ring(sp=8, zero=1), steps=1)


@pytest.mark.parametrize(
    "space", [USP(ulysses="2", ring=2), USP(ulysses=2, ring="2"), Ring(sp="2"), Ulysses(sp=2.0)]
)
def test_a_sequence_space_refuses_a_degree_that_is_not_an_int(space):
    with pytest.raises(jscaler.PlanError, match=r"must be a positive int, got"):
        space(None, 8)  # checked before the graph is read
