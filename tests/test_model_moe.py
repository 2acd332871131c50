"""The mixture-of-experts decoder (models/moe.py): its dispatch, its graph, and parity
under the existing plans in both dispatch styles.

The parity cases train 3 SGD steps on 8 simulated devices and compare loss, gradients
and parameters with single-device training (fp32 tolerances of jscaler.runtime.reference);
a pipeline's with single-device gradient accumulation over the same micro-batches.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import jscaler
import models
from jscaler.runtime.reference import compare, reference_steps
from models import moe
from schedules import one_f_one_b
from spaces import dp, megatron, zero

from parity import LR, accumulated, assert_parity, batches, run_plan

STYLES = ["moe-tiny", "moe-tiny-dropless"]


def value_and_grads(cfg: moe.MoEConfig, batch):
    model = moe.MoEDecoder(cfg, rngs=nnx.Rngs(0))
    return nnx.jit(nnx.value_and_grad(moe.loss))(model, batch)


def reference_capacity(x, gates, experts, n_experts: int, capacity: int, mlp):
    """The capacity dispatch by loops: pairs placed choice-major, token order within a
    choice; an expert's pairs past ``capacity`` dropped."""
    tokens, k = experts.shape
    taken = [0] * n_experts
    out = np.zeros_like(x)
    for c in range(k):
        for t in range(tokens):
            e = int(experts[t, c])
            if taken[e] < capacity:
                taken[e] += 1
                out[t] += gates[t, c] * mlp(e, x[t])
    return out


@pytest.mark.parametrize("capacity_factor", [0.25, 0.5, 1.0])
def test_capacity_dispatch_drops_exactly_the_pairs_over_capacity(capacity_factor):
    cfg = moe.tiny(capacity_factor=capacity_factor)
    layer = moe.MoE(cfg, rngs=nnx.Rngs(1))
    x = jax.random.normal(jax.random.key(0), (3, 24, cfg.d_model))  # 3 groups of 24 tokens
    gates, experts, _ = layer.route(x.reshape(72, -1))
    gates, experts = gates.reshape(3, 24, 2), experts.reshape(3, 24, 2)
    got = np.asarray(layer.capacity_dispatch(x, gates, experts))
    wg, wu, wd = (np.asarray(w[...]) for w in (layer.w_gate, layer.w_up, layer.w_down))

    def mlp(e, v):
        g, u = v @ wg[e], v @ wu[e]
        return (g / (1 + np.exp(-g)) * u) @ wd[e]

    cap = cfg.capacity(24)
    want = np.stack(
        [
            reference_capacity(
                np.asarray(x[i]), np.asarray(gates[i]), np.asarray(experts[i]), 4, cap, mlp
            )
            for i in range(3)
        ]
    )
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    dropped = int(np.sum(np.all(want == 0, axis=-1)))
    if capacity_factor < 1:
        assert dropped > 0, "a capacity under the even share must drop some token"


def test_capacity_without_drops_equals_dropless():
    batch = moe.synthetic_batch(moe.tiny(), 8, 0)
    loss_c, grads_c = value_and_grads(moe.tiny(capacity_factor=100.0), batch)
    loss_d, grads_d = value_and_grads(moe.tiny(dispatch="dropless"), batch)
    np.testing.assert_allclose(loss_c, loss_d, rtol=1e-6)
    for a, b in zip(jax.tree.leaves(grads_c), jax.tree.leaves(grads_d)):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)


def test_sigmoid_gating_and_a_shared_expert():
    cfg = moe.tiny(gating="sigmoid", normalize=False, shared_expert=True)
    loss, grads = value_and_grads(cfg, moe.synthetic_batch(cfg, 8, 0))
    assert bool(jnp.isfinite(loss))
    shared = grads["blocks"][0]["moe"]["shared"]["up_proj"]["kernel"]
    assert float(jnp.abs(shared[...]).max()) > 0


