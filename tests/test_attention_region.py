"""Ring attention against the dense formula, and find_attention on traced graphs.

Tolerance: ring attention sums the softmax blockwise, which reorders fp32 sums, so outputs
and gradients agree to |a-b| <= 1e-5*|b| + 1e-6*max|b|. A region found in a graph is
checked by running its ops and comparing with dense_attention at its scale, mask and axes.
"""

import dataclasses
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, Mesh
from jax.sharding import PartitionSpec as P

import jscaler
import models
from jscaler.compile.attention import dense_attention, find_attention, ring_attention
from jscaler.ir import evaluate
from jscaler.ir.extrema import MIN_LENGTH

F32_MIN = float(np.finfo(np.float32).min)


def assert_close(got, want, what):
    got, want = np.asarray(got), np.asarray(want)
    tol = 1e-5 * np.abs(want) + 1e-6 * np.max(np.abs(want))
    err = np.max(np.abs(got - want) - tol)
    assert np.all(np.abs(got - want) <= tol), f"{what}: worst excess over tolerance {err:.3g}"


def sp_mesh(n):
    if len(jax.devices()) < n:
        pytest.fail(f"needs {n} devices, found {len(jax.devices())} (tests/conftest.py sets 8)")
    return Mesh(np.array(jax.devices()[:n]), ("sp",), axis_types=(AxisType.Auto,))


def random_qkv(seed, shape=(2, 32, 4, 16)):
    keys = jax.random.split(jax.random.key(seed), 4)
    return [jax.random.normal(key, shape, jnp.float32) for key in keys]


@pytest.mark.parametrize(
    "n, causal, mask_value",
    [(2, True, F32_MIN), (4, True, F32_MIN), (8, True, F32_MIN), (4, True, -np.inf)]
    + [(2, False, F32_MIN), (4, False, F32_MIN), (8, False, F32_MIN)],
)
def test_ring_attention_matches_dense(n, causal, mask_value):
    q, k, v, cotangent = random_qkv(n)
    opts = dict(causal=causal, scale=0.25, mask_value=mask_value)
    spec = P(None, "sp")
    ring = jax.shard_map(
        partial(ring_attention, axis_name="sp", **opts),
        mesh=sp_mesh(n),
        in_specs=(spec, spec, spec),
        out_specs=spec,
    )
    dense = partial(dense_attention, **opts)

    def loss(attention):
        return lambda q, k, v: jnp.sum(attention(q, k, v) * cotangent)

    assert_close(jax.jit(ring)(q, k, v), dense(q, k, v), "output")
    got = jax.jit(jax.grad(loss(ring), argnums=(0, 1, 2)))(q, k, v)
    want = jax.grad(loss(dense), argnums=(0, 1, 2))(q, k, v)
    for name, g, w in zip("qkv", got, want, strict=True):
        assert np.all(np.isfinite(np.asarray(g))), f"d{name} has non-finite entries"
        assert_close(g, w, f"d{name}")


def region_output(graph, region, seed=0):
    """(the region's ops run on random q/k/v, dense_attention on the same), as [b,s,h,d]."""
    sub = graph.subgraph([graph.op(i) for i in region.ops])
    assert set(sub.inputs) == {region.q, region.k, region.v}
    assert sub.outputs == (region.out,)
    axes = {region.q: region.q_axes, region.k: region.k_axes, region.v: region.v_axes}
    shape = graph.tensors[region.q].shape
    bshd = random_qkv(seed, tuple(shape[a] for a in region.q_axes.order))[:3]
    values = {}
    for t, x in zip((region.q, region.k, region.v), bshd):
        values.setdefault(t, jnp.transpose(x, np.argsort(axes[t].order)))
    (out,) = evaluate(sub, *(values[t] for t in sub.inputs))
    opts = dict(causal=region.causal, scale=region.scale, mask_value=region.mask_value)
    return jnp.transpose(out, region.out_axes.order), dense_attention(*bshd, **opts)


@jax.custom_jvp
def own_softmax(x):
    """A user's own custom_jvp softmax (the ops of jax's, its rule): one call op."""
    m = jnp.max(x, axis=-1, initial=-jnp.inf, keepdims=True)
    e = jnp.exp(x - m)
    return e / jnp.sum(e, axis=-1, keepdims=True)


@own_softmax.defjvp
def _own_softmax_jvp(primals, tangents):
    (x,), (t,) = primals, tangents
    y = own_softmax(x)
    return y, y * (t - (y * t).sum(-1, keepdims=True))


