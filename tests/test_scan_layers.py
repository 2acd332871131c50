"""Layers stacked under a scan are planned as layers (jscaler.ir.expose).

Every plan trains a scanned model equal to one device, written the three ways users write
it (``jax.lax.scan`` over a stacked params pytree, ``nnx.scan``, linen ``nn.scan``), with
and without a checkpoint around the layer; ZeRO-3 gathers one layer per iteration inside
the loop; a pipeline cuts the stack into a scan per chunk; compile time stays flat in
depth; the cost model counts the body once per iteration.
"""

import time

import jax
import numpy as np
import optax
import pytest
from scan_models import WAYS

import jscaler
import models
from bench.plain_models import Size
from bench.scan_models import llama_init, scan_loss, stack_layers
from jscaler.compile.hlo import collectives
from jscaler.ir import chunk_loops
from spaces import coshard, dp, megatron, ring, ulysses, usp, zero

from parity import assert_matches_reference, assert_parity

# the scanned Llama's residual stream grows with depth: at SGD lr 0.1 its loss rises and
# fp32 rounding alone drifts past the 1e-5 relative tolerance by step 3; at 0.02 it trains
LR = 0.02

NNX_PLANS = {
    "dp": dp(),
    "zero1": zero(stage=1),
    "zero2": zero(stage=2),
    "zero3": zero(stage=3),
    "tp": megatron(tp=4),
    "tp_zero3": megatron(tp=4, dp=2, zero=3),
    "tp_sp": megatron(tp=4, sp=True),
    "tp_regions": megatron(tp=4, regions=True),
    "ulysses": ulysses(sp=4),
    "ring": ring(sp=4),
    "usp": usp(ulysses=2, ring=2),
    "coshard": coshard(tp=2, colocate=2),
    "recompute": dp(recompute=1.0),
    "pipeline": megatron(tp=2, pp=2),
    "auto": "auto",
}
QUICK = {"tp", "zero3", "pipeline"}


@pytest.mark.parametrize(
    "key", [k if k in QUICK else pytest.param(k, marks=pytest.mark.slow) for k in NNX_PLANS]
)
def test_every_plan_trains_an_nnx_scanned_model_equal_to_one_device(key):
    trainer = assert_parity("gpt-tiny-scan", NNX_PLANS[key])
    g = trainer.plan.graph
    assert any(o.loop is not None for o in g.ops)  # planned inside the scan, not around it


@pytest.mark.parametrize("remat", [False, True], ids=["plain", "remat"])
@pytest.mark.parametrize("way", list(WAYS))
@pytest.mark.parametrize(
    "plan",
    [
        megatron(tp=4),
        pytest.param(dp(), marks=pytest.mark.slow),
        pytest.param(zero(stage=3), marks=pytest.mark.slow),
        pytest.param(megatron(tp=2, pp=2), marks=pytest.mark.slow),
    ],
    ids=["tp", "dp", "zero3", "pipeline"],
)
def test_scans_written_with_lax_or_linen_train_equal_to_one_device(way, remat, plan):
    model, loss, batches = WAYS[way](remat)
    assert_matches_reference(model, loss, batches, plan, lr=LR)


@pytest.mark.slow
@pytest.mark.parametrize("plan", [megatron(tp=4), zero(stage=3), megatron(tp=2, pp=2)])
def test_an_nnx_scan_with_remat_inside_trains_equal_to_one_device(plan):
    assert_parity("gpt-tiny-scan-remat", plan)


def test_a_scanned_body_is_one_iteration_of_graph_ops():
    spec = models.get("gpt-tiny-scan")
    g = jscaler.trace(spec.loss, spec.init(0), spec.batch(8, 0))
    looped = [o for o in g.ops if o.loop is not None]
    assert {o.loop.length for o in looped} == {4}
    slices = [o for o in looped if o.primitive == "scan_slice"]
    assert len(slices) == len(g.params()) - 3  # every stacked leaf; not embed, norm_f, head
    assert all(str(o.annotation).startswith("z^") for o in slices)  # layer axis whole
    assert {"blocks", "blocks/attn", "blocks/mlp"} <= {o.path for o in looped}
    # the body's FLOPs count once per iteration: the same as the list twin's
    twin = models.get("gpt-tiny")
    listed = jscaler.trace(twin.loss, twin.init(0), twin.batch(8, 0))
    assert g.flops == pytest.approx(listed.flops, rel=1e-6)


