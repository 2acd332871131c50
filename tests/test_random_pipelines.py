"""Random pipelines: stage counts, cuts, device groups (of unequal sizes too) with their
own plans, micro-batch counts and schedules, each trains equal to one device or raises a
JscalerError, never another exception.

A pipeline here is a :class:`jscaler.PipelinePlan` of 1 to 4 device groups on up to 8
devices, each group's plan data parallelism, Megatron, ZeRO or a random primitive plan
(test_random_plans.random_plan on the group's mesh); 1 or 2 stages per group (stage s on
group s mod p, or anywhere); balanced or random cuts. Its schedule is one of
``schedules`` (gpipe, 1F1B, zero bubble, interleaved 1F1B), a custom :class:`Schedule`
(a random order of the step's blocks that data dependencies allow, with a split backward
or recomputed forwards sometimes), or op_order constraints expanded by
:func:`jscaler.order_schedule` (a random valid order's, or random ones that may form a
cycle).

New pipelines every run (the seed is in pytest's header; see randomised.py). Per run:
``JSCALER_RANDOM_PIPELINE_EXAMPLES`` (default 70) on mlp-tiny and
``JSCALER_RANDOM_GPT_PIPELINE_EXAMPLES`` (default 10) on gpt-tiny.
"""

import functools

import optax
import pytest
from hypothesis import given
from hypothesis import strategies as st
from randomised import Watch, examples, expect_error_or_parity, no_cache_writes, randomised, timed
from test_random_plans import OWN_OPS, random_plan

import jscaler
import models
from jscaler import Block, PipelinePlan, Schedule, StageGroup, order_schedule
from jscaler.plan.schedule import block_deps, required_blocks
from jscaler.runtime.reference import reference_steps
from schedules import gpipe, interleaved_1f1b, one_f_one_b, zero_bubble
from spaces import megatron, zero

EXAMPLES = {
    "mlp-tiny": examples("JSCALER_RANDOM_PIPELINE_EXAMPLES", 70),
    "gpt-tiny": examples("JSCALER_RANDOM_GPT_PIPELINE_EXAMPLES", 10),
}
N_DEVICES = 8
LIBRARY = {
    "gpipe": gpipe,
    "one_f_one_b": one_f_one_b,
    "zero_bubble": zero_bubble,
    "interleaved_1f1b": interleaved_1f1b,
}
MESHES = {2: [{"x": 2}], 4: [{"x": 4}, {"x": 2, "y": 2}]}


@functools.cache
def setup(name):
    spec = models.get(name)
    params = spec.init(0)
    batch = spec.batch(spec.batch_size, 0)
    ref = reference_steps(params, spec.loss, optax.sgd(0.1), [batch])
    return spec, batch, ref


