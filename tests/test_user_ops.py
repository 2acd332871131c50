"""What a user's model may already contain: sharding constraints (replaced by the plan's
layouts), linen nn.scan (a loop op), shard_map and pallas_call (refused, naming them)."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
import pytest
from jax.experimental import pallas as pl
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import jscaler
from jscaler.runtime.reference import compare, reference_steps, trainer_steps

MESH = jax.make_mesh((8,), ("data",), axis_types=(AxisType.Auto,))
PARAMS = {"w": jnp.linspace(-1, 1, 64).reshape(8, 8)}


def batches():
    k = jax.random.split(jax.random.key(0), 2)
    return [{"x": jax.random.normal(k[i], (16, 8)), "y": jnp.arange(16.0) / 16} for i in range(2)]


def head(h, b):
    return jnp.mean((jnp.tanh(h).sum(-1) - b["y"]) ** 2)


def with_constraint(p, b):
    h = b["x"] @ p["w"]
    h = jax.lax.with_sharding_constraint(h, NamedSharding(MESH, P(None, "data")))  # a bad one
    return head(h, b)


def assert_parity(params, loss, plan="dp", reference=None):
    want = reference_steps(params, reference or loss, optax.sgd(0.1), batches())
    trainer = jscaler.parallelize(params, loss, optax.sgd(0.1), batches()[0], plan=plan)
    mm = compare(trainer_steps(trainer, batches()), want)
    assert mm.ok, "\n".join(mm.lines)
    return trainer


def test_a_sharding_constraint_is_replaced_by_the_plans_layout():
    with pytest.warns(UserWarning, match="with_sharding_constraint at module path"):
        trainer = assert_parity(
            PARAMS, with_constraint, reference=lambda p, b: head(b["x"] @ p["w"], b)
        )  # one device cannot take an 8-device constraint: the same loss without it
    hlo = trainer.hlo(batches()[0])
    assert "all-to-all" not in hlo and "all-gather" not in hlo  # the user's layout is gone


class Cell(nn.Module):
    @nn.compact
    def __call__(self, c, _):
        return jnp.tanh(nn.Dense(8)(c)), None


class Scanned(nn.Module):
    @nn.compact
    def __call__(self, x):
        scan = nn.scan(Cell, variable_axes={"params": 0}, split_rngs={"params": True}, length=3)
        return scan()(x, None)[0]


def test_linen_nn_scan_trains_equal_to_one_device():
    model = Scanned()
    params = model.init(jax.random.key(0), jnp.ones((16, 8)))["params"]
    assert_parity(params, lambda p, b: head(model.apply({"params": p}, b["x"]), b))


def with_shard_map(p, b):
    f = jax.shard_map(lambda a: a * 2, mesh=MESH, in_specs=P("data"), out_specs=P("data"))
    return head(f(b["x"] @ p["w"]), b)


def _double(x_ref, o_ref):
    o_ref[...] = x_ref[...] * 2


def with_pallas(p, b):
    h = b["x"] @ p["w"]
    shape = jax.ShapeDtypeStruct(h.shape, h.dtype)
    return head(pl.pallas_call(_double, out_shape=shape, interpret=True)(h), b)


@pytest.mark.parametrize(
    "loss, primitive, hint",
    [(with_shard_map, "shard_map", "without shard_map"), (with_pallas, "pallas_call", "Pallas")],
)
def test_shard_map_and_pallas_are_refused_naming_the_op(loss, primitive, hint):
    with pytest.raises(jscaler.UnsupportedOpError) as err:
        jscaler.parallelize(PARAMS, loss, optax.sgd(0.1), batches()[0])
    msg = str(err.value)
    assert f"primitive {primitive!r} at module path" in msg and hint in msg
    assert "jscaler.register_op" in msg
