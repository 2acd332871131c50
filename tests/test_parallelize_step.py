"""@jscaler.parallelize_step: an existing train step (linen TrainState, nnx Optimizer)
parallelised as written, equal to the same code run undecorated on one device."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
import pytest
from flax import nnx
from flax.training import train_state
from jax.sharding import NamedSharding, PartitionSpec

import jscaler
from jscaler.runtime.reference import compare
from spaces import megatron, zero

STEPS = 3


class MLP(nn.Module):
    @nn.compact
    def __call__(self, x):
        x = nn.LayerNorm()(nn.relu(nn.Dense(32)(x)))
        return nn.Dense(4)(nn.relu(nn.Dense(16)(x)))


def batches(rows=16, steps=STEPS):
    out = []
    for i in range(steps):
        kx, ky = jax.random.split(jax.random.key(10 + i))
        out.append({"x": jax.random.normal(kx, (rows, 8)), "y": jax.random.normal(ky, (rows, 4))})
    return out


def linen_state():
    params = MLP().init(jax.random.key(0), jnp.zeros((1, 8)))["params"]
    return train_state.TrainState.create(apply_fn=MLP().apply, params=params, tx=optax.sgd(0.1))


def train_step(state, batch):
    """A user's step as written for one device, with jscaler.value_and_grad."""

    def loss_fn(params):
        pred = state.apply_fn({"params": params}, batch["x"])
        return jnp.mean((pred - batch["y"]) ** 2)

    loss, grads = jscaler.value_and_grad(loss_fn)(state.params)
    return state.apply_gradients(grads=grads), {"loss": loss, "grads": grads}


def run(step, steps=STEPS):
    """Per step (loss, grads, params after the update) as jscaler's parity check takes
    them."""
    state, out = linen_state(), []
    for b in batches(steps=steps):
        state, metrics = step(state, b)
        params = jax.device_get(state.params)  # the next step donates the state
        out.append((float(metrics["loss"]), metrics["grads"], params))
    return state, out


@pytest.fixture(scope="module")
def reference():
    """The undecorated step under jax.jit on one device (jscaler.value_and_grad is
    jax.value_and_grad there)."""
    _, out = run(jax.jit(train_step))
    return out


@pytest.mark.parametrize(
    "plan, microbatches, kernel_spec",
    [
        ("dp", 1, PartitionSpec()),
        (megatron(tp=2, dp=4), 1, PartitionSpec(None, "tp")),
        (megatron(tp=2, dp=4), 2, PartitionSpec(None, "tp")),
        (zero(stage=3), 2, PartitionSpec(None, "dp")),
    ],
    ids=["dp", "megatron", "megatron-mb2", "zero3-mb2"],
)
def test_linen_train_state_step_equals_one_device(reference, plan, microbatches, kernel_spec):
    step = jscaler.parallelize_step(train_step, plan=plan, devices=8, microbatches=microbatches)
    state, got = run(step)
    mm = compare(got, reference)
    assert mm.ok, "\n".join(mm.lines[:10])
    kernel = state.params["Dense_0"]["kernel"]  # stored as the plan lays it out
    assert isinstance(kernel.sharding, NamedSharding)
    assert kernel.sharding.spec == kernel_spec and len(kernel.sharding.device_set) == 8
    assert step.compiles == 1


def test_a_second_call_reuses_the_program_and_a_new_batch_shape_compiles_once():
    traces = []

    def counted(state, batch):
        traces.append(batch["x"].shape[0])
        return train_step(state, batch)

    step = jscaler.parallelize_step(counted, plan=megatron(tp=2, dp=4), devices=8)
    state = linen_state()
    state, _ = step(state, batches()[0])
    first = len(traces)
    state, _ = step(state, batches()[1])
    assert len(traces) == first and step.compiles == 1
    state, _ = step(state, batches(rows=32)[0])
    assert step.compiles == 2 and traces[-1] == 32
    seen = len(traces)
    for rows in (32, 16, 32):
        state, _ = step(state, batches(rows=rows)[0])
    assert len(traces) == seen and step.compiles == 2


def test_grad_with_aux_and_an_explicit_batch_argument_averages_over_microbatches():
    def step(state, batch):
        def loss_fn(params, b):
            err = state.apply_fn({"params": params}, b["x"]) - b["y"]
            return jnp.mean(err**2), {"mae": jnp.mean(jnp.abs(err))}

        grads, aux = jscaler.grad(loss_fn, has_aux=True)(state.params, batch)
        return state.apply_gradients(grads=grads), {**aux, "grads": grads}

    b = batches()[0]
    want_state, want = jax.jit(step)(linen_state(), b)
    got_state, got = jscaler.parallelize_step(step, devices=8, microbatches=2)(linen_state(), b)
    # the mean absolute error of two equal halves is that of the whole batch
    assert jnp.allclose(got["mae"], want["mae"], rtol=1e-5)
    mm = compare([(0.0, got["grads"], got_state.params)], [(0.0, want["grads"], want_state.params)])
    assert mm.ok, "\n".join(mm.lines[:10])


