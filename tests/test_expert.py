"""Expert parallelism (spaces/expert.py) on moe-tiny's two dispatch styles: parity with one
device, the all-to-alls (capacity), the experts' ragged_dots split along their groups
(dropless), the expert weights' layout, and the errors.

Parity: 3 SGD steps on 8 simulated devices, loss, gradients and parameters against
single-device training (fp32 tolerances of jscaler.runtime.reference); the pipeline
against single-device gradient accumulation over the same micro-batches (the
load-balancing loss is per micro-batch).
"""

from __future__ import annotations

import json
import math

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
DROPLESS = "moe-tiny-dropless"
PLANS = {
    "expert(ep=2)": expert(ep=2),
    "expert(ep=4, dp=2)": expert(ep=4, dp=2),
    "expert(ep=4, tp=2)": expert(ep=4, tp=2),
    "expert(ep=2, zero=3)": expert(ep=2, zero=3),
    "expert(ep=4, dp=2, zero=3)": expert(ep=4, dp=2, zero=3),
    "expert(ep=2, zero=1)": expert(ep=2, zero=1),
}


def graph_of(name: str) -> jscaler.Graph:
    spec = models.get(name)
    return jscaler.trace(spec.loss, spec.init(0), spec.batch(8, 0))


@pytest.mark.parametrize("expr", sorted(PLANS))
def test_expert_plan_matches_one_device(expr):
    trainer = assert_parity(NAME, PLANS[expr])
    hlo = summarize(collectives(trainer.compiled(models.get(NAME).batch(8, 0)).as_text(), None))
    assert "all-to-all" in hlo, f"{expr}: tokens reach their experts without an all-to-all"


def group_splits(plan) -> list[int]:
    """Per ragged_dot of the plan: how many ways its pieces split the rhs group dim (the
    experts; moe.py stacks them on axis 0)."""
    out = []
    for op in plan.graph.ops:
        if op.primitive == "ragged_dot_general":
            group = op.annotation.inputs[1][0][0]
            ways, stack = 1, [plan.tree(op.id)]
            while stack:
                node = stack.pop()
                if node.algo == "split" and node.dim == group:
                    ways *= len(node.children)
                stack.extend(node.children[:1])
            out.append(ways)
    return out


@pytest.mark.parametrize("expr", sorted(PLANS))
def test_dropless_expert_plan_matches_one_device(expr):
    """Dropless dispatch is exact: every device multiplies all the sorted rows by its
    own experts (ragged_dot split along its groups: partial sums, zero rows for the other
    experts' tokens), and the partial results are summed over ep."""
    trainer = assert_parity(DROPLESS, PLANS[expr])
    ep = trainer.plan.mesh.shape["ep"]
    assert group_splits(trainer.plan) == [ep] * 6, group_splits(trainer.plan)
    hlo = trainer.compiled(models.get(DROPLESS).batch(8, 0)).as_text()
    found = {(c.kind, c.axes) for c in collectives(hlo, trainer.plan.mesh.axes)}
    assert any(kind == "all-reduce" and "ep" in axes for kind, axes in found), found


@pytest.mark.slow
@pytest.mark.parametrize("name", [NAME, DROPLESS])
def test_expert_in_a_1f1b_pipeline_matches_one_device_accumulating(name):
    spec = models.get(name)
    _, got = run_plan(name, expert(ep=2, pp=2), microbatches=2, schedule=one_f_one_b)
    want = reference_steps(spec.init(0), accumulated(spec.loss, 2), optax.sgd(LR), batches(spec))
    mm = compare(got, want)
    assert mm.ok, "\n".join(mm.lines[:10])


@pytest.mark.parametrize("name", [NAME, DROPLESS])
def test_each_device_holds_its_own_experts(name):
    """Under expert(ep=4, dp=2) an expert weight is stored split 4 ways along the
    experts and a dense weight whole."""
    spec = models.get(name)
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


@pytest.mark.parametrize("name", [NAME, DROPLESS])
def test_zero_shards_dense_weights_over_dp_x_ep_and_experts_over_dp(name):
    """ZeRO over every device that replicates a weight: under expert(ep=4, dp=2, zero=3) a
    dense weight (read whole by all 8 devices) is stored and updated in 8 shards over dp x
    ep, an expert weight (already split over ep) in 8 shards: its experts over ep, each
    expert's rows over dp. zero=1 leaves the storage as it was and shards the optimizer
    state the same way."""
    spec = models.get(name)
    for stage in (1, 3):
        trainer = jscaler.parallelize(
            spec.init(0), spec.loss, optax.adam(1e-3), spec.batch(8, 0), devices=8,
            plan=expert(ep=4, dp=2, zero=stage),
        )  # fmt: skip
        state = trainer.program.shardings()
        params = {t.name: t for t in trainer.graph.params()}
        names = list(params)
        stored = dict(zip(names, leaves(state.params), strict=True))
        mu = dict(zip(names, leaves(state.opt_state[0].mu), strict=True))  # adam's first moment
        for i in (0, 1):
            dense = f"blocks/{i}/attn/q_proj/kernel"
            expert_weight = f"blocks/{i}/moe/w_up"
            for table in (mu, stored) if stage == 3 else (mu,):
                assert table[dense].spec == P("dp", "ep"), (stage, table[dense].spec)
                assert table[expert_weight].spec == P("ep", "dp"), table[expert_weight]
            for w in (dense, f"blocks/{i}/moe/router/kernel", expert_weight):
                whole = params[w].shape
                local = mu[w].shard_shape(whole)
                assert math.prod(whole) == 8 * math.prod(local), (w, whole, local)
        if stage == 1:
            assert stored["blocks/0/attn/q_proj/kernel"].spec == P()
            assert stored["blocks/0/moe/w_up"].spec == P("ep")


