"""Recycling models (AlphaFold2's loop) under the 3F1B schedule, equal to one device.

``recycler-tiny`` runs its trunk three times per step, the first two passes under
``stop_gradient``. The pipeline finds the passes in the traced graph, cuts each into the
same stages and runs ``F(s, m, k)`` as pass k of stage s.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import optax
import pytest
from flax import nnx

import jscaler
import models
from jscaler.errors import PlanError
from jscaler.plan.pipeline import pass_of_ops
from jscaler.search import StagedILP
from models import recycler
from schedules import one_f_one_b, table7_3f1b, three_f_one_b
from spaces import megatron

from parity import LR, assert_parity

CASES = [
    ("megatron(pp=2)", 2),  # dp=4 inside each stage
    ("megatron(tp=2, pp=2)", 4),  # tp=2 x dp=2 inside
    ("megatron(pp=4)", 4),
]


@functools.cache
def trained(expr, m, schedule=three_f_one_b):
    return assert_parity("recycler-tiny", eval(expr), microbatches=m, schedule=schedule)


@pytest.mark.parametrize(
    "expr, m",
    [pytest.param(*c, marks=[pytest.mark.slow] if c[0].endswith("4)") else []) for c in CASES],
)
def test_three_f_one_b_on_a_recycling_model_matches_one_device(expr, m):
    trainer = trained(expr, m)
    sched = trainer.program.schedule
    assert sched.passes == 3
    assert [tuple(g) for g in trainer.program.log.blocks] == [tuple(g) for g in sched.groups]
    # three forwards per micro-batch on every stage, one backward
    for g in trainer.program.log.blocks:
        kinds = [b.kind for b in g]
        assert kinds.count("F") == 3 * m and kinds.count("B") == m
    # only the last pass keeps activations: 1F1B's memory, p - s on stage s
    p = len(sched.groups)
    assert trainer.program.log.in_flight == sched.in_flight() == [p - s for s in range(p)]


def test_every_pass_is_cut_into_the_same_stages():
    trainer = trained("megatron(pp=2)", 2)
    programs = trainer.program.driver.programs
    assert [(st.pass_, st.stage) for st in programs] == [(k, s) for k in range(3) for s in range(2)]
    names = [{trainer.graph.tensors[t].name for t in st.params} for st in trainer.program.stages]
    assert any(n.startswith("blocks/0/") for n in names[0])
    assert not any(n.startswith("blocks/0/") for n in names[1])
    for st in programs:
        paths = {o.path.split("/")[1] for o in st.ops if o.path.startswith("blocks/")}
        assert paths == ({"0", "1"} if st.stage == 0 else {"2", "3"}), (st.pass_, st.stage)
    # passes 1 and 2 start from the previous pass's output, taken without a gradient
    assert [bool(st.frozen) for st in programs] == [False, False, True, False, True, False]
    # the head runs once, in the last pass
    heads = [st for st in programs if any(o.path.startswith("head") for o in st.ops)]
    assert [(st.pass_, st.stage) for st in heads] == [(2, 1)]


def test_a_one_pass_schedule_also_trains_a_recycling_model():
    trainer = trained("megatron(pp=2)", 2, one_f_one_b)
    assert len(trainer.program.driver.programs) == 2


def test_a_recycling_model_cut_among_its_runs_trains_like_one_device():
    trainer = trained("StagedILP(2, microbatches=2, cache=False)", 2, one_f_one_b)
    (cut,) = trainer.program.plan.cuts  # the stage DP's, past the first pass
    assert pass_of_ops(graph_of(recycler.loss), 3)[cut] >= 1


def graph_of(loss):
    cfg = recycler.tiny()
    model = recycler.Recycler(cfg, rngs=nnx.Rngs(0))
    return jscaler.trace(loss, model, recycler.synthetic_batch(cfg, 4))


def test_passes_are_separated_by_stop_gradient():
    graph = graph_of(recycler.loss)
    pass_of = pass_of_ops(graph, 3)
    count = [sum(k == p for k in pass_of.values()) for p in range(3)]
    # passes 0 and 1 are the same trunk; the last adds the head and the loss
    assert count[0] == count[1] < count[2]
    assert set(pass_of_ops(graph, 1).values()) == {0}
    # values only flow forward in pass order
    made = {t: pass_of[o.id] for o in graph.ops for t in o.outputs}
    for o in graph.ops:
        assert all(made.get(x, 0) <= pass_of[o.id] for x in o.tensor_inputs)


def test_a_stop_gradient_inside_the_loss_stays_in_the_last_pass():
    def loss(model, batch):  # log-sum-exp takes stop_gradient(max) of the logits
        return jnp.mean(jax.nn.logsumexp(model(batch["x"]), axis=-1))

    graph = graph_of(loss)
    pass_of = pass_of_ops(graph, 3)
    last = [o for o in graph.ops if pass_of[o.id] == 2]
    assert sum(o.primitive == "stop_gradient" for o in last) >= 2  # the recycle one + max
    assert any(o.primitive == "reduce_max" for o in last)


def test_a_model_that_does_not_recycle_is_refused_by_three_f_one_b():
    spec = models.get("gpt-tiny")
    with pytest.raises(PlanError, match=r"forward pass 0 of this graph has no ops"):
        jscaler.parallelize(
            spec.init(0),
            spec.loss,
            optax.sgd(LR),
            spec.batch(spec.batch_size, 0),
            devices=8,
            plan=megatron(pp=2),
            microbatches=2,
            schedule=three_f_one_b,
        )


def test_table7_constraints_train_the_recycling_model():
    trainer = trained("megatron(tp=2, pp=2)", 4, table7_3f1b)
    assert [tuple(g) for g in trainer.program.log.blocks] == [
        tuple(g) for g in trainer.program.schedule.groups
    ]
    assert trainer.program.log.in_flight == [2, 1]


def test_zero3_prefetch_leaves_recycled_layers_alone():
    # a layer's ops in every pass form one Graph.layers() entry; prefetching its gathers
    # at the first pass would read values of later passes
    from spaces import zero

    assert_parity("recycler-tiny", zero(stage=3))


def test_stage_slicing_cuts_a_recycling_model_among_its_runs():
    """A cut places ops by execution order, so the stage DP cuts a recycling model among
    its layers' runs (one per layer per pass, each priced on its own: passes 0 and 1 run
    forward only). Cutting between layers counted once per pass, as it did, put the cut in
    the first pass and left the other passes to the last stage."""
    from jscaler.cost import estimate_pipeline
    from jscaler.search import layer_costs

    cfg = recycler.tiny()
    graph = graph_of(recycler.loss)
    plan = StagedILP(2, microbatches=4, cache=False)(graph, 4)
    runs = layer_costs(plan.groups[0].plan)
    firsts, costs = [f for f, _ in runs], [c for _, c in runs]
    pass_of = pass_of_ops(graph, cfg.passes)
    each = [k for k in range(cfg.passes) for _ in range(cfg.n_layers)]
    assert [pass_of[f] for f in firsts] == each
    assert firsts == sorted(firsts) and costs[0] < costs[-1]  # forward only < trained
    (cut,) = plan.cuts
    k = firsts.index(cut)

    def slowest(j):  # the slower stage's cost with the cut before run j
        return max(sum(costs[:j]), sum(costs[j:]))

    assert slowest(k) <= min(slowest(j) for j in range(1, len(runs)))
    assert pass_of[cut] >= 1
    once = dataclasses.replace(plan, cuts=(firsts[2],))  # the cut between layers once
    assert (
        estimate_pipeline(plan, microbatches=4).step_time
        < estimate_pipeline(once, microbatches=4).step_time
    )
