"""A plain-function MLP over a params dict, with no Flax at all.

It is the simplest model jscaler accepts: ``loss(params, batch)`` over an arbitrary
pytree, which keeps the tracer honest about not depending on Flax module structure.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp

__all__ = ["MLPConfig", "tiny", "init", "apply", "loss", "synthetic_batch"]


@dataclass(frozen=True)
class MLPConfig:
    """Hyper-parameters of the MLP.

    Attributes:
        in_dim: Input features.
        hidden: Widths of the hidden (tanh) layers.
        out_dim: Output features (the last layer is linear).
    """

    in_dim: int = 32
    hidden: tuple[int, ...] = (64, 64)
    out_dim: int = 8

    def __post_init__(self) -> None:
        if min(self.in_dim, self.out_dim, *self.hidden) <= 0:
            raise ValueError(f"MLPConfig widths must be positive, got {self}")

    @property
    def widths(self) -> tuple[int, ...]:
        """All layer widths, input first and output last."""
        return (self.in_dim, *self.hidden, self.out_dim)


def tiny() -> MLPConfig:
    """32 inputs, hidden widths (64, 64), 8 outputs."""
    return MLPConfig()


Params = dict[str, list[dict[str, jax.Array]]]


def init(cfg: MLPConfig, seed: int = 0) -> Params:
    """LeCun-normal weights and zero biases: ``{"layers": [{"w": [in, out], "b": [out]}]}``."""
    keys = jax.random.split(jax.random.key(seed), len(cfg.widths) - 1)
    layers = []
    for key, d_in, d_out in zip(keys, cfg.widths[:-1], cfg.widths[1:]):
        w = jax.random.normal(key, (d_in, d_out), jnp.float32) / jnp.sqrt(d_in)
        layers.append({"w": w, "b": jnp.zeros((d_out,), jnp.float32)})
    return {"layers": layers}


def apply(params: Params, x: jax.Array) -> jax.Array:
    """The MLP's output for ``x[batch, in_dim]``: tanh hidden layers, linear output."""
    *hidden, last = params["layers"]
    for layer in hidden:
        x = jnp.tanh(x @ layer["w"] + layer["b"])
    return x @ last["w"] + last["b"]


def loss(params: Params, batch: dict[str, jax.Array]) -> jax.Array:
    """Mean squared error of the MLP's output against ``batch["y"]``."""
    return jnp.mean((apply(params, batch["x"]) - batch["y"]) ** 2)


_TEACHER_SEED = 1234  # fixed, so every batch seed labels with the same teacher


def synthetic_batch(cfg: MLPConfig, batch_size: int, seed: int = 0) -> dict[str, jax.Array]:
    """A deterministic regression batch labelled by a fixed random teacher MLP.

    The teacher has the student's architecture, so the targets are exactly learnable.

    Returns:
        ``{"x": float32[batch, in_dim], "y": float32[batch, out_dim]}``.
    """
    x = jax.random.normal(jax.random.key(seed), (batch_size, cfg.in_dim), jnp.float32)
    y = apply(init(cfg, _TEACHER_SEED), x)
    return {"x": x, "y": y}