def test_a_remat_inside_the_body_is_planned_inside():
    params, loss, batches = WAYS["jax.lax.scan"](True)
    g = jscaler.trace(loss, params, batches[0])
    looped = [o for o in g.ops if o.loop is not None]
    assert not any(o.primitive == "remat2" for o in looped)
    dots = [o for o in looped if o.primitive == "dot_general"]
    assert dots and all(o.remat is not None for o in dots)
    plan = megatron(tp=4)(g, 4)
    # the heads and hidden features inside the user's checkpoint are split
    tp_level = [plan.tree(o.id).children[0] for o in dots]  # below the dp level (dp=1)
    assert sum(node.algo == "split" for node in tp_level) >= 5  # q, o, gate, up, down


def test_chunks_of_a_scan_compute_the_same_function():
    params, loss, batches = WAYS["jax.lax.scan"](False)
    g = jscaler.trace(loss, params, batches[0])
    cut = chunk_loops(g, 2)
    loops = {o.loop for o in cut.ops if o.loop is not None}
    assert sorted(loop.length for loop in loops) == [1, 1, 1, 1]  # 2 x pp: 4 chunks of 1
    assert len(cut.layers()) == 4
    l1, g1 = jax.jit(jax.value_and_grad(loss))(params, batches[0])
    l2, g2 = jax.jit(jax.value_and_grad(cut.as_fn()))(params, batches[0])
    np.testing.assert_allclose(l2, l1, rtol=1e-6)
    for a, b in zip(jax.tree.leaves(g2), jax.tree.leaves(g1)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6 * np.abs(b).max())


def test_a_schedule_with_more_stages_than_chunks_is_refused():
    from schedules import interleaved_1f1b

    spec = models.get("gpt-tiny-scan")
    with pytest.raises(jscaler.PlanError, match="cut into whole chunks"):
        trainer = jscaler.parallelize(
            spec.init(0), spec.loss, optax.sgd(0.1), spec.batch(16, 0), devices=8,
            plan=megatron(tp=2, pp=2), microbatches=4,
            schedule=lambda p, m: interleaved_1f1b(p, m, 4),
        )  # fmt: skip
        trainer.step(spec.batch(16, 0))


def _compiled_memory(name: str, plan) -> tuple[int, object]:
    spec = models.get(name)
    batch = spec.batch(8, 0)
    trainer = jscaler.parallelize(
        spec.init(0), spec.loss, optax.adamw(1e-3), batch, devices=8, plan=plan
    )
    m = trainer.compiled(batch).memory_analysis()
    total = (
        m.argument_size_in_bytes
        + m.output_size_in_bytes
        + m.temp_size_in_bytes
        - m.alias_size_in_bytes
    )
    return total, trainer


# zero-3 was predicted 10.1% under here until the estimate held a scan's gradient stacks
# and its layer's gathered weights and gradients during the loop's backward (-1.6% now)
@pytest.mark.parametrize(
    "plan",
    [dp(), zero(stage=3), megatron(tp=4), megatron(tp=4, dp=2, zero=3)],
    ids=["dp", "zero3", "tp", "tp_zero3"],
)
def test_a_scanned_model_is_no_heavier_than_its_list_twin(plan):
    scanned, trainer = _compiled_memory("gpt-tiny-scan", plan)
    listed, twin = _compiled_memory("gpt-tiny", plan)
    assert scanned <= 1.10 * listed, (scanned, listed)
    # collectives inside the loop run once per iteration: bytes per step as the twin's
    batch = models.get("gpt-tiny-scan").batch(8, 0)
    found = collectives(trainer.hlo(batch), trainer.plan.mesh.axes)
    assert any(c.times == 4 for c in found) or plan == dp()
    sent = sum(c.bytes * c.times for c in found)
    listed_sent = sum(c.bytes * c.times for c in collectives(twin.hlo(batch), twin.plan.mesh.axes))
    assert sent <= 1.05 * listed_sent, (sent, listed_sent)
    # and the cost model sees it: memory within 10%, collective bytes within 5%
    assert abs(trainer.estimate("cpu").memory["total"] / scanned - 1) <= 0.10
    assert abs(trainer.comm_table().total_bytes / max(sent, 1) - 1) <= 0.05