@pytest.mark.parametrize("gating", ["softmax", "sigmoid"])
def test_the_load_balancing_loss_is_switchs(gating):
    """E * sum_e f_e p_e: f_e the share of (token, choice) pairs routed to e, p_e its mean
    (normalised) gate probability; 1 when a zero router sends every token to expert 0."""
    cfg = moe.tiny(gating=gating)
    layer = moe.MoE(cfg, rngs=nnx.Rngs(0))
    x = jax.random.normal(jax.random.key(0), (64, cfg.d_model))
    _, experts, aux = layer.route(x)
    logits = np.asarray(x @ layer.router.kernel[...], np.float64)
    probs = np.exp(logits) if gating == "softmax" else 1 / (1 + np.exp(-logits))
    probs /= probs.sum(-1, keepdims=True)
    share = np.bincount(np.asarray(experts).ravel(), minlength=4) / experts.size
    np.testing.assert_allclose(aux, 4 * np.sum(share * probs.mean(0)), rtol=1e-5)
    layer.router.kernel[...] = jnp.zeros_like(layer.router.kernel[...])
    np.testing.assert_allclose(layer.route(x)[2], 1.0, rtol=1e-6)


def test_invalid_configs_say_what_is_wrong():
    with pytest.raises(ValueError, match="top_k"):
        moe.tiny(top_k=5)
    with pytest.raises(ValueError, match="dispatch"):
        moe.tiny(dispatch="ragged")
    with pytest.raises(ValueError, match="gating"):
        moe.tiny(gating="relu")


@pytest.mark.parametrize("name", STYLES)
def test_every_op_is_annotated_and_the_blocks_are_layers(name):
    spec = models.get(name)
    graph = jscaler.trace(spec.loss, spec.init(0), spec.batch(8, 0))
    assert graph.coverage() == jscaler.Coverage(ops=1.0, flops=1.0)
    assert [layer.name for layer in graph.layers()] == ["blocks/0", "blocks/1"]
    prims = {o.primitive for o in graph.ops}
    assert ("ragged_dot_general" in prims) == name.endswith("dropless"), prims


PLANS = {
    "dp": dp(),
    "megatron(tp=2)": megatron(tp=2),
    "zero(3)": zero(3),
}


@pytest.mark.parametrize("plan", sorted(PLANS))
@pytest.mark.parametrize("name", STYLES)
def test_plan_matches_one_device(name, plan):
    assert_parity(name, PLANS[plan])


@pytest.mark.slow
@pytest.mark.parametrize("name", STYLES)
def test_a_1f1b_pipeline_matches_one_device_accumulating(name):
    spec = models.get(name)
    _, got = run_plan(name, megatron(pp=2), microbatches=2, schedule=one_f_one_b)
    want = reference_steps(spec.init(0), accumulated(spec.loss, 2), optax.sgd(LR), batches(spec))
    mm = compare(got, want)
    assert mm.ok, "\n".join(mm.lines[:10])


def test_expert_skew_measures_the_routers_imbalance_per_ep_device():
    """Routed rows per device's experts, busiest over mean: near 1 for moe-tiny's random
    router, 1 on one device, and 2 for a router that sends every token to experts 0 and 1
    (all-zero logits: top-k's ties go to the lowest indices), which at ep=2 puts every
    row on one device and at ep=4 half of them."""
    cfg = moe.tiny()
    model = moe.MoEDecoder(cfg, rngs=nnx.Rngs(0))
    batch = moe.synthetic_batch(cfg, 8)
    load = moe.expert_load(model, batch)
    assert load.shape == (cfg.n_layers, cfg.n_experts)
    assert np.all(load.sum(axis=1) == 8 * cfg.seq_len * cfg.top_k)
    assert moe.expert_skew(model, batch, ep=1) == 1.0
    assert 1.0 < moe.expert_skew(model, batch, ep=2) < 1.1
    assert 1.0 < moe.expert_skew(model, batch, ep=4) < 1.3
    for block in model.blocks:
        block.moe.router.kernel[...] = jnp.zeros_like(block.moe.router.kernel[...])
    assert moe.expert_skew(model, batch, ep=2) == 2.0
    assert moe.expert_skew(model, batch, ep=4) == 2.0
    with pytest.raises(ValueError, match="positive divisor of 4"):
        moe.expert_skew(model, batch, ep=3)