def test_zero_without_dp_shards_the_dense_weights_over_ep():
    plan = expert(ep=4, tp=2, zero=1)(graph_of(NAME), 8)  # dp=1: ZeRO over ep alone
    assert plan.mesh.shape == {"dp": 1, "ep": 4, "tp": 2}


def test_a_model_without_experts_is_refused():
    with pytest.raises(jscaler.PlanError, match="has no experts"):
        expert(ep=2)(graph_of("gpt-tiny"), 8)


@pytest.mark.parametrize("name", [NAME, DROPLESS])
def test_ep_must_divide_the_experts(name):
    with pytest.raises(jscaler.PlanError, match="Choose ep among the divisors of 4"):
        expert(ep=8)(graph_of(name), 8)


@pytest.mark.parametrize("name", [NAME, DROPLESS])
def test_experts_named_by_a_glob(name):
    """Found from the graph (a matmul's batch dim; a ragged_dot's group dim) or named:
    the same weights."""
    graph = graph_of(name)
    named = expert_axes(graph, "blocks/*/moe/w_*")
    assert {graph.tensors[t].name for t, _ in named} == {
        f"blocks/{i}/moe/{w}" for i in (0, 1) for w in ("w_gate", "w_up", "w_down")
    }
    assert sorted(named) == sorted(expert_axes(graph))
    with pytest.raises(jscaler.PlanError, match="no parameter name matches"):
        expert(ep=2, experts="nothing/*")(graph, 8)


@pytest.mark.parametrize("name, grows", [(DROPLESS, True), (NAME, False)])
def test_expert_skew_slows_dropless_experts_only(name, grows):
    """The busiest ep device's rows set a dropless step (its ragged_dots wait for it, up to
    all rows on one device: skew ep); a capacity dispatch's expert matmuls have a fixed
    size, so skew changes what it drops, not its time."""
    plan = expert(ep=4, dp=2)(graph_of(name), 8)
    compute = [jscaler.estimate(plan, "h100_sxm", expert_skew=s).compute for s in (1, 1.5, 2, 4, 8)]
    if grows:
        assert compute[0] < compute[1] < compute[2] < compute[3], compute
        assert compute[3] == compute[4], "a device cannot hold more than every row"
    else:
        assert compute == [compute[0]] * 5, compute
    with pytest.raises(jscaler.PlanError, match="expert_skew must be a number >= 1"):
        jscaler.estimate(plan, "h100_sxm", expert_skew=0.5)


def test_expert_skew_reaches_a_pipelines_estimate_and_the_cli(capsys):
    """A trainer's estimate (here a 2-stage pipeline of expert stages) and ``jscaler plan
    --expert-skew`` take the skew as jscaler.estimate does."""
    from jscaler.cli import main

    trainer, _ = run_plan(DROPLESS, expert(ep=2, pp=2), microbatches=2, steps=0)
    times = [trainer.estimate("h100_sxm", expert_skew=s).compute for s in (1, 2)]
    assert times[0] < times[1], times
    steps = []
    for skew in ("1", "2"):
        argv = ["plan", "--model", DROPLESS, "--plan", "expert(ep=4, dp=2)", "--devices", "8"]
        assert main([*argv, "--cluster", "h100_sxm", "--expert-skew", skew, "--json"]) == 0
        steps.append(json.loads(capsys.readouterr().out)["plans"][0]["step_ms"])
    assert steps[0] < steps[1], steps
    with pytest.raises(SystemExit):
        main([*argv, "--expert-skew", "0.5"])
    assert "--expert-skew: must be at least 1" in capsys.readouterr().err


def test_dropless_dp_moves_no_more_than_plain_dp():
    """The rows sorted by expert are a permutation of the tokens, not aligned with them:
    dp() leaves what runs on them whole, as GSPMD does given the replicated sort, rather
    than splitting it by the batch and gathering it back for every ragged_dot (which
    moved 2x plain dp's collective bytes)."""
    import jax
    from flax import nnx
    from jax.sharding import AxisType, NamedSharding

    from spaces import dp

    spec = models.get(DROPLESS)
    batch = spec.batch(spec.batch_size, 0)
    trainer, _ = run_plan(DROPLESS, dp(), steps=0)
    mesh = trainer.plan.mesh.axes
    ours = sum(c.bytes for c in collectives(trainer.hlo(batch), mesh))

    graphdef, params = nnx.split(spec.init(0))
    plain_mesh = jax.make_mesh((8,), ("dp",), axis_types=(AxisType.Auto,))

    def sgd(p, b):
        grads = jax.grad(lambda q: spec.loss(nnx.merge(graphdef, q), b))(p)
        return jax.tree.map(lambda w, g: w - LR * g, p, grads)

    compiled = (
        jax.jit(sgd)
        .lower(
            jax.device_put(params, NamedSharding(plain_mesh, P())),
            jax.device_put(batch, NamedSharding(plain_mesh, P("dp"))),
        )
        .compile()
    )
    plain = sum(c.bytes for c in collectives(compiled.as_text(), (("dp", 8),)))
    assert ours <= 1.05 * plain, (ours, plain)