@pytest.mark.parametrize("plan", [dp(), zero(stage=2)], ids=["dp", "zero2"])
def test_the_estimate_holds_a_scans_gradient_stacks_beside_its_residuals(plan, monkeypatch):
    """A scan's backward writes every layer's weight gradients into one stacked buffer
    allocated before the loop, beside the loop's residuals, one layer's gradients and the
    loss head's: variant 6 of seed 7 (MQA, scanned, tied, nnx) was predicted 14% (dp) and
    27% (ZeRO-2) under XLA's memory; within 10% now, and more than 10% under again
    without the stacks."""
    import jscaler.cost.memory as memory
    from bench.variant_models import build, draw

    vm = build(draw(7, 6))
    model, loss = vm.make()
    trainer = jscaler.parallelize(model, loss, optax.adamw(1e-3), vm.batch, devices=8, plan=plan)
    m = trainer.compiled(vm.batch).memory_analysis()
    xla = (
        m.argument_size_in_bytes
        + m.output_size_in_bytes
        + m.temp_size_in_bytes
        - m.alias_size_in_bytes
    )
    assert abs(trainer.estimate("cpu").memory["total"] / xla - 1) <= 0.10
    monkeypatch.setattr(memory, "stacked_grads", lambda g, grad: set())
    assert trainer.estimate("cpu").memory["total"] / xla - 1 < -0.10


def test_zero3_gathers_each_layer_inside_the_loop():
    _, trainer = _compiled_memory("gpt-tiny-scan", zero(stage=3))
    spec = models.get("gpt-tiny-scan")
    gathers = [
        c
        for c in collectives(trainer.hlo(spec.batch(8, 0)), trainer.plan.mesh.axes)
        if c.kind == "all-gather"
    ]
    per_layer = {c.bytes for c in gathers if c.times == 4}
    # q/k/v/o kernels 64x64 and the MLP's 64x176 in fp32, one layer's each time
    assert 64 * 64 * 4 in per_layer and 64 * 176 * 4 in per_layer


HLO_LOOP = """
HloModule m

%body (p: (s32[], f32[8])) -> (s32[], f32[8]) {
  %p = (s32[], f32[8]) parameter(0)
  %x = f32[8] get-tuple-element(%p), index=1
  %ar = f32[8] all-reduce(%x), channel_id=1, replica_groups={{0,1}}, to_apply=%add
  ROOT %t = (s32[], f32[8]) tuple(%i, %ar)
}

ENTRY %main (a: f32[8]) -> f32[8] {
  %a = f32[8] parameter(0)
  %ag = f32[8] all-gather(%a), channel_id=2, replica_groups={{0,1}}, dimensions={0}
  %w = (s32[], f32[8]) while(%init), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"6"}}
  ROOT %r = f32[8] get-tuple-element(%w), index=1
}
"""  # noqa: E501


def test_collectives_in_a_while_loop_count_once_per_iteration():
    found = {c.kind: c.times for c in collectives(HLO_LOOP)}
    assert found == {"all-reduce": 6, "all-gather": 1}


def _llama_compile_seconds(layers: int) -> float:
    size = Size(d=64, layers=layers, heads=8, seq=32, batch=8, vocab=512)
    params = stack_layers(llama_init(size))
    batch = {"ids": jax.random.randint(jax.random.key(1), (8, 32), 0, 512)}
    trainer = jscaler.parallelize(
        params, scan_loss(size.heads), optax.sgd(0.1), batch, devices=8, plan=megatron(tp=8)
    )
    start = time.perf_counter()
    trainer.compiled(batch)
    return time.perf_counter() - start


def test_compile_time_is_flat_in_the_depth_of_a_scan():
    _llama_compile_seconds(2)  # warm the tracing caches
    four, sixteen = _llama_compile_seconds(4), _llama_compile_seconds(16)
    assert sixteen <= 1.5 * four, (four, sixteen)


def _refused(name: str) -> list[str]:
    """The reasons the auto search's candidates cannot apply to a registered model."""
    import schedules  # noqa: F401  (registers the schedules the search tries)
    from jscaler.search import search

    spec = models.get(name)
    graph = jscaler.trace(spec.loss, spec.init(0), spec.batch(spec.batch_size, 0))
    result = search(graph, 8, cluster="dgx2_v100", cache=False)
    return [r.note for r in result.rows if r.note.startswith("cannot apply")]


@pytest.mark.slow
def test_the_auto_search_applies_to_a_scanned_model_as_to_its_list_twin():
    scanned, listed = _refused("gpt-tiny-scan"), _refused("gpt-tiny")
    # only dap, which splits AlphaFold2's module lists, needs layers written as a list
    assert len([r for r in scanned if "dap" not in r]) <= len(listed), scanned


def test_a_pipeline_plan_made_for_a_scanned_model_can_be_passed_in():
    spec = models.get("gpt-tiny-scan")
    batch = spec.batch(8, 0)
    graph = jscaler.trace(spec.loss, spec.init(0), batch)
    plan = megatron(tp=2, pp=2)(graph, 8)  # planned on the chunked graph
    assert plan.graph is not graph
    trainer = jscaler.parallelize(
        spec.init(0), spec.loss, optax.sgd(0.1), batch, devices=8, plan=plan
    )
    assert np.isfinite(trainer.step(batch)["loss"])
