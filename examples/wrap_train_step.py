"""Keep your own training step: decorate it and write jscaler.value_and_grad where it had
jax.value_and_grad.

A linen model with flax's TrainState and an optax optimizer, written for one device. The
decorator traces the loss once per batch shape, plans it (here Megatron tensor
parallelism x data parallelism, with 2 micro-batches of gradient accumulation), and
compiles the whole step, optimizer included, as one SPMD program.

    python examples/wrap_train_step.py
"""

from jscaler.setup import use_cpu_devices

use_cpu_devices(8)

import flax.linen as nn  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402
from flax.training import train_state  # noqa: E402

import jscaler  # noqa: E402
from spaces import megatron  # noqa: E402


class MLP(nn.Module):
    @nn.compact
    def __call__(self, x):
        x = nn.relu(nn.Dense(256)(x))
        return nn.Dense(16)(nn.relu(nn.Dense(256)(x)))


def train_step(state, batch):  # as written for one device, but for jscaler.value_and_grad
    def loss_fn(params):
        pred = state.apply_fn({"params": params}, batch["x"])
        return jnp.mean((pred - batch["y"]) ** 2)

    loss, grads = jscaler.value_and_grad(loss_fn)(state.params)
    return state.apply_gradients(grads=grads), {"loss": loss}


def batch(step):
    kx, ky = jax.random.split(jax.random.key(step))
    x = jax.random.normal(kx, (64, 32))
    return {"x": x, "y": jnp.sin(x[:, :16]) + 0.1 * jax.random.normal(ky, (64, 16))}


def main():
    model = MLP()
    params = model.init(jax.random.key(0), jnp.zeros((1, 32)))["params"]
    state = train_state.TrainState.create(apply_fn=model.apply, params=params, tx=optax.adam(1e-3))
    single = jax.jit(train_step)  # the same code on one device, for comparison
    parallel = jscaler.parallelize_step(plan=megatron(tp=2, dp=4), devices=8, microbatches=2)(
        train_step
    )
    ref_state = state
    for step in range(20):
        state, metrics = parallel(state, batch(step))
        ref_state, ref = single(ref_state, batch(step))
        if step % 5 == 0 or step == 19:
            print(f"step {step}: loss {float(metrics['loss']):.5f} (one device "
                  f"{float(ref['loss']):.5f})")  # fmt: skip
    kernel = state.params["Dense_0"]["kernel"]
    print(f"Dense_0 kernel {kernel.shape} lies {kernel.sharding.spec} on 8 devices")
    same = abs(float(metrics["loss"]) - float(ref["loss"])) <= 1e-4 * abs(float(ref["loss"]))
    return 0 if same else 1


if __name__ == "__main__":
    raise SystemExit(main())
