"""@jscaler.parallelize_step under a pipeline plan (Alpa's two-part step: the loss and
gradients by the pipeline runtime, the user's update in one jit over every pipeline
device), equal to the same step run undecorated on one device."""

import jax
import jax.numpy as jnp
import optax
import pytest
from flax import nnx
from jax.sharding import NamedSharding
from test_parallelize_step import Net, batches, linen_state, nnx_step, run, train_step

import jscaler
from jscaler.runtime.reference import compare
from schedules import gpipe, zero_bubble
from spaces import megatron

PIPELINE = megatron(pp=2, dp=4)


@pytest.fixture(scope="module")
def reference():
    _, out = run(jax.jit(train_step))
    return out


@pytest.mark.parametrize(
    "microbatches, schedule",
    [(2, None), (4, zero_bubble), (4, gpipe)],
    ids=["1f1b-mb2", "zero_bubble-mb4", "gpipe-mb4"],
)
def test_linen_train_state_step_under_a_pipeline_equals_one_device(
    reference, microbatches, schedule
):
    step = jscaler.parallelize_step(
        train_step, plan=PIPELINE, devices=8, microbatches=microbatches, schedule=schedule
    )
    state, got = run(step)
    mm = compare(got, reference)
    assert mm.ok, "\n".join(mm.lines[:10])
    (entry,) = step.programs.values()
    stages = entry.driver.stages
    assert len(stages) == 2 and all(st.params for st in stages)  # two stages, both trained
    kernel = state.params["Dense_0"]["kernel"]  # the update layout: over every device
    assert isinstance(kernel.sharding, NamedSharding) and len(kernel.sharding.device_set) == 8
    assert isinstance(step.plan(state, batches()[0]), jscaler.PipelinePlan)
    assert step.compiles == 1


def test_adam_state_and_a_closed_over_step_counter_stay_in_the_update_layout():
    def step(state, batch):
        def loss_fn(params):
            err = state.apply_fn({"params": params}, batch["x"]) - batch["y"]
            return jnp.mean(err**2) / (1.0 + state.step)  # a replicated input of the loss

        loss, grads = jscaler.value_and_grad(loss_fn)(state.params)
        return state.apply_gradients(grads=grads), {"loss": loss, "grads": grads}

    def adam_state():
        s = linen_state()
        return s.replace(tx=optax.adam(0.01), opt_state=optax.adam(0.01).init(s.params))

    def steps(fn):
        state, out = adam_state(), []
        for b in batches():
            state, m = fn(state, b)
            out.append((float(m["loss"]), m["grads"], jax.device_get(state.params)))
        return state, out

    _, want = steps(jax.jit(step))
    pstep = jscaler.parallelize_step(step, plan=PIPELINE, devices=8, microbatches=2)
    state, got = steps(pstep)
    mm = compare(got, want)
    assert mm.ok, "\n".join(mm.lines[:10])
    mu = state.opt_state[0].mu["Dense_0"]["kernel"]
    assert mu.sharding == state.params["Dense_0"]["kernel"].sharding
    assert int(state.step) == 3 and pstep.compiles == 1
    for rows in (32, 16, 32):  # a new batch shape compiles once, then is cached
        state, _ = pstep(state, batches(rows=rows)[0])
    assert pstep.compiles == 2


def test_nnx_optimizer_under_a_pipeline_is_updated_in_place_as_on_one_device():
    class Deep(nnx.Module):
        def __init__(self, rngs):
            self.l1 = nnx.Linear(8, 32, rngs=rngs)
            self.l2 = nnx.Linear(32, 32, rngs=rngs)
            self.l3 = nnx.Linear(32, 4, rngs=rngs)

        def __call__(self, x):
            return self.l3(jax.nn.relu(self.l2(jax.nn.relu(self.l1(x)))))

    def make():
        model = Deep(nnx.Rngs(0))
        return model, nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)

    (model, opt), (ref_model, ref_opt) = make(), make()
    step = jscaler.parallelize_step(nnx_step, plan=PIPELINE, devices=8, microbatches=2)
    ref_step = nnx.jit(nnx_step)
    got, want = [], []
    for b in batches():
        m = step(model, opt, b)
        got.append((float(m["loss"]), m["grads"], jax.device_get(nnx.state(model))))
        m = ref_step(ref_model, ref_opt, b)
        want.append((float(m["loss"]), m["grads"], jax.device_get(nnx.state(ref_model))))
    mm = compare(got, want)
    assert mm.ok, "\n".join(mm.lines[:10])
    assert int(opt.step[...]) == 3


def test_mutable_state_and_aux_under_a_pipeline_are_clear_errors():
    model = Net(nnx.Rngs(0))  # nnx.BatchNorm: statistics updated by the loss
    opt = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)
    step = jscaler.parallelize_step(nnx_step, plan=PIPELINE, devices=8)
    with pytest.raises(jscaler.PlanError, match="without mutable state.*'bn/"):
        step(model, opt, batches()[0])

    def aux_step(state, batch):
        def loss_fn(params):
            err = state.apply_fn({"params": params}, batch["x"]) - batch["y"]
            return jnp.mean(err**2), jnp.mean(jnp.abs(err))

        (loss, mae), grads = jscaler.value_and_grad(loss_fn, has_aux=True)(state.params)
        return state.apply_gradients(grads=grads), mae

    with pytest.raises(jscaler.PlanError, match="drop has_aux=True"):
        jscaler.parallelize_step(aux_step, plan=PIPELINE, devices=8)(linen_state(), batches()[0])
