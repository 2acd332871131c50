"""Manual regions run as one shard_map with explicit collectives: coshard and user-marked.

Parity is tests/parity.py's: SGD, 3 steps, fp32, against the user's loss on one device,
at the tolerance of ``jscaler.runtime.reference.TOLERANCES["fp32"]``. The comm table is
held to the compiled HLO as in tests/test_comm.py (within 10% per collective and axes).
"""

import optax
import pytest

import jscaler
import models
from jscaler.plan import op_trans
from jscaler.report import explain
from models import gpt
from spaces import coshard, dp, expert, megatron, ulysses, zero

from parity import assert_parity
from test_comm import assert_close, predicted_and_compiled


def marked(base, pick, name):
    """The plan of space ``base`` with the ops ``pick(graph)`` chooses marked manual."""

    def space(graph, n_devices):
        plan = base(graph, n_devices)
        plan, _ = op_trans(plan, pick(graph), jscaler.manual())
        return plan.evolve(name=f"{plan.name} + manual({name})")

    space.__name__ = name
    return space


def first_layer(graph):
    return graph.layers()[0].graph.ops


def every_op(graph):
    return graph.ops


def first_experts(graph):
    """The first MoE layer's experts: its ragged_dots (dropless) and what lies between."""
    ops = [o for o in graph.ops if o.path.startswith("blocks/0/moe")]
    at = [i for i, o in enumerate(ops) if o.primitive == "ragged_dot_general"]
    return ops[at[0] : at[-1] + 1]


# ---- coshard -------------------------------------------------------------------------

COSHARD = {
    "gpt-tiny coshard(tp=2, colocate=2)": ("gpt-tiny", coshard(tp=2, colocate=2)),
    "mlp-tiny coshard(tp=4, colocate=2, dp=2)": ("mlp-tiny", coshard(tp=4, colocate=2, dp=2)),
    "convnet-tiny coshard(tp=2, colocate=2)": ("convnet-tiny", coshard(tp=2, colocate=2)),
    "gpt-tiny coshard(tp=2, colocate=2, recompute=1/2)": (
        "gpt-tiny",
        coshard(tp=2, colocate=2, recompute=0.5),
    ),
}


@pytest.mark.parametrize("case", list(COSHARD))
def test_coshard_matches_single_device_training(case):
    model, space = COSHARD[case]
    trainer = assert_parity(model, space)
    assert any(r.kind == "coshard" for r in trainer.plan.regions)


def test_coshard_over_the_experts_matches_single_device_training():
    """expert(ep=2) on dropless MoE, each device's two experts run one after another:
    each ragged_dot's groups split over ep, then colocated 2 ways on the device."""

    def space(graph, n_devices):
        plan = expert(ep=2)(graph, n_devices)
        for op in graph.ops:
            if op.primitive == "ragged_dot_general":
                plan, _ = op_trans(plan, op, jscaler.coshard((op.tensor_inputs[1], 0), 2))
        return plan

    trainer = assert_parity("moe-tiny-dropless", space)
    assert [r.kind for r in trainer.plan.regions] == ["coshard"] * 6


def _long_gpt():
    cfg = gpt.GPTConfig(vocab_size=128, d_model=128, n_layers=2, n_heads=16, d_ff=256, seq_len=256)
    return models.gpt_spec("gpt-long", cfg, 8, "attention-heavy")


def _temp_bytes(spec, space):
    batch = spec.batch(spec.batch_size, 0)
    trainer = jscaler.parallelize(
        spec.init(0), spec.loss, optax.sgd(0.1), batch, devices=8, plan=space
    )
    return trainer.compiled(batch).memory_analysis().temp_size_in_bytes, trainer


@pytest.mark.xfail(
    strict=True,
    reason="a softmax inside coshard's manual regions keeps its exp (jscaler.compile.softmax "
    "applies outside regions), while megatron's base no longer does: base 18.3 MB, "
    "colocate=2 17.5 MB (0.96x, not < 0.8x), colocate=4 8.5 MB",
)
def test_coshard_peak_temp_memory_falls_with_colocate():
    """A GPT whose attention scores dominate activation memory (16 heads, seq 256): each
    device keeps one piece's scores at a time. Measured: 25.3 MB (megatron tp=2),
    17.5 (colocate 2), 8.6 (colocate 4)."""
    spec = _long_gpt()
    base, _ = _temp_bytes(spec, megatron(tp=2))
    two, _ = _temp_bytes(spec, coshard(tp=2, colocate=2))
    four, trainer = _temp_bytes(spec, coshard(tp=2, colocate=4))
    assert two < 0.8 * base and four < 0.5 * base, (base, two, four)
    hlo = trainer.hlo(spec.batch(spec.batch_size, 0))
    assert " while(" in hlo  # the colocated pieces run in a loop, one after another


# ---- regions a user marks manual -----------------------------------------------------

