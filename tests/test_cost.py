"""The cost model: cluster presets, collective times, and predicted memory against XLA."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import optax
import pytest

import jscaler
import models
from jscaler.compile.lower import lower
from jscaler.cost import CLUSTERS, Cluster, collective_time, estimate, get_cluster
from spaces import dp, megatron, zero


def test_presets_and_links():
    assert {"dgx2_v100", "dgx1_v100", "a100_80g", "h100_sxm", "cpu"} <= set(CLUSTERS)
    dgx2 = get_cluster("dgx2_v100")
    assert dgx2.devices_per_node == 16 and dgx2.memory == 32 * 2**30
    assert dgx2.link(range(16)) is dgx2.intra and dgx2.link([0, 16]) is dgx2.inter
    with pytest.raises(jscaler.PlanError, match="unknown cluster 'tpu'"):
        get_cluster("tpu")
    with pytest.raises(jscaler.PlanError, match="no peak FLOP/s for 'fp8'"):
        dgx2.peak("fp8")
    mine = dataclasses.replace(dgx2, name="mine", devices_per_node=4)
    assert isinstance(mine, Cluster) and mine.link([0, 4]) is mine.inter


def test_collective_times_follow_alpha_beta():
    c = get_cluster("dgx2_v100")
    mb = 64e6
    assert collective_time("all-reduce", mb, [0], c) == 0
    ar = collective_time("all-reduce", mb, range(8), c)
    ag = collective_time("all-gather", mb, range(8), c)
    assert ar == pytest.approx(2 * ag, rel=0.01)  # ring all-reduce = reduce-scatter + gather
    assert ag == pytest.approx(7 * c.intra.latency + 7 / 8 * mb / c.intra.bandwidth)
    across = collective_time("all-reduce", mb, [0, 16, 32, 48], c)
    inside = collective_time("all-reduce", mb, [0, 1, 2, 3], c)
    assert across > 10 * inside  # IB per GPU is ~25x slower than NVSwitch
    assert collective_time("all-reduce", 1e3, range(32), c, "tree") < collective_time(
        "all-reduce", 1e3, range(32), c
    )


@pytest.fixture(scope="module")
def gpt():
    spec = models.get("gpt-tiny")
    return spec, spec.batch(spec.batch_size, 0)


@pytest.mark.parametrize("space", [dp(), megatron(tp=2), megatron(tp=8), zero(stage=3)])
def test_predicted_memory_against_xla(gpt, space):
    spec, batch = gpt
    trainer = jscaler.parallelize(
        spec.init(0), spec.loss, optax.sgd(0.1), batch, devices=8, plan=space
    )
    est = estimate(trainer.plan, "cpu")
    ma = trainer.compiled(batch).memory_analysis()
    stored = est.memory["params"] + est.memory["batch"]
    assert stored == pytest.approx(ma.argument_size_in_bytes, rel=0.02)
    working = est.memory["grads"] + est.memory["activations"]
    assert 0.5 < working / ma.temp_size_in_bytes < 2.0  # liveness is XLA's; an estimate
    assert est.comm_bytes == trainer.comm_table().total_bytes
    assert 0 < est.mfu <= est.hfu < 1 and est.step_time >= est.compute


def test_pipeline_estimate_runs_the_schedule_on_stage_costs(gpt):
    from jscaler.cost import estimate_pipeline
    from spaces import alpa_like, megatron

    spec, batch = gpt
    graph = jscaler.trace(spec.loss, spec.init(0), batch)
    plan = megatron(pp=2)(graph, 8)
    one = estimate_pipeline(plan, "dgx2_v100", microbatches=1)
    many = estimate_pipeline(plan, "dgx2_v100", microbatches=8)
    # one micro-batch runs the stages one after the other: half the devices idle
    assert one.bubble == pytest.approx(0.5, abs=0.1)
    # 1F1B fills the pipeline with micro-batches; not down to 1/9 here: stage 1 holds the
    # head and the loss (a 57 us forward against stage 0's 5.5 us), so stage 0 waits (0.29)
    assert many.bubble < 0.6 * one.bubble
    assert many.step_time < 8 * one.step_time
    # 1F1B keeps 2 micro-batches in flight on stage 0 whatever m is: memory stays
    assert many.memory["activations"] == pytest.approx(
        estimate_pipeline(plan, "dgx2_v100", microbatches=4).memory["activations"]
    )
    spans = many.timeline.spans
    assert {b.kind for b in spans} == {"F", "B"} and len(spans) == 2 * 2 * 8
    alpa = alpa_like(pp=2, cluster="dgx2_v100")(graph, 8)
    assert isinstance(alpa, jscaler.PipelinePlan) and alpa.name.startswith("alpa_like(pp=2")
    assert estimate_pipeline(alpa, "dgx2_v100", microbatches=8).step_time > 0


def test_a_pipeline_reruns_a_recomputed_layer_fused(gpt):
    """A stage's forward program returns JAX's residuals, fused or not (the backward's
    own buffers differ: a fusing backend materialises fewer cotangents); a recomputed
    layer is rerun inside the backward program, where a fusing backend (the H200 preset,
    not the V100 one) keeps only its materialised values, as in one SPMD step."""
    from jscaler.cost import estimate_pipeline

    spec, batch = gpt
    graph = jscaler.trace(spec.loss, spec.init(0), batch)

    def acts(space, cluster):
        plan = space(graph, 8)
        return estimate_pipeline(plan, cluster, microbatches=2).memory["activations"]

    plain = megatron(pp=2)
    assert acts(plain, "h200") == pytest.approx(acts(plain, "dgx2_v100"), rel=0.02)
    rerun = megatron(pp=2, recompute=1)
    assert acts(rerun, "h200") < 0.9 * acts(rerun, "dgx2_v100")


def test_coshard_keeps_one_piece_of_a_recomputed_layer():
    from spaces import coshard

    spec = models.get("swin-tiny")
    batch = spec.batch(spec.batch_size, 0)
    graph = jscaler.trace(spec.loss, spec.init(0), batch)
    acts = {}
    for name, space in [
        ("megatron", megatron(tp=2, recompute=1)),
        ("coshard", coshard(tp=2, colocate=2, layers=1, recompute=1)),
        ("coshard alone", coshard(tp=2, colocate=2, layers=1)),
        ("megatron alone", megatron(tp=2)),
    ]:
        est = estimate(space(graph, 8), "dgx2_v100")
        acts[name] = est.memory["activations"]
        if name == "coshard":  # its regions run forward again: HFU counts them
            assert est.hfu > est.mfu
    # the first layer is Swin's largest: its backward holds half of it under coshard
    assert acts["coshard"] < acts["megatron"]
    # without recomputation, the coshard region keeps only its inputs
    assert acts["coshard alone"] < acts["megatron alone"]


@pytest.mark.parametrize("stage", [2, 3])
def test_a_backend_without_reduce_scatter_writes_zero3_gradients_whole(gpt, stage):
    """XLA's CPU backend all-reduces ZeRO gradients and slices them: under ZeRO-3 the
    reduction writes a second whole gradient (measured: docs/cost-model.md), under ZeRO-2
    it reuses its operand's buffer; a backend with a reduce-scatter writes the slice."""
    spec, batch = gpt
    trainer = jscaler.parallelize(
        spec.init(0), spec.loss, optax.sgd(0.1), batch, devices=8, plan=zero(stage=stage)
    )
    cpu = get_cluster("cpu")
    assert not cpu.reduce_scatter and get_cluster("h100_sxm").reduce_scatter
    without = estimate(trainer.plan, cpu).memory
    native = estimate(trainer.plan, dataclasses.replace(cpu, reduce_scatter=True)).memory
    if stage == 2:
        assert without == native
        return
    whole, sliced = without["grads"], without["grads"] / 8

    # the reduction phase: the unreduced gradients plus the reduction's output
    def working(m):
        return m["total"] - m["params"] - m["optimizer"] - m["batch"]

    assert working(without) == pytest.approx(max(without["activations"], 2 * whole), rel=1e-6)
    assert working(native) == pytest.approx(max(native["activations"], whole + sliced), rel=1e-6)
    peak = trainer.compiled(batch).memory_analysis()
    measured = peak.argument_size_in_bytes + peak.temp_size_in_bytes
    assert abs(without["total"] / measured - 1) < 0.05 < abs(native["total"] / measured - 1)