@pytest.mark.parametrize("custom_jvp_softmax", [False, True])
def test_find_attention_on_gpt_tiny(custom_jvp_softmax, monkeypatch):
    spec = models.get("gpt-tiny")
    # jax.nn.softmax (a custom_jvp_call since jax 0.12.1) is traced inline; a softmax of
    # the user's own under custom_jvp stays one call op, matched through its body
    if custom_jvp_softmax:
        monkeypatch.setattr(jax.nn, "softmax", lambda x, axis=-1: own_softmax(x))
    graph = jscaler.trace(spec.loss, spec.init(0), spec.batch(8, 0))
    regions = find_attention(graph)
    assert [r.path for r in regions] == [f"blocks/{i}/attn" for i in range(4)]
    assert any(graph.op(i).kind == "call" for i in regions[0].ops) == custom_jvp_softmax
    for r in regions:
        assert r.causal and r.scale == pytest.approx(1 / np.sqrt(16), rel=1e-7)
        assert r.mask_value == F32_MIN
        for t in (r.q, r.k, r.v):
            assert graph.tensors[t].shape == (8, 32, 4, 16)
        assert r.q_axes.order == r.k_axes.order == r.v_axes.order == (0, 1, 2, 3)
        assert graph.tensors[r.out].shape == tuple(
            (8, 32, 4, 16)[r.out_axes.order.index(a)] for a in range(4)
        )
        first, second = graph.op(r.ops[0]), graph.op(r.ops[-1])
        assert first.primitive == second.primitive == "dot_general"
        assert second.outputs == (r.out,)
    assert_close(*region_output(graph, regions[0]), "region 0 vs dense")


def test_find_attention_over_keys_whose_max_is_taken_in_two_levels():
    """From ``extrema.MIN_LENGTH`` keys on the trace takes the softmax's max over block
    maxima (jscaler.ir.extrema): the region holds the reshape and both maxima."""
    from flax import nnx

    from models import gpt

    cfg = dataclasses.replace(gpt.tiny(), seq_len=MIN_LENGTH, n_layers=1)
    batch = {"tokens": jnp.zeros((2, MIN_LENGTH), jnp.int32)}
    batch["targets"] = batch["tokens"]
    graph = jscaler.trace(gpt.loss, gpt.GPT(cfg, rngs=nnx.Rngs(0)), batch)
    (region,) = find_attention(graph)
    kinds = [graph.op(i).primitive for i in region.ops]
    assert kinds.count("reduce_max") == 2 and "reshape" in kinds
    assert region.causal and graph.tensors[region.q].shape == (2, MIN_LENGTH, 4, 16)
    assert_close(*region_output(graph, region), "two-level region vs dense")


def test_find_attention_on_a_model_without_attention():
    spec = models.get("mlp-tiny")
    assert find_attention(jscaler.trace(spec.loss, spec.init(0), spec.batch(8, 0))) == []


def bhsd_attention_loss(mask):
    """A loss over [batch, heads, seq, head_dim] attention with the given kind of mask."""

    def loss(params, batch):
        x = batch["x"]
        q, k, v = x * params["wq"], x * params["wk"], x * params["wv"]
        scores = jnp.einsum("bhqd,bhkd->bhqk", q, k) * 0.3
        s = x.shape[2]
        keep = {
            "tril": jnp.tril(jnp.ones((s, s), bool)),
            "window": jnp.tril(jnp.ones((s, s), bool)) & jnp.triu(jnp.ones((s, s), bool), -2),
            "batch": batch.get("mask"),
        }.get(mask)
        if keep is not None:
            scores = jnp.where(keep, scores, -1e9)
        probs = jax.nn.softmax(scores, axis=-1)
        return jnp.einsum("bhqk,bhkd->bhqd", probs, v).sum()

    return loss


@pytest.mark.parametrize("mask", [None, "tril", "window", "batch"])
def test_find_attention_reads_axes_and_rejects_other_masks(mask):
    params = {w: jnp.full((16,), 0.5, jnp.float32) for w in ("wq", "wk", "wv")}
    batch = {"x": jnp.ones((2, 4, 8, 16), jnp.float32)}
    if mask == "batch":
        batch["mask"] = jnp.ones((2, 1, 8, 8), bool)
    graph = jscaler.trace(bhsd_attention_loss(mask), params, batch)
    regions = find_attention(graph)
    if mask in ("window", "batch"):  # not a causal or absent mask: the caller must refuse
        assert regions == []
        return
    (r,) = regions
    assert r.q_axes.order == r.k_axes.order == r.v_axes.order == (0, 2, 1, 3)
    assert r.causal == (mask == "tril")
    assert r.scale == pytest.approx(0.3, rel=1e-7)
    assert r.mask_value == (-1e9 if mask else F32_MIN)
    assert_close(*region_output(graph, r), "region vs dense")
