"""Pipelines: MPMD stages on device groups, driven by a schedule, equal to one device.

Every case trains 3 SGD steps and compares loss, gradients and updated parameters with
the single-device reference (fp32 tolerances of jscaler.runtime.reference).
"""

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jscaler
import models
from jscaler.runtime.reference import compare, reference_steps, trainer_steps
from schedules import gpipe, interleaved_1f1b, one_f_one_b, zero_bubble
from spaces import megatron

from parity import LR, batches, reference


def pipelined(model_name, plan, schedule, m, *, optimizer=None, batch_size=None):
    spec = models.get(model_name)
    size = batch_size or spec.batch_size
    return jscaler.parallelize(
        spec.init(0),
        spec.loss,
        optimizer or optax.sgd(LR),
        spec.batch(size, 0),
        devices=8,
        plan=plan,
        microbatches=m,
        schedule=schedule,
    )


def assert_pipeline_parity(model_name, plan, schedule, m):
    trainer = pipelined(model_name, plan, schedule, m)
    got = trainer_steps(trainer, batches(models.get(model_name)))
    mm = compare(got, reference(model_name)[: len(got)])
    assert mm.ok, "\n".join(mm.lines[:10])
    return trainer


GPT_CASES = [
    ("megatron(pp=2)", "gpipe", 2),  # dp=4 inside each stage
    ("megatron(tp=2, pp=2)", "one_f_one_b", 4),  # tp=2 x dp=2 inside
    ("megatron(tp=4, pp=2)", "zero_bubble", 2),
    ("megatron(tp=2, pp=4)", "gpipe", 4),
    ("megatron(pp=4)", "one_f_one_b", 4),  # dp=2 inside
    ("megatron(tp=2, pp=4)", "zero_bubble", 4),
    ("megatron(tp=2, pp=2)", "interleaved_1f1b", 4),  # 4 virtual stages on 2 groups
    ("megatron(pp=2)", "interleaved_1f1b", 2),
]
SLOW = {("megatron(tp=2, pp=4)", "gpipe", 4), ("megatron(pp=2)", "interleaved_1f1b", 2)}
SCHEDULE = {
    "gpipe": gpipe,
    "one_f_one_b": one_f_one_b,
    "zero_bubble": zero_bubble,
    "interleaved_1f1b": interleaved_1f1b,
}


@functools.cache
def gpt_trainer(expr, schedule, m):
    return assert_pipeline_parity("gpt-tiny", eval(expr), SCHEDULE[schedule], m)


@pytest.mark.parametrize(
    "expr, schedule, m",
    [pytest.param(*c, marks=[pytest.mark.slow] if c in SLOW else []) for c in GPT_CASES],
)
def test_gpt_tiny_pipeline_matches_one_device(expr, schedule, m):
    trainer = gpt_trainer(expr, schedule, m)
    sched = trainer.program.schedule
    # the driver ran exactly the schedule, group by group, in its order
    assert [tuple(g) for g in trainer.program.log.blocks] == [tuple(g) for g in sched.groups]
    # and held the activations the schedule says (until W for a split backward)
    release = "W" if sched.split_backward else "B"
    assert trainer.program.log.in_flight == sched.in_flight(release)


def test_in_flight_activations_m_for_gpipe_at_most_p_for_1f1b():
    assert gpt_trainer("megatron(pp=2)", "gpipe", 2).program.log.in_flight == [2, 2]
    assert gpt_trainer("megatron(tp=2, pp=4)", "zero_bubble", 4).program.log.in_flight[0] <= 4
    one = gpt_trainer("megatron(pp=4)", "one_f_one_b", 4)
    assert one.program.log.in_flight == [4, 3, 2, 1]  # p - s: stage s waits for p - s - 1 others


def test_stages_are_balanced_layers_with_the_embedding_first_and_head_last():
    trainer = gpt_trainer("megatron(pp=4)", "one_f_one_b", 4)
    names = [{trainer.graph.tensors[t].name for t in st.params} for st in trainer.program.stages]
    assert "embed/embedding" in names[0] and "lm_head/kernel" in names[3]
    for s in range(4):
        assert {n.split("/")[1] for n in names[s] if n.startswith("blocks/")} == {str(s)}
    assert [st.batch != [] for st in trainer.program.stages] == [True, False, False, True]


@pytest.mark.parametrize("model_name", ["mlp-tiny", "convnet-tiny"])
def test_models_without_repeated_layers_cut_by_flops(model_name):
    trainer = assert_pipeline_parity(model_name, megatron(pp=2), one_f_one_b, 4)
    flops = [sum(o.flops for o in st.ops) for st in trainer.program.stages]
    assert all(f > 0 for f in flops)


