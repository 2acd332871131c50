"""A small image classifier written in flax.linen.

It exercises the linen path of jscaler (a params pytree passed to ``apply``) and ops that
the transformer lacks: convolutions, pooling, and GroupNorm. GroupNorm is used instead of
BatchNorm so that the model has no mutable collections (``batch_stats``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

__all__ = ["ConvNetConfig", "tiny", "ConvNet", "init", "make_loss", "synthetic_batch"]


@dataclass(frozen=True)
class ConvNetConfig:
    """Hyper-parameters of :class:`ConvNet`.

    Attributes:
        image_size: Height and width of the (square) input images.
        in_channels: Channels of the input images.
        channels: Output channels of the two conv layers.
        norm_groups: Groups of each GroupNorm; must divide both conv widths.
        hidden: Width of the hidden dense layer.
        num_classes: Number of output classes.
    """

    image_size: int = 16
    in_channels: int = 3
    channels: tuple[int, int] = (8, 16)
    norm_groups: int = 4
    hidden: int = 32
    num_classes: int = 10

    def __post_init__(self) -> None:
        if self.image_size % 4:
            raise ValueError(
                f"ConvNetConfig.image_size ({self.image_size}) must be divisible by 4 "
                "(two 2x2 poolings)"
            )
        for c in self.channels:
            if c % self.norm_groups:
                raise ValueError(
                    f"ConvNetConfig.norm_groups ({self.norm_groups}) must divide every conv "
                    f"width, got channels={self.channels}"
                )


def tiny() -> ConvNetConfig:
    """16x16x3 images, conv widths 8 and 16, 10 classes."""
    return ConvNetConfig()


class ConvNet(nn.Module):
    """Conv-GN-relu-maxpool, conv-GN-relu-avgpool, then a two-layer dense classifier."""

    cfg: ConvNetConfig

    @nn.compact
    def __call__(self, images: jax.Array) -> jax.Array:
        """Maps ``images[batch, h, w, c]`` (float32) to ``logits[batch, num_classes]``."""
        c1, c2 = self.cfg.channels
        x = nn.Conv(c1, (3, 3), name="conv1")(images)
        x = nn.relu(nn.GroupNorm(num_groups=self.cfg.norm_groups, name="norm1")(x))
        x = nn.max_pool(x, (2, 2), strides=(2, 2))
        x = nn.Conv(c2, (3, 3), name="conv2")(x)
        x = nn.relu(nn.GroupNorm(num_groups=self.cfg.norm_groups, name="norm2")(x))
        x = nn.avg_pool(x, (2, 2), strides=(2, 2))
        x = x.reshape(x.shape[0], -1)
        x = nn.relu(nn.Dense(self.cfg.hidden, name="fc1")(x))
        return nn.Dense(self.cfg.num_classes, name="fc2")(x)


def init(cfg: ConvNetConfig, seed: int = 0) -> Any:
    """The params pytree of ``ConvNet(cfg)`` (the contents of the ``"params"`` collection)."""
    shape = (1, cfg.image_size, cfg.image_size, cfg.in_channels)
    variables = ConvNet(cfg).init(jax.random.key(seed), jnp.zeros(shape, jnp.float32))
    return variables["params"]


def make_loss(cfg: ConvNetConfig) -> Callable[[Any, dict[str, jax.Array]], jax.Array]:
    """Returns ``loss(params, batch)``: mean softmax cross entropy of ``ConvNet(cfg)``."""
    model = ConvNet(cfg)

    def loss(params: Any, batch: dict[str, jax.Array]) -> jax.Array:
        logits = model.apply({"params": params}, batch["images"])
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch["labels"]).mean()

    return loss


_PROTOTYPE_SEED = 7  # fixed, so every batch seed shares the same class prototypes
_NOISE = 0.5


def synthetic_batch(cfg: ConvNetConfig, batch_size: int, seed: int = 0) -> dict[str, jax.Array]:
    """A deterministic batch of noisy class prototypes.

    Every class has a fixed random prototype image; an example is its label's prototype
    plus Gaussian noise, so the labels are learnable from the images.

    Returns:
        ``{"images": float32[batch, h, w, c], "labels": int32[batch]}``.
    """
    shape = (cfg.image_size, cfg.image_size, cfg.in_channels)
    prototypes = np.random.default_rng(_PROTOTYPE_SEED).normal(size=(cfg.num_classes, *shape))
    rng = np.random.default_rng(seed)
    labels = rng.integers(0, cfg.num_classes, size=batch_size).astype(np.int32)
    images = prototypes[labels] + _NOISE * rng.normal(size=(batch_size, *shape))
    return {"images": jnp.asarray(images, jnp.float32), "labels": jnp.asarray(labels)}