@pytest.mark.parametrize("stage", [2, 3])
def test_a_weight_read_transposed_costs_what_it_costs_read_as_stored(stage):
    """GPT-2's FlaxConv1D kernels and tied LM heads are read through a transpose, which
    XLA folds into the matmul: under ZeRO-3 the view of the gathered weight is that
    weight, dropped after the layer's forward like any other, not a kept activation."""
    x = jnp.ones((16, 32))

    def loss(params, batch, transposed):
        h = batch["x"]
        for w in params["w"]:
            h = jnp.tanh(h @ (w.T if transposed else w))
        return (h**2).mean()

    def activations(transposed):
        shape = (32, 32)
        params = {"w": [jnp.eye(*shape) * (1 + k) for k in range(3)]}
        trainer = jscaler.parallelize(
            params, functools.partial(loss, transposed=transposed), optax.sgd(0.1),
            {"x": x}, devices=8, plan=zero(stage=stage),
        )  # fmt: skip
        return estimate(trainer.plan, "cpu").memory["activations"]

    assert activations(True) == activations(False)


def test_a_backend_without_a_grouped_matmul_keeps_each_ragged_dots_expanded_rows():
    """XLA lowers ``ragged_dot`` on CPU (and GPU) as a dot over every local group: each
    distinct lhs expanded (on CPU with its mask) is kept to the backward, ``groups`` times
    its rows' bytes (measured: docs/cost-model.md). A backend with a grouped matmul keeps
    none of it."""
    from jscaler.cost.memory import ragged_expansions
    from spaces import expert

    spec = models.get("moe-tiny-dropless")
    batch = spec.batch(spec.batch_size, 0)
    cpu = get_cluster("cpu")
    assert not cpu.native_ragged_dot and not get_cluster("h100_sxm").native_ragged_dot
    kept = {}
    for ep in (2, 4):
        trainer = jscaler.parallelize(
            spec.init(0), spec.loss, optax.sgd(0.1), batch, devices=8, plan=expert(ep=ep)
        )
        found = ragged_expansions(lower(trainer.plan, None))
        # two distinct lhs per layer (the rows the gate and up projections share, and the
        # down projection's input), two layers
        assert len(found) == 4
        kept[ep] = sum(e.kept for e in found)
        dense = estimate(trainer.plan, cpu).memory
        native = estimate(trainer.plan, dataclasses.replace(cpu, native_ragged_dot=True))
        assert dense["activations"] >= native.memory["activations"] + kept[ep]
    assert kept[2] == 2 * kept[4]  # 2 and 1 local experts of 4