def test_explicit_cuts_and_a_custom_schedule_function():
    spec = models.get("gpt-tiny")  # plans are made for the graph of one micro-batch
    graph = jscaler.trace(spec.loss, spec.init(0), spec.batch(spec.batch_size // 4, 0))
    first_block_2 = next(o.id for o in graph.ops if o.path.startswith("blocks/2"))
    inner = megatron(tp=2)(graph, 4)
    groups = (jscaler.StageGroup(range(4), inner), jscaler.StageGroup(range(4, 8), inner))
    plan = jscaler.PipelinePlan(groups, "two halves", cuts=(first_block_2,))

    def forwards_then_backwards_reversed(p, m):  # a user's own: GPipe, backwards 3..0
        groups = [
            [jscaler.Block(s, i, "F") for i in range(m)]
            + [jscaler.Block(s, i, "B") for i in reversed(range(m))]
            for s in range(p)
        ]
        return jscaler.Schedule("reversed", p, m, groups, tuple(range(p)))

    trainer = pipelined("gpt-tiny", plan, forwards_then_backwards_reversed, 4)
    got = trainer_steps(trainer, batches(spec))
    mm = compare(got, reference("gpt-tiny"))
    assert mm.ok, "\n".join(mm.lines[:10])
    stage1 = {trainer.graph.tensors[t].name for t in trainer.program.stages[1].params}
    assert "blocks/2/attn/q_proj/kernel" in stage1
    assert not any(n.startswith("blocks/1/") for n in stage1)


# ---- tied parameters and whole-tree optimizers ----------------------------------------


def tied_loss(params, batch):
    """A 4-layer MLP whose input projection is reused, transposed, as its output."""
    h = jnp.tanh(batch["x"] @ params["w_in"])
    for w in params["hidden"]:
        h = jnp.tanh(h @ w)
    out = h @ params["w_in"].T
    return jnp.mean((out - batch["y"]) ** 2)


def tied_setup():
    k = jax.random.split(jax.random.key(0), 5)
    params = {
        "w_in": jax.random.normal(k[0], (16, 32)) * 0.3,
        "hidden": [jax.random.normal(k[i], (32, 32)) * 0.2 for i in range(1, 5)],
    }
    rng = np.random.default_rng(0)
    data = [
        {"x": rng.normal(size=(16, 16)).astype("f4"), "y": rng.normal(size=(16, 16)).astype("f4")}
        for _ in range(3)
    ]
    return params, data


@pytest.mark.parametrize(
    "optimizer",
    [optax.sgd(LR), optax.chain(optax.clip_by_global_norm(0.05), optax.sgd(LR))],
    ids=["sgd", "clip_by_global_norm"],
)
def test_tied_weight_lives_on_both_stages_and_its_gradients_are_summed(optimizer):
    params, data = tied_setup()
    trainer = jscaler.parallelize(
        params, tied_loss, optimizer, data[0], devices=8, plan=megatron(pp=2), microbatches=4
    )
    w_in = next(t for t in trainer.graph.inputs if trainer.graph.tensors[t].name == "w_in")
    assert [w_in in st.params for st in trainer.program.stages] == [True, True]
    want = reference_steps(params, tied_loss, optimizer, data)
    mm = compare(trainer_steps(trainer, data), want)
    assert mm.ok, "\n".join(mm.lines[:10])


# ---- bad input ------------------------------------------------------------------------


def test_a_schedule_missing_a_block_names_it():
    full = one_f_one_b(2, 4)
    groups = [list(g) for g in full.groups]
    groups[1].remove(jscaler.Block(1, 2, "B"))
    broken = jscaler.Schedule("mine", 2, 4, groups, full.placement)
    with pytest.raises(jscaler.ScheduleError, match=r"missing 1 block\(s\): B1.2"):
        pipelined("mlp-tiny", megatron(pp=2), broken, 4)


def test_a_deadlocking_schedule_names_the_blocked_blocks():
    groups = [
        [jscaler.Block(0, 0, "F"), jscaler.Block(0, 0, "B")],
        [jscaler.Block(1, 0, "B"), jscaler.Block(1, 0, "F")],  # B before its own F
    ]
    bad = jscaler.Schedule("backwards-first", 2, 1, groups, (0, 1))
    with pytest.raises(jscaler.ScheduleError, match="deadlocks.*group 1 waits at B1.0 for F1.0"):
        pipelined("mlp-tiny", megatron(pp=2), bad, 1)


def test_microbatches_must_divide_the_batch():
    with pytest.raises(jscaler.PlanError, match="must split into 3 micro-batches"):
        pipelined("mlp-tiny", megatron(pp=2), one_f_one_b, 3)


def test_a_stage_on_a_device_that_does_not_exist():
    spec = models.get("mlp-tiny")
    graph = jscaler.trace(spec.loss, spec.init(0), spec.batch(spec.batch_size // 2, 0))
    inner = jscaler.data_parallel(graph, 4)
    plan = jscaler.PipelinePlan(
        (jscaler.StageGroup(range(4), inner), jscaler.StageGroup(range(6, 10), inner))
    )
    with pytest.raises(jscaler.PlanError, match="group 1 places stages on device 8, but the"):
        pipelined("mlp-tiny", plan, one_f_one_b, 2)


def test_schedule_and_plan_must_agree():
    with pytest.raises(jscaler.ScheduleError, match="runs on 4 device groups; the plan"):
        pipelined("mlp-tiny", megatron(pp=2), one_f_one_b(4, 2), 2)
    with pytest.raises(jscaler.ScheduleError, match="runs 4 micro-batches but microbatches=2"):
        pipelined("mlp-tiny", megatron(pp=2), one_f_one_b(2, 4), 2)
    with pytest.raises(jscaler.PlanError, match="schedule= orders pipeline stages"):
        pipelined("mlp-tiny", megatron(tp=1), one_f_one_b, 2)
    with pytest.raises(jscaler.PlanError, match="cannot cut the graph into 16 stages"):
        pipelined("mlp-tiny", megatron(pp=8), interleaved_1f1b, 8)


# ---- interlaced: the embedding over every device, 1F1B stages on the rest -------------


def test_interlaced_embedding_over_all_devices_matches_one_device():
    from schedules import interlaced as interlaced_schedule
    from spaces import interlaced

    plan = interlaced(pp=2, tp=2, head=False)
    trainer = assert_pipeline_parity("gpt-tiny", plan, interlaced_schedule, 4)
    embed, first, last = trainer.program.stages
    assert len(embed.low.mesh.devices.flat) == 8 and embed.group == 2
    assert [trainer.graph.tensors[t].name for t in embed.params] == ["embed/embedding"]
    (table,) = embed.params
    assert embed.sharding(table).spec[0] == "tp"  # vocabulary split 8 ways
    assert {d.id for d in first.low.mesh.devices.flat} == {0, 1, 2, 3}
    assert [tuple(g) for g in trainer.program.log.blocks] == [
        tuple(g) for g in trainer.program.schedule.groups
    ]


def test_an_interlaced_plan_needs_the_interlaced_schedule():
    from spaces import interlaced

    with pytest.raises(jscaler.ScheduleError, match="needs the interlaced schedule"):
        pipelined("gpt-tiny", interlaced(pp=2, tp=4), one_f_one_b, 4)


def test_a_stage_forward_returns_no_copy_of_its_weights():
    """The residuals that are a forward's own inputs (a matmul's weight, kept for the
    input gradient) are held by the driver, not returned: returned from the program each
    would be a copy per micro-batch in flight."""
    trainer = pipelined("gpt-tiny", megatron(tp=2, pp=2), one_f_one_b, 2)
    stage = trainer.program.driver.programs[0]
    calls = []
    forward_res = stage.forward_res

    def recorded(*args):
        calls.append((args, forward_res(*args)))
        return calls[-1][1]

    stage.forward_res = recorded  # shadows the cached program on this trainer only
    trainer.step(models.get("gpt-tiny").batch(models.get("gpt-tiny").batch_size, 0))
    (params, *_), (_, kept) = calls[0]
    held = stage.held(calls[0][0])
    weights = [w for w in params if w.ndim == 2]
    assert any(h is w for h in held for w in weights), "no weight is handed to the backward"
    copies = [
        k.shape
        for k in kept
        for w in weights
        if k.shape == w.shape and np.array_equal(np.asarray(k), np.asarray(w))
    ]
    assert not copies, f"the forward returned copies of weights shaped {copies}"


@pytest.mark.parametrize("schedule", [one_f_one_b, zero_bubble], ids=["1f1b", "zero-bubble"])
def test_a_stage_backward_adds_into_its_donated_gradient_sum(schedule):
    """Past the first micro-batch, a stage's backward (zero-bubble's W) takes the sum of
    the earlier gradients donated and returns the new sum in its place: the driver holds
    one accumulator per stage, never the old sum, the new gradients and their sum; and
    that accumulator is split over the stage's devices."""
    trainer = pipelined("mlp-tiny", megatron(pp=2), schedule, 4)
    stage = trainer.program.driver.stages[1]
    kind = "backward_weight" if schedule is zero_bubble else "backward"
    program = getattr(stage, kind)
    calls = []

    def recorded(acc, *args):
        out = program(acc, *args)
        calls.append((acc, out, program.lower(acc, *args).compile().memory_analysis()))
        return out

    setattr(stage, kind, recorded)  # shadows the cached program on this trainer only
    spec = models.get("mlp-tiny")
    trainer.step(spec.batch(spec.batch_size, 0))
    assert [acc is None for acc, *_ in calls] == [True, False, False, False]
    for acc, out, memory in calls[1:]:
        assert all(a.is_deleted() for a in acc), "the accumulator was copied, not donated"
        grads = out[0] if kind == "backward" else out
        local = sum(math.prod(g.sharding.shard_shape(g.shape)) * g.dtype.itemsize for g in grads)
        assert memory.alias_size_in_bytes == local
        # the sum is split over the stage's 4 data-parallel devices (each micro-batch's
        # gradient reduce-scattered into it), not held whole on each
        assert local * 4 == sum(g.nbytes for g in grads)