class Net(nnx.Module):
    def __init__(self, rngs):
        self.l1 = nnx.Linear(8, 32, use_bias=False, rngs=rngs)  # BN cancels a bias: grad 0
        self.bn = nnx.BatchNorm(32, rngs=rngs)
        self.l2 = nnx.Linear(32, 4, rngs=rngs)

    def __call__(self, x):
        return self.l2(jax.nn.relu(self.bn(self.l1(x))))


def nnx_step(model, optimizer, batch):
    def loss_fn(model):
        return jnp.mean((model(batch["x"]) - batch["y"]) ** 2)

    loss, grads = jscaler.value_and_grad(loss_fn)(model)  # was nnx.value_and_grad
    optimizer.update(model, grads)
    return {"loss": loss, "grads": grads}


def test_nnx_model_and_optimizer_are_updated_in_place_as_on_one_device():
    def make():
        model = Net(nnx.Rngs(0))
        return model, nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)

    ref_model, ref_opt = make()
    model, opt = make()
    step = jscaler.parallelize_step(nnx_step, plan=megatron(tp=2, dp=4), devices=8)
    ref_step = nnx.jit(nnx_step)
    got, want = [], []
    for b in batches():
        m = step(model, opt, b)
        got.append((float(m["loss"]), m["grads"], jax.device_get(nnx.state(model))))
        m = ref_step(ref_model, ref_opt, b)
        want.append((float(m["loss"]), m["grads"], jax.device_get(nnx.state(ref_model))))
    mm = compare(got, want)  # batch statistics included, with the parameters
    assert mm.ok, "\n".join(mm.lines[:10])
    assert int(opt.step[...]) == STEPS and step.compiles == 1
    assert model.l1.kernel[...].sharding.spec == PartitionSpec(None, "tp")


def test_outside_parallelize_step_it_is_jax_value_and_grad():
    state, b = linen_state(), batches()[0]

    def loss_fn(p):
        return jnp.mean((state.apply_fn({"params": p}, b["x"]) - b["y"]) ** 2)

    want = jax.value_and_grad(loss_fn)(state.params)
    got = jscaler.value_and_grad(loss_fn)(state.params)
    assert jax.tree.all(jax.tree.map(jnp.array_equal, got, want))
    model = Net(nnx.Rngs(0))
    loss_m = lambda m: jnp.mean(m(b["x"]) ** 2)  # noqa: E731
    assert jnp.array_equal(
        jscaler.grad(loss_m)(model)["l1"]["kernel"][...],
        nnx.grad(loss_m)(Net(nnx.Rngs(0)))["l1"]["kernel"][...],
    )


def test_a_step_without_jscaler_value_and_grad_is_a_clear_error():
    def step(state, batch):
        loss_fn = lambda p: jnp.mean(state.apply_fn({"params": p}, batch["x"]))  # noqa: E731
        loss, grads = jax.value_and_grad(loss_fn)(state.params)
        return state.apply_gradients(grads=grads), loss

    with pytest.raises(jscaler.TraceError, match="jscaler.value_and_grad where you had jax"):
        jscaler.parallelize_step(step, devices=8)(linen_state(), batches()[0])


def test_two_losses_in_one_step_are_a_clear_error():
    def step(state, batch):
        loss_fn = lambda p: jnp.mean(state.apply_fn({"params": p}, batch["x"]))  # noqa: E731
        _, g1 = jscaler.value_and_grad(loss_fn)(state.params)
        _, g2 = jscaler.value_and_grad(loss_fn)(state.params)
        return state.apply_gradients(grads=g1), g2

    with pytest.raises(jscaler.TraceError, match="called twice"):
        jscaler.parallelize_step(step, devices=8)(linen_state(), batches()[0])


def test_indivisible_microbatches_and_a_schedule_without_pipeline_are_clear_errors():
    with pytest.raises(jscaler.PlanError, match="schedule= orders pipeline stages"):
        jscaler.parallelize_step(train_step, devices=8, schedule=object())(
            linen_state(), batches()[0]
        )
    with pytest.raises(jscaler.PlanError, match="split into 3 micro-batches"):
        jscaler.parallelize_step(train_step, devices=8, microbatches=3)(linen_state(), batches()[0])


def test_a_loss_inside_a_scan_is_a_clear_error():
    def step(state, batch):
        def body(carry, x):
            loss_fn = lambda p: jnp.mean(state.apply_fn({"params": p}, x))  # noqa: E731
            return carry, jscaler.value_and_grad(loss_fn)(state.params)[0]

        return state, jax.lax.scan(body, 0, batch["x"][None])[1]

    with pytest.raises(jscaler.TraceError, match="top level of the step"):
        jscaler.parallelize_step(step, devices=8)(linen_state(), batches()[0])
