"""The paper's plans and its baselines as spaces: coshard, interlaced, alphafold_3f1b,
megatron_3d, deepspeed. Each trains 3 SGD steps equal to one device."""

import pytest

import jscaler
import models
from schedules import interlaced as interlaced_schedule
from spaces import SPACES, alphafold_3f1b, coshard, dap, deepspeed, interlaced, megatron_3d
from spaces.parse import parse_plan

from parity import assert_parity


def pipeline_parity(model_name, plan, m, schedule=None):
    return assert_parity(model_name, plan, microbatches=m, schedule=schedule)


def test_deepspeed_is_zero3_over_dp_on_megatron_tp():
    trainer = assert_parity("gpt-tiny", deepspeed(tp=2))
    assert trainer.plan.mesh.shape == {"dp": 4, "tp": 2}
    assert trainer.plan.name == "megatron(tp=2, dp=4, zero=3)"


def test_megatron_3d_pipelines_even_layers():
    trainer = pipeline_parity("gpt-tiny", megatron_3d(tp=2, pp=2), 2)
    assert trainer.program.schedule.name == "one_f_one_b" and len(trainer.program.stages) == 2


def test_alphafold_3f1b_brings_its_schedule():
    trainer = pipeline_parity("recycler-tiny", alphafold_3f1b(pp=2), 2)
    assert trainer.program.schedule.name == "three_f_one_b" and trainer.program.schedule.passes == 3


def test_interlaced_brings_its_schedule_with_the_head_on_every_device():
    trainer = pipeline_parity("gpt-tiny", interlaced(pp=2, tp=2), 2)
    sched = trainer.program.schedule
    assert sched.name == "interlaced_head" and sched.whole == (2,)
    assert sched.placement == (2, 0, 1, 2)  # embedding and head on the all-device group
    head = [st for st in trainer.program.stages if st.stage == 3]
    assert any("lm_head" in o.path for st in head for o in st.ops)
    with pytest.raises(jscaler.ScheduleError, match="use the plan's own schedule"):
        pipeline_parity("gpt-tiny", interlaced(pp=2, tp=2), 2, schedule=interlaced_schedule)


def test_coshard_picks_the_activation_heavy_layers():
    spec = models.get("gpt-tiny")
    graph = jscaler.trace(spec.loss, spec.init(0), spec.batch(spec.batch_size, 0))
    every = coshard(tp=2, colocate=2)(graph, 8)  # a uniform stack: every layer
    first = coshard(tp=2, colocate=2, layers=1)(graph, 8)
    assert len(first.regions) * len(graph.layers()) == len(every.regions)
    piped = coshard(tp=2, colocate=2, pp=2)(graph, 8)
    assert isinstance(piped, jscaler.PipelinePlan) and len(piped.groups) == 2
    assert piped.groups[0].plan.mesh.shape == {"dp": 2, "tp": 2}


def test_dap_splits_each_evoformer_module_along_the_axis_it_does_not_update():
    spec = models.get("alphafold2-tiny")
    graph = jscaler.trace(spec.loss, spec.init(0), spec.batch(spec.batch_size, 0))
    plan = dap(dap=2)(graph, 8)
    assert plan.mesh.shape == {"dp": 4, "dap": 2}
    classes = jscaler.DimClasses(graph)
    aatype = next(t for t in graph.inputs if graph.tensors[t].name == "batch/aatype")
    residues = classes.of(aatype, 1)
    block = graph.layers()[0].graph.ops
    top = {o.id: plan.tree(o.id).children[1] for o in block}  # the dp split, then dap
    assert sum(t.algo == "split" for t in top.values()) > 0.8 * len(block)
    for module, along_residues in (("msa_row_attn", False), ("msa_col_attn", True)):
        scores = [
            o
            for o in block
            if o.path.endswith(module) and o.primitive == "dot_general"
            and not any(graph.tensors[x].role == "param" for x in o.tensor_inputs)
        ]  # fmt: skip
        assert scores
        for o in scores:
            node = plan.tree(o.id).children[0]
            assert node.algo == "split"
            assert (classes.dim_of(o, residues) == node.dim) == along_residues, o.where
    with pytest.raises(jscaler.PlanError, match="no repeated layers"):
        dap(dap=2)(jscaler.trace(lambda p, b: (p["w"] * b["x"]).sum(), *_toy()), 8)
    with pytest.raises(jscaler.PlanError, match="tp=2 and dap=2"):
        alphafold_3f1b(tp=2, dap=2)(graph, 8)


def _toy():
    import jax.numpy as jnp

    return {"w": jnp.ones((4, 4, 4))}, {"x": jnp.ones((8, 4, 4, 4))}


def test_bare_names_and_bad_degrees():
    for name in ("alphafold_3f1b", "coshard", "deepspeed", "megatron_3d"):
        assert callable(SPACES[name]())
    with pytest.raises(jscaler.PlanError, match="pp must be an int >= 2"):
        alphafold_3f1b(pp=1)(None, 8)
    with pytest.raises(jscaler.PlanError, match="divisible by pp"):
        coshard(pp=3)(None, 8)


# ---- the reference models: each with the paper's plan for it and the baselines ----------

MODEL_SPACES = [  # bare names: the space's defaults for 8 devices; the paper's own
    # plans on their models run as `jscaler verify` runs them: test_paper_plans_verify.py
    ("t5-tiny", "megatron_3d"),
    ("t5-tiny", "deepspeed"),
    ("t5-tiny", "coshard"),
    ("swin-tiny", "megatron_3d"),
    ("swin-tiny", "deepspeed"),
    ("alphafold2-tiny", "megatron_3d"),
    ("alphafold2-tiny", "deepspeed"),
    ("alphafold2-tiny", "alphafold_3f1b(pp=2, dap=2)"),
    ("t5-tiny", "alpa_like(pp=2)"),
    ("swin-tiny", "alpa_like(pp=2)"),
    ("alphafold2-tiny", "alpa_like(pp=2)"),
]
SLOW = {
    ("alphafold2-tiny", "alpa_like(pp=2)"),
    ("alphafold2-tiny", "alphafold_3f1b(pp=2, dap=2)"),
    ("alphafold2-tiny", "megatron_3d"),
    ("alphafold2-tiny", "deepspeed"),
    ("swin-tiny", "deepspeed"),
}


@pytest.mark.parametrize(
    "model_name, space",
    [pytest.param(*c, marks=[pytest.mark.slow] if c in SLOW else []) for c in MODEL_SPACES],
)
def test_reference_model_under_space_matches_one_device(model_name, space):
    plan = parse_plan(space)  # a bare name: the space's defaults for 8 devices
    if getattr(plan, "pp", 1) > 1:  # a pipeline: 2 micro-batches
        trainer = pipeline_parity(model_name, plan, 2)
        assert isinstance(trainer.plan, jscaler.PipelinePlan)
    else:
        assert_parity(model_name, plan)
