"""Parallelise a model you did not write for jscaler: Hugging Face's Flax GPT-2 (a linen
params pytree) under Megatron tensor parallelism, then your own linen CNN whose BatchNorm
updates ``batch_stats`` (``has_aux=True``) under ZeRO-3.

    pip install "transformers<5"   # in the dev extra; v5 dropped the Flax models
    python examples/own_model.py
"""

from jscaler.setup import use_cpu_devices

use_cpu_devices(8)  # 8 simulated CPU devices; on GPUs, leave this out

import flax.linen as nn  # noqa: E402
import jax  # noqa: E402
import optax  # noqa: E402
import transformers  # noqa: E402
from transformers import FlaxGPT2LMHeadModel, GPT2Config  # noqa: E402

import jscaler  # noqa: E402
from spaces import megatron, zero  # noqa: E402

transformers.logging.set_verbosity_error()  # 4.5x logs that its Flax classes are deprecated


def gpt2():
    """A params pytree: ``loss(params, batch)`` calls the model with those params."""
    cfg = GPT2Config(vocab_size=256, n_positions=32, n_embd=64, n_layer=2, n_head=4)
    model = FlaxGPT2LMHeadModel(cfg, seed=0)  # random init, nothing downloaded

    def loss(params, batch):
        logits = model(batch["ids"], params=params).logits
        return optax.softmax_cross_entropy_with_integer_labels(
            logits[:, :-1], batch["ids"][:, 1:]
        ).mean()

    data = lambda step: {"ids": jax.random.randint(jax.random.key(step), (8, 32), 0, 256)}  # noqa: E731
    trainer = jscaler.parallelize(
        model.params, loss, optax.adam(1e-2), data(0), plan=megatron(tp=2, dp=4)
    )
    for step in range(5):
        print(f"gpt2 step {step}: loss {trainer.step(data(step % 2))['loss']:.4f}")
    model.params = trainer.params  # the trained weights, back in the Hugging Face model


class CNN(nn.Module):
    @nn.compact
    def __call__(self, x):
        x = nn.relu(nn.BatchNorm(use_running_average=False)(nn.Conv(16, (3, 3))(x)))
        return nn.Dense(10)(x.mean(axis=(1, 2)))


def linen_with_batch_stats():
    """Linen variables {"params", "batch_stats"}: the loss returns (loss, new collections),
    as ``apply(..., mutable=[...])`` gives them; only "params" is trained."""
    cnn = CNN()

    def loss(variables, batch):
        logits, new = cnn.apply(variables, batch["x"], mutable=["batch_stats"])
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean(), new

    def data(step):
        key = jax.random.key(step)
        x = jax.random.normal(key, (16, 8, 8, 3))
        return {"x": x, "y": (x.mean(axis=(1, 2, 3)) > 0).astype(int)}

    variables = cnn.init(jax.random.key(0), data(0)["x"])
    trainer = jscaler.parallelize(
        variables, loss, optax.adam(1e-2), data(0), plan=zero(stage=3), has_aux=True
    )
    for step in range(5):
        print(f"cnn step {step}: loss {trainer.step(data(step % 2))['loss']:.4f}")
    mean = trainer.variables["batch_stats"]["BatchNorm_0"]["mean"]
    print(f"running mean of the first BatchNorm: {mean[:3]} ...")


if __name__ == "__main__":
    gpt2()
    linen_with_batch_stats()
