"""Tests of the reference models in ``models/`` and their registry."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import models
from models import gpt, recycler

TINY = ["gpt-tiny", "convnet-tiny", "mlp-tiny", "recycler-tiny"]

# name -> {key: (shape without the batch dim, dtype)}
BATCH_LAYOUT = {
    "gpt-tiny": {"tokens": ((32,), jnp.int32), "targets": ((32,), jnp.int32)},
    "convnet-tiny": {"images": ((16, 16, 3), jnp.float32), "labels": ((), jnp.int32)},
    "mlp-tiny": {"x": ((32,), jnp.float32), "y": ((8,), jnp.float32)},
    "recycler-tiny": {"x": ((8, 16), jnp.float32), "y": ((8, 4), jnp.float32)},
}


def _value_and_grad(spec: models.ModelSpec, model, batch):
    """Jitted, because op-by-op autodiff of these models is slow on CPU."""
    if spec.kind == "nnx":
        return nnx.jit(nnx.value_and_grad(spec.loss))(model, batch)
    return jax.jit(jax.value_and_grad(spec.loss))(model, batch)


def _train(spec: models.ModelSpec, steps: int, lr: float) -> list[float]:
    """Runs ``steps`` of Adam on fresh batches and returns the per-step losses."""
    model = spec.init(0)
    if spec.kind == "nnx":
        opt = nnx.Optimizer(model, optax.adam(lr), wrt=nnx.Param)

        @nnx.jit
        def step(model, opt, batch):
            value, grads = nnx.value_and_grad(spec.loss)(model, batch)
            opt.update(model, grads)
            return value

        return [float(step(model, opt, spec.batch(spec.batch_size, i))) for i in range(steps)]

    tx = optax.adam(lr)

    @jax.jit
    def step_params(params, opt_state, batch):
        value, grads = jax.value_and_grad(spec.loss)(params, batch)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, value

    params, opt_state, losses = model, tx.init(model), []
    for i in range(steps):
        params, opt_state, value = step_params(params, opt_state, spec.batch(spec.batch_size, i))
        losses.append(float(value))
    return losses


def test_registry_names():
    expected = {"gpt-tiny", "gpt-small", "gpt-1.3b", "llama-7b", "llama-13b"} | set(TINY)
    expected |= {"swin-tiny", "swin-bench", "t5-tiny", "alphafold2-tiny", "mixtral-8x7b"}
    expected |= {"moe-tiny", "moe-tiny-dropless", "moe-small", "moe-small-dropless"}
    expected |= {"gpt-tiny-scan", "gpt-tiny-scan-remat"}
    assert set(models.names()) == expected
    for name in models.names():
        spec = models.get(name)
        assert spec.name == name
        assert spec.kind in ("nnx", "linen", "params")
        assert spec.batch_size % 8 == 0


def test_registry_unknown_name_lists_known_names():
    with pytest.raises(KeyError) as info:
        models.get("no-such-model")
    assert "no-such-model" in str(info.value)
    assert "gpt-tiny" in str(info.value) and "mlp-tiny" in str(info.value)


@pytest.mark.parametrize("name", TINY)
def test_batch_layout_and_determinism(name):
    spec = models.get(name)
    a, b, c = spec.batch(8, 0), spec.batch(8, 0), spec.batch(8, 1)
    assert set(a) == set(BATCH_LAYOUT[name])
    for key, (shape, dtype) in BATCH_LAYOUT[name].items():
        assert a[key].shape == (8, *shape) and a[key].dtype == dtype, key
        np.testing.assert_array_equal(a[key], b[key])
    assert any(not np.array_equal(a[k], c[k]) for k in a), "seed should change the batch"


@pytest.mark.parametrize("name", TINY)
def test_loss_and_grads_are_finite(name):
    spec = models.get(name)
    value, grads = _value_and_grad(spec, spec.init(0), spec.batch(spec.batch_size, 0))
    assert value.shape == () and bool(jnp.isfinite(value))
    leaves = jax.tree.leaves(grads)
    assert leaves and all(bool(jnp.all(jnp.isfinite(g))) for g in leaves)
    assert any(bool(jnp.any(g != 0)) for g in leaves)


@pytest.mark.parametrize("name", TINY)
def test_init_is_deterministic_in_seed(name):
    spec = models.get(name)

    def params(seed):
        out = spec.init(seed)
        return jax.tree.leaves(nnx.state(out, nnx.Param) if spec.kind == "nnx" else out)

    first, again, other = params(0), params(0), params(1)
    assert all(np.array_equal(x, y) for x, y in zip(first, again))
    assert not all(np.array_equal(x, y) for x, y in zip(first, other))


def test_gpt_targets_are_shifted_tokens():
    batch = gpt.synthetic_batch(gpt.tiny(), 4, seed=3)
    np.testing.assert_array_equal(batch["tokens"][:, 1:], batch["targets"][:, :-1])


def test_gpt_logits_shape():
    cfg = gpt.tiny()
    logits = gpt.GPT(cfg, rngs=nnx.Rngs(0))(gpt.synthetic_batch(cfg, 2)["tokens"])
    assert logits.shape == (2, cfg.seq_len, cfg.vocab_size) and logits.dtype == jnp.float32


def test_gpt_is_causal():
    cfg = gpt.tiny()
    model = gpt.GPT(cfg, rngs=nnx.Rngs(0))
    tokens = gpt.synthetic_batch(cfg, 2)["tokens"]
    k = 20
    changed = tokens.at[:, k].set((tokens[:, k] + 1) % cfg.vocab_size)
    before, after = model(tokens), model(changed)
    np.testing.assert_allclose(before[:, :k], after[:, :k], rtol=1e-5, atol=1e-5)
    assert not np.allclose(before[:, k:], after[:, k:])


def test_gpt_module_paths():
    model = gpt.GPT(gpt.tiny(), rngs=nnx.Rngs(0))
    paths = {"/".join(map(str, p)) for p, n in nnx.iter_graph(model) if isinstance(n, nnx.Module)}
    for path in [
        "embed",
        "blocks/0/norm1",
        "blocks/0/attn/q_proj",
        "blocks/0/attn/k_proj",
        "blocks/0/attn/v_proj",
        "blocks/0/attn/o_proj",
        "blocks/0/norm2",
        "blocks/0/mlp/gate_proj",
        "blocks/0/mlp/up_proj",
        "blocks/3/mlp/down_proj",
        "norm_f",
        "lm_head",
    ]:
        assert path in paths, path
    assert not hasattr(model.lm_head, "bias") or model.lm_head.bias is None


def test_gpt_num_params_matches_built_model():
    cfg = gpt.tiny()
    state = nnx.state(gpt.GPT(cfg, rngs=nnx.Rngs(0)), nnx.Param)
    assert gpt.num_params(cfg) == sum(x.size for x in jax.tree.leaves(state))


def test_num_params_of_large_configs_without_allocating():
    assert 6.5e9 <= gpt.num_params(gpt.llama_7b()) <= 7.0e9
    assert 20e6 <= gpt.num_params(gpt.small()) <= 22e6


@pytest.mark.parametrize(
    "changes, match",
    [({"n_heads": 3}, "divisible"), ({"d_model": 60, "n_heads": 4}, "even"), ({"d_ff": 0}, "d_ff")],
)
def test_gpt_config_validation(changes, match):
    with pytest.raises(ValueError, match=match):
        gpt.tiny().replace(**changes)


def test_gpt_dropout_is_off_by_default_and_works_when_on():
    cfg = gpt.tiny()
    tokens = gpt.synthetic_batch(cfg, 2)["tokens"]
    model = gpt.GPT(cfg, rngs=nnx.Rngs(0))
    np.testing.assert_array_equal(model(tokens), model(tokens))
    dropped = gpt.GPT(cfg.replace(dropout=0.5), rngs=nnx.Rngs(0))
    assert not np.allclose(dropped(tokens), dropped(tokens))
    dropped.eval()
    np.testing.assert_array_equal(dropped(tokens), dropped(tokens))


@pytest.mark.parametrize(
    "name, steps, lr", [("gpt-tiny", 30, 1e-2), ("convnet-tiny", 30, 1e-2), ("mlp-tiny", 30, 1e-2)]
)
def test_training_lowers_the_loss(name, steps, lr):
    losses = _train(models.get(name), steps, lr)
    assert all(np.isfinite(losses))
    assert np.mean(losses[-5:]) < 0.6 * losses[0], losses


def test_recycler_trains_only_through_its_last_pass():
    cfg = recycler.tiny()
    model = recycler.Recycler(cfg, rngs=nnx.Rngs(0))
    batch = recycler.synthetic_batch(cfg, 4)
    prev = jnp.zeros((4, cfg.items, cfg.d_model))
    for _ in range(cfg.passes - 1):
        prev = model.trunk(batch["x"], prev)

    def last_pass(m):  # the earlier passes' output taken as a constant
        out = m.head(m.final_norm(m.trunk(batch["x"], prev)))
        return jnp.mean((out - batch["y"]) ** 2)

    full, g_full = nnx.value_and_grad(recycler.loss)(model, batch)
    last, g_last = nnx.value_and_grad(last_pass)(model)
    np.testing.assert_allclose(full, last, rtol=1e-6)
    for a, b in zip(jax.tree.leaves(g_full), jax.tree.leaves(g_last)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)
    # and recycling changes the result: one pass from zeros is another model
    one = recycler.Recycler(dataclasses.replace(cfg, passes=1), rngs=nnx.Rngs(0))
    assert abs(float(recycler.loss(one, batch)) - float(full)) > 1e-4
