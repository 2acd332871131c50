"""The SPMD pipeline fast path (jscaler.spmd_pipeline) equals the layers run in sequence.

A stack of tanh-MLP layers (a params pytree with a leading layer dim) through a 4-stage
pipeline on 4 devices, 4 micro-batches: outputs and gradients (w.r.t. the stacked
parameters and the input) against the same layers applied one after another on one
device, at fp32 tolerances. Also the errors for shapes that do not fit, and the
simulated-bubble part of ``bench.pipeline``.
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import jscaler

D = 16


def stack(n_layers, seed=0):
    k = jax.random.split(jax.random.key(seed), 2)
    return {
        "w": jax.random.normal(k[0], (n_layers, D, D)) / np.sqrt(D),
        "b": 0.1 * jax.random.normal(k[1], (n_layers, D)),
    }


def layer(lp, h):
    return jnp.tanh(h @ lp["w"] + lp["b"]) + 0.5 * h


def sequential(params, x):
    for i in range(params["w"].shape[0]):
        x = layer({k: a[i] for k, a in params.items()}, x)
    return x


def objective(apply):
    # a loss that weighs every output element differently, so misplaced rows show
    def f(params, x):
        y = apply(params, x)
        return jnp.sum(jnp.sin(y) * jnp.arange(y.size, dtype=y.dtype).reshape(y.shape) / y.size)

    return f


def stage_mesh(p=4, data=1, kind=AxisType.Auto):
    devs = np.array(jax.devices()[: p * data]).reshape(data, p)
    return Mesh(devs, ("data", "stage"), axis_types=(kind, kind))


def assert_close(got, want):
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        g, w = np.asarray(g), np.asarray(w)
        assert g.shape == w.shape
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6 * np.abs(w).max())


@pytest.mark.parametrize(
    "n_layers, virtual, remat",
    [(4, 1, False), (8, 1, False), (8, 1, True), (8, 2, False)],
)
def test_matches_the_layers_in_sequence(n_layers, virtual, remat):
    params = stack(n_layers)
    x = jax.random.normal(jax.random.key(1), (8, D))
    mesh = stage_mesh()

    def piped(params, x):
        return jscaler.spmd_pipeline(
            layer,
            params,
            x,
            mesh=mesh,
            axis="stage",
            microbatches=4,
            virtual_stages=virtual,
            remat=remat,
        )

    assert_close(jax.jit(piped)(params, x), sequential(params, x))
    got = jax.jit(jax.grad(objective(piped), argnums=(0, 1)))(params, x)
    want = jax.grad(objective(sequential), argnums=(0, 1))(params, x)
    assert_close(got, want)
    # the gradients are not trivially small: the comparison means something
    assert all(np.abs(np.asarray(g)).max() > 1e-3 for g in jax.tree.leaves(want))


def test_one_program_with_stage_to_stage_sends_and_no_parameter_gathers():
    params = jax.device_put(stack(8), NamedSharding(stage_mesh(), P("stage")))
    x = jax.random.normal(jax.random.key(1), (8, D))
    mesh = stage_mesh()

    def loss(params, x):
        y = jscaler.spmd_pipeline(layer, params, x, mesh=mesh, microbatches=4)
        return jnp.sum(y**2)

    hlo = jax.jit(jax.grad(loss)).lower(params, x).compile().as_text()
    kinds = re.findall(r"= \S+ (all-gather|collective-permute)(?:-start)?\(", hlo)
    assert "collective-permute" in kinds  # micro-batches move stage to stage
    assert "all-gather" not in kinds  # each stage keeps only its own layers


@pytest.mark.parametrize("kind", [AxisType.Auto, AxisType.Explicit])
def test_with_a_data_axis_beside_the_stages(kind):
    mesh = stage_mesh(p=4, data=2, kind=kind)
    params = jax.device_put(stack(8), NamedSharding(mesh, P("stage")))
    x = jax.device_put(
        jax.random.normal(jax.random.key(2), (16, D)), NamedSharding(mesh, P("data"))
    )

    def piped(params, x):
        return jscaler.spmd_pipeline(layer, params, x, mesh=mesh, microbatches=4)

    assert_close(jax.jit(piped)(params, x), sequential(stack(8), np.asarray(x)))
    got = jax.jit(jax.grad(objective(piped), argnums=(0, 1)))(params, x)
    want = jax.grad(objective(sequential), argnums=(0, 1))(stack(8), np.asarray(x))
    assert_close(got, want)


def test_layers_not_divisible_by_stages_is_a_plan_error():
    with pytest.raises(jscaler.PlanError, match=r"divisible by 4 stages \(4\), found 6 layers"):
        jscaler.spmd_pipeline(layer, stack(6), jnp.ones((8, D)), mesh=stage_mesh(), microbatches=4)
    with pytest.raises(jscaler.PlanError, match=r"4 stages x 2 virtual stages \(8\), found 4"):
        jscaler.spmd_pipeline(
            layer, stack(4), jnp.ones((8, D)), mesh=stage_mesh(), microbatches=4, virtual_stages=2
        )


def test_batch_not_divisible_by_microbatches_is_a_plan_error():
    with pytest.raises(
        jscaler.PlanError, match=r"batch size to be divisible by 4 micro-batches, found batch 10"
    ):
        jscaler.spmd_pipeline(layer, stack(4), jnp.ones((10, D)), mesh=stage_mesh(), microbatches=4)


def test_other_misuse_is_a_plan_error():
    mesh = stage_mesh()
    with pytest.raises(jscaler.PlanError, match=r"stage axis 'pipe' among the mesh axes"):
        jscaler.spmd_pipeline(
            layer, stack(4), jnp.ones((8, D)), mesh=mesh, axis="pipe", microbatches=4
        )
    with pytest.raises(jscaler.PlanError, match=r"at least as many micro-batches as stages \(4\)"):
        jscaler.spmd_pipeline(
            layer, stack(8), jnp.ones((8, D)), mesh=mesh, microbatches=2, virtual_stages=2
        )
    widen = lambda lp, h: jnp.concatenate([h, h], axis=-1)  # noqa: E731
    with pytest.raises(jscaler.PlanError, match=r"keep the activations' shapes"):
        jscaler.spmd_pipeline(widen, stack(4), jnp.ones((8, D)), mesh=mesh, microbatches=4)


def test_spmd_gpt_step_matches_plain_jax():
    import models
    from bench.pipeline import SpmdGPTStep

    spec = models.get("gpt-tiny")
    batch = spec.batch(spec.batch_size, 0)
    graphdef, params = nnx.split(spec.init(0))
    loss, grads = jax.value_and_grad(lambda p: spec.loss(nnx.merge(graphdef, p), batch))(params)
    runner = SpmdGPTStep(spec.init(0), optax.sgd(0.1), batch, stage_mesh(p=4, data=2), 4)
    got = runner.step(batch)
    np.testing.assert_allclose(got["loss"], float(loss), rtol=1e-5)
    np.testing.assert_allclose(got["grad_norm"], float(optax.tree.norm(grads)), rtol=1e-5)


def test_bench_simulated_bubbles_match_the_formula_for_gpipe_and_1f1b():
    from bench.pipeline import BUBBLE_CASES, bubble_table, simulated

    rows = simulated()
    by = {(r.schedule, r.p, r.m): r for r in rows}
    for p, m in BUBBLE_CASES:
        formula = (p - 1) / (m + p - 1)
        for name in ("gpipe", "one_f_one_b"):
            assert by[(name, p, m)].bubble == pytest.approx(formula, abs=1e-12)
            assert by[(name, p, m)].formula == pytest.approx(formula)
        # the schedules that exist to beat it do
        assert by[("interleaved_1f1b", p, m)].bubble < formula
        assert by[("zero_bubble", p, m)].bubble < formula
    text = bubble_table(rows)
    assert "zero_bubble" in text and "0.429" in text
