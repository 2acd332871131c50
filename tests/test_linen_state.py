"""Linen variables with mutable collections (``has_aux=True``): BatchNorm's batch_stats."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import jscaler
from spaces import megatron, zero

from parity import assert_matches_reference

LR = 0.1


class BNConvNet(nn.Module):
    """Conv -> BatchNorm -> relu -> pool, twice, then a dense classifier."""

    @nn.compact
    def __call__(self, x, train: bool = True):
        for features in (8, 16):
            x = nn.Conv(features, (3, 3), use_bias=False)(x)  # BN cancels a bias: grad 0
            x = nn.BatchNorm(use_running_average=not train, momentum=0.9)(x)
            x = nn.avg_pool(nn.relu(x), (2, 2), (2, 2))
        return nn.Dense(10)(x.reshape(x.shape[0], -1))


NET = BNConvNet()


def loss_fn(variables, batch):
    logits, new = NET.apply(variables, batch["x"], mutable=["batch_stats"])
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean(), new


def make_batch(seed, n=16):
    kx, ky = jax.random.split(jax.random.key(seed))
    return {
        "x": jax.random.normal(kx, (n, 8, 8, 3)),
        "y": jax.random.randint(ky, (n,), 0, 10),
    }


def init_variables():
    return NET.init(jax.random.key(0), make_batch(0)["x"])


@pytest.mark.parametrize(
    "plan", ["dp", zero(stage=3), megatron(tp=2, dp=4)], ids=["dp", "zero3", "megatron"]
)
def test_batch_stats_are_carried_and_match_one_device(plan):
    """Losses, gradients, params and the running statistics of every step equal
    ``jax.value_and_grad(loss_fn, has_aux=True)`` on one device."""
    batches = [make_batch(s) for s in range(3)]
    trainer = assert_matches_reference(init_variables(), loss_fn, batches, plan, has_aux=True)
    assert trainer.graph.signature.kind == "linen"
    variables = trainer.variables
    assert set(variables) == {"params", "batch_stats"}
    assert not np.allclose(variables["batch_stats"]["BatchNorm_0"]["var"], 1.0)  # they moved
    params = trainer.params  # the "params" collection alone
    assert jax.tree_util.tree_structure(params) == jax.tree_util.tree_structure(
        init_variables()["params"]
    )


def test_traced_names_roles_and_as_fn():
    variables, batch = init_variables(), make_batch(1)
    graph = jscaler.trace(loss_fn, variables, batch, has_aux=True)
    roles = {graph.tensors[t].name: graph.tensors[t].role for t in graph.inputs}
    assert roles["params/Conv_0/kernel"] == "param"
    assert roles["batch_stats/BatchNorm_0/mean"] == "state"
    assert len(graph.outputs) == 1 + 4  # loss, then mean and var of two BatchNorms
    loss, new = graph.as_fn()(variables, batch)
    want_loss, want_new = loss_fn(variables, batch)
    np.testing.assert_allclose(loss, want_loss, rtol=1e-5)
    for x, y in zip(jax.tree_util.tree_leaves(new), jax.tree_util.tree_leaves(want_new)):
        np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-7)


# ---- bad input ---------------------------------------------------------------------------


def wrong_tree(variables, batch):
    loss, _ = loss_fn(variables, batch)
    return loss, {"batch_stats": {"BatchNorm_0": 0.0}}


def test_has_aux_errors():
    variables, batch = init_variables(), make_batch(0)
    with pytest.raises(jscaler.TraceError, match=r"must return \(loss, new_collections\)"):
        jscaler.trace(lambda v, b: loss_fn(v, b)[0], variables, batch, has_aux=True)
    with pytest.raises(jscaler.TraceError, match=r"returned collections \[\]"):
        jscaler.trace(lambda v, b: (loss_fn(v, b)[0], {}), variables, batch, has_aux=True)
    with pytest.raises(jscaler.TraceError, match="aux must be the updated collections"):
        jscaler.trace(lambda v, b: (loss_fn(v, b)[0], 1.0), variables, batch, has_aux=True)
    with pytest.raises(
        jscaler.TraceError,
        match=r"missing \[.*BatchNorm_1/mean'.*unexpected \['batch_stats/BatchNorm_0'\]",
    ):
        jscaler.trace(wrong_tree, variables, batch, has_aux=True)
    with pytest.raises(jscaler.TraceError, match="expects linen variables"):
        jscaler.trace(loss_fn, variables["params"], batch, has_aux=True)
    with pytest.raises(jscaler.TraceError, match="nnx model's loss returns the loss alone"):
        jscaler.trace(
            lambda m, b: m(b), nnx.Linear(2, 1, rngs=nnx.Rngs(0)), jnp.ones((4, 2)), has_aux=True
        )


def test_tuple_without_has_aux_is_a_clear_error():
    with pytest.raises(jscaler.TraceError, match="pass has_aux=True with the linen variables"):
        jscaler.parallelize(init_variables(), loss_fn, optax.sgd(LR), make_batch(0))


def test_state_shape_must_not_change():
    def grows(v, b):
        loss, new = loss_fn(v, b)
        return loss, jax.tree_util.tree_map(lambda x: jnp.concatenate([x, x]), new)

    with pytest.raises(jscaler.TraceError, match="must keep its shape and dtype"):
        jscaler.trace(grows, init_variables(), make_batch(0), has_aux=True)


def test_variables_is_for_linen():
    trainer = jscaler.parallelize(
        init_variables()["params"],
        lambda p, b: loss_fn({"params": p, **STATS}, b)[0],
        optax.sgd(LR),
        make_batch(0),
    )
    with pytest.raises(TypeError, match=r"a params pytree \(use .params\)"):
        _ = trainer.variables


STATS = {k: v for k, v in init_variables().items() if k != "params"}


def test_export_gives_every_collection():
    trainer = jscaler.parallelize(
        init_variables(), loss_fn, optax.sgd(LR), make_batch(0), plan=zero(stage=3), has_aux=True
    )
    trainer.step(make_batch(0))
    exported, held = trainer.export(), trainer.variables
    assert set(exported) == {"params", "batch_stats"}
    for x, y in zip(jax.tree_util.tree_leaves(exported), jax.tree_util.tree_leaves(held)):
        np.testing.assert_array_equal(x, y)