MARKED = {
    "gpt-tiny megatron(tp=2) + manual(first layer)": (
        "gpt-tiny",
        marked(megatron(tp=2), first_layer, "first layer"),
    ),
    "gpt-tiny ulysses(sp=4) + manual(first layer)": (
        "gpt-tiny",
        marked(ulysses(sp=4), first_layer, "first layer"),
    ),
    "mlp-tiny megatron(tp=2) + manual(every op)": (
        "mlp-tiny",
        marked(megatron(tp=2), every_op, "every op"),
    ),
    "mlp-tiny zero(3) + manual(every op)": ("mlp-tiny", marked(zero(3), every_op, "every op")),
    "moe-tiny-dropless expert(ep=4, dp=2) + manual(first experts)": (
        "moe-tiny-dropless",
        marked(expert(ep=4, dp=2), first_experts, "first experts"),
    ),
}


@pytest.mark.parametrize("case", list(MARKED))
def test_a_region_marked_manual_matches_single_device_training(case):
    model, space = MARKED[case]
    trainer = assert_parity(model, space)
    assert [r.kind for r in trainer.plan.regions] == ["shard_map"]


@pytest.mark.parametrize(
    "space", [megatron(tp=2, regions=True), megatron(tp=4, sp=True, regions=True)], ids=str
)
def test_megatron_with_its_regions_manual_matches_single_device_training(space):
    trainer = assert_parity("gpt-tiny", space)
    assert {r.kind for r in trainer.plan.regions} == {"shard_map"}
    assert len(trainer.plan.regions) == 2 * 4  # attention and MLP of each of 4 layers


@pytest.mark.parametrize("sp", [False, True], ids=["megatron", "megatron-sp"])
def test_manual_tensor_parallel_regions_reduce_a_shared_input_gradient_once(sp):
    """XLA reduces the cotangent of the input q, k and v (gate and up) share once per
    consumer; a region reduces their sum once: fewer tp reduction bytes in the HLO."""
    _, plain, _ = predicted_and_compiled("gpt-tiny", megatron(tp=4, sp=sp))
    _, manual, _ = predicted_and_compiled("gpt-tiny", megatron(tp=4, sp=sp, regions=True))
    key = ("reduction", ("tp",))
    assert manual[key] < 0.7 * plain[key], (manual[key], plain[key])


# ---- the collectives the regions emit are the ones the comm table predicts ------------

AGREE = {
    "convnet-tiny coshard(tp=2, colocate=2)": ("convnet-tiny", coshard(tp=2, colocate=2)),
    "mlp-tiny coshard(tp=4, colocate=2, dp=2)": ("mlp-tiny", coshard(tp=4, colocate=2, dp=2)),
    "mlp-tiny zero(3) + manual(every op)": MARKED["mlp-tiny zero(3) + manual(every op)"],
    "gpt-tiny dp + manual(first layer)": ("gpt-tiny", marked(dp(), first_layer, "first layer")),
    # the LM head's weight gradient, partial over dp and tp outside the regions: the HLO
    # reader counts XLA:CPU's all-reduce per axis as the one over both a GPU runs (hlo.py)
    "gpt-tiny coshard(tp=2, colocate=2)": ("gpt-tiny", coshard(tp=2, colocate=2)),
}


@pytest.mark.parametrize("case", list(AGREE))
def test_region_collectives_match_the_compiled_hlo(case):
    pred, got, _ = predicted_and_compiled(*AGREE[case])
    assert pred
    assert_close(pred, got)


# ---- plans and errors ----------------------------------------------------------------


@pytest.fixture(scope="module")
def gpt_graph():
    spec = models.get("gpt-tiny")
    return jscaler.trace(spec.loss, spec.init(0), spec.batch(spec.batch_size, 0))


def test_a_coshard_plan_round_trips_through_json_and_explains_itself(gpt_graph):
    plan = jscaler.validate(coshard(tp=2, colocate=2)(gpt_graph, 8))
    again = jscaler.Plan.from_json(plan.to_json(), gpt_graph)
    assert again == plan and again.regions == plan.regions
    text = explain(plan)
    assert "coshard d(64)/2" in text  # the q projection's colocated split


def test_coshard_needs_a_split_over_devices_first(gpt_graph):
    plan = jscaler.Plan.create(gpt_graph, jscaler.MeshSpec.create(tp=2))
    op = next(o for o in gpt_graph.ops if o.primitive == "dot_general")
    with pytest.raises(jscaler.PlanError, match="split over devices first"):
        op_trans(plan, op, jscaler.coshard((op.inputs[1], 1), 2), 2)
    with pytest.raises(jscaler.PlanError, match="colocate must be a positive int"):
        jscaler.coshard((op.inputs[1], 1), 0)


def test_coshard_names_an_op_that_cannot_cut_into_the_pieces(gpt_graph):
    with pytest.raises(jscaler.PlanError, match="no tensor-parallel region"):
        coshard(tp=2, colocate=32)(gpt_graph, 8)


def test_a_region_read_from_outside_before_it_ends_is_refused():
    layer = "blocks/0/"

    def ends_of_the_first_layer(graph):
        ops = [o for o in graph.ops if o.path.startswith(layer)]
        return [ops[0], ops[-1]]

    space = marked(dp(), ends_of_the_first_layer, "two ops")
    with pytest.raises(jscaler.LayoutError, match="contiguous step"):
        assert_parity("gpt-tiny", space, steps=1)


def test_a_vocabulary_split_lookup_cannot_run_on_pieces():
    space = marked(megatron(tp=2), every_op, "every op")
    with pytest.raises(jscaler.LayoutError, match="gather.*split here"):
        assert_parity("gpt-tiny", space, steps=1)