def test_a_product_with_a_constant_keeps_only_the_constant():
    """JAX's transpose of ``y * c`` reads ``c`` alone: ``y`` is kept only where ``c``
    needs a gradient too (RoPE's ``q * cos``, GELU's ``* 0.5``, BERT's head mask kept
    ``q`` and the probabilities in the estimate, not in XLA)."""
    from jscaler.cost.memory import saved_for_backward

    def kept(loss):
        params = {"w": jnp.ones((8, 8)), "v": jnp.ones((8, 8))}
        g = jscaler.trace(loss, params, {"x": jnp.ones((4, 8)), "t": jnp.ones((4, 8))})
        made = {o.outputs[0]: o.primitive for o in g.ops}
        return sorted(made[t] for t in saved_for_backward(g))

    # y = x @ w is read by the product alone; cos(t) needs no gradient
    assert kept(lambda p, b: ((b["x"] @ p["w"]) * jnp.cos(b["t"])).sum()) == ["cos"]
    # both factors need one: each is read for the other's gradient
    both = lambda p, b: ((b["x"] @ p["w"]) * (b["t"] @ p["v"])).sum()  # noqa: E731
    assert kept(both) == ["dot_general", "dot_general"]


def test_the_backward_holds_the_logits_cotangent_beside_the_head_gradient():
    """At the loss head the backward holds the logits' cotangent and the head's weight
    gradient while nearly every kept value is still alive (XLA:CPU, Hugging Face BERT
    under Megatron: 213 KB of a 1.10 MB peak temp); a head whose weight dwarfs its kept
    values is charged both."""

    def loss(p, batch):
        logits = batch["x"] @ p["w"]
        return (jax.nn.logsumexp(logits, axis=-1) - logits[:, 0]).mean()

    params = {"w": jnp.ones((64, 4096))}
    g = jscaler.trace(loss, params, {"x": jnp.ones((8, 64))})
    acts = estimate(dp()(g, 1), "cpu").memory["activations"]
    assert acts >= 4 * (8 * 4096 + 64 * 4096)  # the logits' cotangent, the weight's gradient


def test_plans_on_one_mesh_share_the_layouts_of_their_equal_ops():
    """The cost model lowers hundreds of plans in a search; an op's layouts depend only on
    the mesh, its annotation, its operands' shapes and its sub-op tree, so plans that
    agree on an op share them, and an op they split differently gets its own."""
    spec = models.get("gpt-tiny")
    g = jscaler.trace(spec.loss, spec.init(0), spec.batch(spec.batch_size, 0))
    a = megatron(tp=2, dp=4)(g, 8)
    b = megatron(tp=2, dp=4, sp=True)(g, 8)
    la, lb = lower(a, None), lower(b, None)
    same = [o.id for o in g.ops if a.tree(o.id) == b.tree(o.id)]
    differ = [o.id for o in g.ops if a.tree(o.id) != b.tree(o.id)]
    assert same and differ
    assert all(la.ops[i] is lb.ops[i] for i in same)
    assert any(la.ops[i] != lb.ops[i] for i in differ)
    # the mesh is part of what they depend on (a device's coordinates are the mesh's)
    c = dp()(g, 8)
    lc = lower(c, None)
    assert not any(la.ops[i] is lc.ops[i] for i in (o.id for o in g.ops))
