"""A small recycling model: AlphaFold2's training loop on a stack of residual MLP blocks.

AlphaFold2 runs its trunk several times per example ("recycling"): each pass embeds the
input afresh, adds an embedding of the previous pass's output, and runs every block; the
earlier passes are under ``jax.lax.stop_gradient``, so only the last one is trained
through. This model keeps exactly that control structure around a cheap trunk (pre-norm
residual MLP blocks over a set of feature vectors), so the 3F1B pipeline schedule can be
checked against single-device training quickly; ``models.alphafold2`` puts the Evoformer
inside the same loop.

Written as plain flax.nnx, with no jscaler imports: jscaler finds the passes in the
traced graph by the ``stop_gradient`` between them.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp
from flax import nnx

__all__ = ["RecyclerConfig", "Recycler", "loss", "synthetic_batch", "tiny"]


@dataclass(frozen=True)
class RecyclerConfig:
    """Hyper-parameters.

    Attributes:
      in_dim: Input features per item.
      d_model: Width of the trunk.
      d_ff: Hidden width of each block's MLP.
      n_layers: Trunk blocks.
      out_dim: Regression targets per item.
      items: Items per example (the sequence the blocks mix over by a mean).
      passes: Forward passes per step (AlphaFold2: 3 or 4); all but the last run under
        ``stop_gradient``.
    """

    in_dim: int = 16
    d_model: int = 32
    d_ff: int = 64
    n_layers: int = 4
    out_dim: int = 4
    items: int = 8
    passes: int = 3

    def __post_init__(self) -> None:
        if min(self.in_dim, self.d_model, self.d_ff, self.n_layers, self.out_dim) <= 0:
            raise ValueError(f"RecyclerConfig sizes must be positive, got {self}")
        if self.passes < 1:
            raise ValueError(f"RecyclerConfig.passes must be >= 1, got {self.passes}")


def tiny() -> RecyclerConfig:
    """4 blocks of width 32, 3 passes: for tests."""
    return RecyclerConfig()


class Block(nnx.Module):
    """Pre-norm residual block: a mean over items mixed in, then a GELU MLP."""

    def __init__(self, cfg: RecyclerConfig, *, rngs: nnx.Rngs):
        self.norm = nnx.LayerNorm(cfg.d_model, rngs=rngs)
        self.mix = nnx.Linear(cfg.d_model, cfg.d_model, rngs=rngs)
        self.up = nnx.Linear(cfg.d_model, cfg.d_ff, rngs=rngs)
        self.down = nnx.Linear(cfg.d_ff, cfg.d_model, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        h = self.norm(x)
        h = h + self.mix(jnp.mean(h, axis=1, keepdims=True))
        return x + self.down(jax.nn.gelu(self.up(h)))


class Recycler(nnx.Module):
    """``embed -> (+ recycled) -> blocks -> head``, run ``cfg.passes`` times."""

    def __init__(self, cfg: RecyclerConfig, *, rngs: nnx.Rngs):
        self.cfg = cfg
        self.embed = nnx.Linear(cfg.in_dim, cfg.d_model, rngs=rngs)
        self.recycle_norm = nnx.LayerNorm(cfg.d_model, rngs=rngs)
        self.recycle = nnx.Linear(cfg.d_model, cfg.d_model, rngs=rngs)
        self.blocks = nnx.List([Block(cfg, rngs=rngs) for _ in range(cfg.n_layers)])
        self.final_norm = nnx.LayerNorm(cfg.d_model, rngs=rngs)
        self.head = nnx.Linear(cfg.d_model, cfg.out_dim, rngs=rngs)

    def trunk(self, x: jax.Array, prev: jax.Array) -> jax.Array:
        h = self.embed(x) + self.recycle(self.recycle_norm(prev))
        for block in self.blocks:
            h = block(h)
        return h

    def __call__(self, x: jax.Array) -> jax.Array:
        prev = jnp.zeros((*x.shape[:-1], self.cfg.d_model), x.dtype)
        for _ in range(self.cfg.passes - 1):
            prev = jax.lax.stop_gradient(self.trunk(x, prev))
        h = self.trunk(x, prev)
        return self.head(self.final_norm(h))


def loss(model: Recycler, batch: dict[str, jax.Array]) -> jax.Array:
    """Mean squared error against ``batch["y"]``."""
    return jnp.mean((model(batch["x"]) - batch["y"]) ** 2)


def synthetic_batch(cfg: RecyclerConfig, batch_size: int, seed: int = 0) -> dict:
    """Deterministic inputs and targets (a fixed random linear map of the inputs' running
    mean, so there is something to learn)."""
    kx, kw = jax.random.split(jax.random.key(seed))
    x = jax.random.normal(kx, (batch_size, cfg.items, cfg.in_dim), jnp.float32)
    w = jax.random.normal(jax.random.key(4321), (cfg.in_dim, cfg.out_dim), jnp.float32)
    y = jnp.tanh((x + jnp.mean(x, axis=1, keepdims=True)) @ w / jnp.sqrt(cfg.in_dim))
    return {"x": x, "y": y}
