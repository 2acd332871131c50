"""Expert parallelism (spaces/expert.py) on moe-tiny's capacity dispatch: parity with one
device, the all-to-alls and the expert weights' layout, and the errors.

Parity: 3 SGD steps on 8 simulated devices, loss, gradients and parameters against
single-device training (fp32 tolerances of jscaler.runtime.reference); the pipeline
against single-device gradient accumulation over the same micro-batches (the
load-balancing loss is per micro-batch).
"""

from __future__ import annotations

import optax
import pytest
from jax.sharding import PartitionSpec as P

import jscaler
import models
from jscaler.compile.hlo import collectives, summarize
from jscaler.runtime.reference import compare, reference_steps
from schedules import one_f_one_b
from spaces import expert
from spaces.expert import expert_axes

from parity import LR, accumulated, assert_parity, batches, leaves, run_plan

NAME = "moe-tiny"
PLANS = {
    "expert(ep=2)": expert(ep=2),
    "expert(ep=4, dp=2)": expert(ep=4, dp=2),
    "expert(ep=4, tp=2)": expert(ep=4, tp=2),
    "expert(ep=2, zero=3)": expert(ep=2, zero=3),
}


def graph_of(name: str) -> jscaler.Graph:
    spec = models.get(name)
    return jscaler.trace(spec.loss, spec.init(0), spec.batch(8, 0))


@pytest.mark.parametrize("expr", sorted(PLANS))
def test_expert_plan_matches_one_device(expr):
    trainer = assert_parity(NAME, PLANS[expr])
    hlo = summarize(collectives(trainer.compiled(models.get(NAME).batch(8, 0)).as_text(), None))
    assert "all-to-all" in hlo, f"{expr}: tokens reach their experts without an all-to-all"


@pytest.mark.slow
def test_expert_in_a_1f1b_pipeline_matches_one_device_accumulating():
    spec = models.get(NAME)
    _, got = run_plan(NAME, expert(ep=2, pp=2), microbatches=2, schedule=one_f_one_b)
    want = reference_steps(spec.init(0), accumulated(spec.loss, 2), optax.sgd(LR), batches(spec))
    mm = compare(got, want)
    assert mm.ok, "\n".join(mm.lines[:10])


def test_each_device_holds_its_own_experts():
    """Under expert(ep=4, dp=2) an expert weight is stored split 4 ways along the
    experts and a dense weight whole."""
    spec = models.get(NAME)
    trainer = jscaler.parallelize(
        spec.init(0), spec.loss, optax.sgd(LR), spec.batch(8, 0), devices=8,
        plan=expert(ep=4, dp=2),
    )  # fmt: skip
    names = [t.name for t in trainer.graph.params()]
    specs = dict(zip(names, (s.spec for s in leaves(trainer.shardings()))))
    for i in (0, 1):
        for w in ("w_gate", "w_up", "w_down"):
            assert specs[f"blocks/{i}/moe/{w}"] == P("ep"), specs[f"blocks/{i}/moe/{w}"]
        assert specs[f"blocks/{i}/attn/q_proj/kernel"] == P()
        assert specs[f"blocks/{i}/moe/router/kernel"] == P()


def test_dropless_dispatch_is_refused_naming_the_op():
    with pytest.raises(jscaler.PlanError, match=r"ragged_dot.*blocks/0/moe"):
        expert(ep=2)(graph_of("moe-tiny-dropless"), 8)


def test_a_model_without_experts_is_refused():
    with pytest.raises(jscaler.PlanError, match="has no experts"):
        expert(ep=2)(graph_of("gpt-tiny"), 8)


def test_ep_must_divide_the_experts():
    with pytest.raises(jscaler.PlanError, match="Choose ep among the divisors of 4"):
        expert(ep=8)(graph_of(NAME), 8)


def test_experts_named_by_a_glob():
    graph = graph_of(NAME)
    named = expert_axes(graph, "blocks/*/moe/w_*")
    assert {graph.tensors[t].name for t, _ in named} == {
        f"blocks/{i}/moe/{w}" for i in (0, 1) for w in ("w_gate", "w_up", "w_down")
    }
    assert sorted(named) == sorted(expert_axes(graph))
    with pytest.raises(jscaler.PlanError, match="no parameter name matches"):
        expert(ep=2, experts="nothing/*")(graph, 8)