@functools.cache
def microbatch_graph(name, m):
    """Pipeline plans are made for the graph of one micro-batch."""
    spec = models.get(name)
    return jscaler.trace(spec.loss, spec.init(0), spec.batch(spec.batch_size // m, 0))


@pytest.fixture(scope="module", autouse=True)
def programs_not_written_to_the_compilation_cache():
    yield from no_cache_writes()


@pytest.fixture
def clock(request):
    yield from timed(request)


def group_plan(data, name, graph, k: int):
    """The plan of one group of ``k`` devices."""
    kind = data.draw(st.sampled_from(["dp", "megatron", "zero", "primitive"]), label="inner")
    if kind == "megatron" and k > 1:
        tp = data.draw(st.sampled_from([t for t in (2, 4) if k % t == 0]), label="tp")
        return megatron(tp=tp)(graph, k)
    if kind == "zero":
        return zero(data.draw(st.sampled_from([1, 2, 3]), label="stage"))(graph, k)
    if kind == "primitive" and k > 1:
        return random_plan(data, graph, OWN_OPS[name], meshes=MESHES[k])
    return jscaler.data_parallel(graph, k)


def random_order(data, stages, m, placement, split, recomputed) -> list[Block]:
    """Every block of a step (``recomputed``: the (stage, micro-batch) pairs with an R
    block), in a random order the data dependencies allow (one block ready at a time,
    drawn)."""
    blocks = required_blocks(stages, m, 1, split) | {Block(s, i, "R") for s, i in recomputed}

    def deps(b):
        return block_deps(b, stages, 1, (b.stage, b.microbatch) in recomputed)

    done, order = set(), []
    while len(order) < len(blocks):
        ready = sorted(b for b in blocks - done if all(d in done for d in deps(b)))
        b = data.draw(st.sampled_from(ready), label="next block")
        order.append(b)
        done.add(b)
    return order


def random_schedule(data, p, m, stages, placement):
    """``(what, schedule)``: a library schedule function, or a Schedule of ``stages``
    stages on ``p`` groups."""
    kinds = ["custom", "op_order", "random op_order"]
    if stages == p and placement == tuple(range(p)):
        kinds += ["gpipe", "one_f_one_b", "zero_bubble"]
    if placement == tuple(s % p for s in range(stages)):
        kinds.append("interleaved_1f1b")
    kind = data.draw(st.sampled_from(kinds), label="schedule")
    if kind == "interleaved_1f1b":
        chunks = stages // p
        return "interleaved_1f1b", lambda p_, m_: interleaved_1f1b(p_, m_, chunks=chunks)
    if kind in LIBRARY:
        return kind, LIBRARY[kind]
    split = data.draw(st.booleans(), label="split backward")
    recomputed = set()
    if kind == "custom" and not split:
        pairs = [(s, i) for s in range(stages) for i in range(m)]
        recomputed = set(data.draw(st.lists(st.sampled_from(pairs), max_size=3), label="R"))
    order = random_order(data, stages, m, placement, split, recomputed)
    if kind == "custom":
        groups = [[b for b in order if placement[b.stage] == g] for g in range(p)]
        return "custom", Schedule("random", stages, m, groups, placement)
    if kind == "op_order":  # consecutive blocks of each group: a valid, total order
        pairs = []
        for g in range(p):
            mine = [b for b in order if placement[b.stage] == g]
            pairs += list(zip(mine, mine[1:]))
    else:  # a few random constraints within a group: may contradict the data
        pairs = []
        for _ in range(data.draw(st.integers(1, 4), label="constraints")):
            a, b = (data.draw(st.sampled_from(order), label="constrained") for _ in "ab")
            if placement[a.stage] == placement[b.stage] and a != b:
                pairs.append((a, b))
    sched = order_schedule(kind, stages, m, pairs, placement=placement, split_backward=split)
    return kind, sched


def random_pipeline(data, name):
    """``(plan, schedule, m, schedule kind, description)``: a random pipeline on
    mlp-tiny or gpt-tiny."""
    m = data.draw(st.sampled_from([1, 2, 2, 4, 4]), label="microbatches")
    graph = microbatch_graph(name, m)
    p = data.draw(st.sampled_from([1, 2, 2, 3, 4]), label="groups")
    sizes = [data.draw(st.sampled_from([1, 2, 2, 4]), label="group size") for _ in range(p)]
    if sum(sizes) > N_DEVICES:
        sizes = [1] * p
    devices = data.draw(st.permutations(range(N_DEVICES)), label="devices")
    groups, at = [], 0
    for k in sizes:
        groups.append(StageGroup(devices[at : at + k], group_plan(data, name, graph, k)))
        at += k
    chunks = data.draw(st.sampled_from([1, 1, 2]), label="stages per group")
    stages = p * chunks
    how = data.draw(st.sampled_from(["in order", "round robin", "anywhere"]), label="placement")
    if how == "anywhere":
        placement = tuple(data.draw(st.integers(0, p - 1), label="group") for _ in range(stages))
    elif how == "round robin" or chunks > 1:
        placement = tuple(s % p for s in range(stages))
    else:
        placement = tuple(range(stages))
    cuts = None
    if data.draw(st.booleans(), label="random cuts"):
        ids = [o.id for o in graph.ops]
        later = ids[1:]  # a cut at the first op leaves stage 0 empty (a PlanError)
        picked = data.draw(
            st.lists(st.sampled_from(later), min_size=stages - 1, max_size=stages - 1, unique=True),
            label="cuts",
        )
        cuts = tuple(sorted(picked, key=ids.index))
    plan = PipelinePlan(tuple(groups), f"random pipeline of {p} groups", cuts=cuts)
    what, schedule = random_schedule(data, p, m, stages, placement)
    sizes_text = "+".join(map(str, sizes))
    text = f"{stages} stages on {p} groups ({sizes_text} devices), placement {placement}"
    return plan, schedule, m, what, f"{text}, cuts {cuts}, {m} micro-batches, schedule {what}"


def check_random_pipeline(name, clock, data):
    spec, batch, ref = setup(name)
    with Watch(clock) as watch:
        watch.what = f"a random pipeline on {name}"

        def build():
            plan, schedule, m, kind, what = random_pipeline(data, name)
            watch.plan, watch.what, watch.label = plan, f"{what} on {name}", f"{kind}: "
            if isinstance(schedule, Schedule):
                watch.what += f"\n{schedule}"
            return jscaler.parallelize(
                spec.init(0), spec.loss, optax.sgd(0.1), batch, devices=N_DEVICES,
                plan=plan, microbatches=m, schedule=schedule,
            )  # fmt: skip

        expect_error_or_parity(watch, build, [batch], ref)


@randomised(EXAMPLES["mlp-tiny"])
@given(data=st.data())
def test_random_pipelines_on_mlp_tiny(clock, data):
    check_random_pipeline("mlp-tiny", clock, data)


@randomised(EXAMPLES["gpt-tiny"])
@given(data=st.data())
def test_random_pipelines_on_gpt_tiny(clock, data):
    check_random_pipeline("gpt-tiny", clock, data)
