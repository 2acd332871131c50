"""The Swin Transformer (Liu et al., 2021), written in plain flax.nnx.

Swin is a hierarchical vision transformer. The image is cut into non-overlapping patches
(a linear map of each flattened ``patch x patch`` patch, the same as a convolution with
kernel = stride = patch), and four stages of transformer blocks follow. A block attends
only within ``window x window`` windows of tokens; each head adds a learned *relative
position bias*, read from a table of ``(2w - 1)^2`` offsets by a constant index. Every
second block first rolls the token grid by half a window (a cyclic shift), so its windows
straddle the previous block's window borders; tokens that the roll brought together from
opposite edges of the image are kept apart by a constant attention mask. Between stages a
*patch merging* layer concatenates each 2x2 neighbourhood (4C features), normalises it and
maps it to 2C, halving the resolution; the heads double from stage to stage. The head is a
final LayerNorm, a mean over tokens and a linear classifier.

As in the reference implementation, a stage whose resolution is at most the window size
uses the whole resolution as its one window and never shifts. Two small departures from
it keep fp32 parity checks meaningful: the key projection has no bias (the softmax is
blind to it, so its gradient is exactly zero and only rounding noise would be compared),
and biases start at small random values rather than zeros (see ``_bias_init``). Weights
are truncated normal with std 0.02 as in the reference, except the patch embedding's,
which keeps the fan-in init the reference's convolution has.

Activations keep the image layout ``[batch, height, width, channels]`` throughout, and
windows keep the batch axis apart (``[batch, windows, tokens, channels]``), so the batch
dim stays visible to data parallelism. All blocks live in one flat list ``blocks`` (each
knows its resolution, window and shift) and the merging layers in ``merges``, so the
repeated layers of a traced graph are the blocks (``blocks/0/attn/q_proj`` ...). Written
with no jscaler imports; float32, no dropout, deterministic.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

__all__ = [
    "SwinConfig",
    "tiny",
    "swin_tiny_224",
    "paper_4gpu",
    "paper_8gpu",
    "paper_16gpu",
    "paper_32gpu",
    "CONFIGS",
    "relative_position_index",
    "shift_window_segments",
    "shift_window_mask",
    "WindowAttention",
    "MLP",
    "Block",
    "PatchMerging",
    "window_partition",
    "window_reverse",
    "merge_neighbourhoods",
    "Swin",
    "loss",
    "synthetic_batch",
    "num_params",
]


@dataclass(frozen=True)
class SwinConfig:
    """Hyper-parameters of a Swin Transformer.

    Attributes:
        image_size: Height and width of the (square) input images.
        patch_size: Height and width of a patch; the first stage sees
            ``image_size / patch_size`` tokens per side.
        in_channels: Channels of the input images.
        embed_dim: Channels ``C`` of the first stage; stage ``i`` has ``C * 2**i``.
        depths: Blocks per stage.
        num_heads: Attention heads per stage; each must divide that stage's channels.
        window_size: Side of an attention window in tokens (clipped to a stage's
            resolution when that is smaller, and then never shifted).
        mlp_ratio: Hidden width of the MLPs as a multiple of the channels.
        num_classes: Classes of the linear classifier.
        norm_eps: Epsilon of every LayerNorm.
    """

    image_size: int
    patch_size: int
    embed_dim: int
    depths: tuple[int, ...]
    num_heads: tuple[int, ...]
    window_size: int
    num_classes: int
    in_channels: int = 3
    mlp_ratio: int = 4
    norm_eps: float = 1e-5

    def __post_init__(self) -> None:
        object.__setattr__(self, "depths", tuple(self.depths))
        object.__setattr__(self, "num_heads", tuple(self.num_heads))
        for name in (
            "image_size",
            "patch_size",
            "in_channels",
            "embed_dim",
            "window_size",
            "mlp_ratio",
            "num_classes",
        ):
            if getattr(self, name) <= 0:
                raise ValueError(f"SwinConfig.{name} must be positive, got {getattr(self, name)}")
        if not self.depths or len(self.depths) != len(self.num_heads):
            raise ValueError(
                f"SwinConfig.depths {self.depths} and num_heads {self.num_heads} must be "
                f"non-empty and of the same length (one entry per stage)"
            )
        if min(self.depths) <= 0 or min(self.num_heads) <= 0:
            raise ValueError(
                f"SwinConfig depths {self.depths} and num_heads {self.num_heads} must be positive"
            )
        if self.image_size % self.patch_size:
            raise ValueError(
                f"SwinConfig.image_size ({self.image_size}) must be divisible by patch_size "
                f"({self.patch_size})"
            )
        res = self.image_size // self.patch_size
        for i in range(self.n_stages):
            if i < self.n_stages - 1 and res % 2:
                raise ValueError(
                    f"SwinConfig: stage {i} has an odd resolution {res}, which patch merging "
                    f"cannot halve"
                )
            if res > self.window_size and res % self.window_size:
                raise ValueError(
                    f"SwinConfig: stage {i} resolution {res} is not divisible by "
                    f"window_size {self.window_size}"
                )
            res //= 2
        for i, (dim, heads) in enumerate(zip(self.dims, self.num_heads)):
            if dim % heads:
                raise ValueError(
                    f"SwinConfig: stage {i} has {dim} channels, which num_heads[{i}] = {heads} "
                    f"does not divide"
                )

    @property
    def n_stages(self) -> int:
        """Number of stages."""
        return len(self.depths)

    @property
    def dims(self) -> tuple[int, ...]:
        """Channels per stage: ``embed_dim * 2**i``."""
        return tuple(self.embed_dim * 2**i for i in range(self.n_stages))

    @property
    def resolutions(self) -> tuple[int, ...]:
        """Tokens per side in each stage."""
        first = self.image_size // self.patch_size
        return tuple(first // 2**i for i in range(self.n_stages))

    @property
    def windows(self) -> tuple[int, ...]:
        """The window side each stage really uses: ``min(window_size, resolution)``."""
        return tuple(min(self.window_size, r) for r in self.resolutions)

    def block_layout(self) -> list[tuple[int, int, int]]:
        """``(stage, window, shift)`` of every block, in order: odd blocks of a stage
        shift by half a window, unless the window covers the whole resolution."""
        out = []
        for stage, depth in enumerate(self.depths):
            res, w = self.resolutions[stage], self.windows[stage]
            for j in range(depth):
                shift = w // 2 if j % 2 == 1 and res > self.window_size else 0
                out.append((stage, w, shift))
        return out

    def replace(self, **changes: Any) -> SwinConfig:
        """Returns a copy with ``changes`` applied (and validated)."""
        return dataclasses.replace(self, **changes)


def tiny() -> SwinConfig:
    """A test-sized model (~2.3M parameters): 32x32 images, 2x2 patches (16x16 tokens),
    4x4 windows, 4 stages of 2 blocks, 8-dim heads (4-8-16-32), 10 classes.

    Every head count and channel width is divisible by 4 and every MLP width by 8, so
    tensor parallelism of degree 2 or 4 can split any stage's heads, and of degree 2..8
    its MLP features."""
    return SwinConfig(
        image_size=32,
        patch_size=2,
        embed_dim=32,
        depths=(2, 2, 2, 2),
        num_heads=(4, 8, 16, 32),
        window_size=4,
        num_classes=10,
    )


def bench() -> SwinConfig:
    """For ``jscaler bench coshard``: 64x64 images in 2x2 patches (32x32 tokens) and 8x8
    windows, so the first stage's attention scores and MLP activations dominate memory,
    as in the paper's high-resolution models (~2.3M parameters)."""
    return SwinConfig(
        image_size=64,
        patch_size=2,
        embed_dim=32,
        depths=(2, 2, 2, 2),
        num_heads=(8, 8, 16, 32),
        window_size=8,
        num_classes=10,
    )


def swin_tiny_224() -> SwinConfig:
    """Swin-T of the paper (~28M parameters): 224x224 images, window 7, 1000 classes."""
    return SwinConfig(
        image_size=224,
        patch_size=4,
        embed_dim=96,
        depths=(2, 2, 6, 2),
        num_heads=(3, 6, 12, 24),
        window_size=7,
        num_classes=1000,
    )


def _paper(layers: int, dim: int, heads: int) -> SwinConfig:
    """nnScaler's high-resolution Swin: 1536x1536 images in 4x4 patches (384x384 tokens),
    window 48, depths 2-2-(L-6)-2, heads h-2h-4h-8h, 1024 classes."""
    return SwinConfig(
        image_size=1536,
        patch_size=4,
        embed_dim=dim,
        depths=(2, 2, layers - 6, 2),
        num_heads=(heads, 2 * heads, 4 * heads, 8 * heads),
        window_size=48,
        num_classes=1024,
    )


def paper_4gpu() -> SwinConfig:
    """nnScaler's Swin for 4 GPUs: 32 layers, C = 512, 16 heads in stage 1 (~1.8B)."""
    return _paper(32, 512, 16)


def paper_8gpu() -> SwinConfig:
    """nnScaler's Swin for 8 GPUs: 40 layers, C = 768, 24 heads in stage 1 (~5.0B)."""
    return _paper(40, 768, 24)


def paper_16gpu() -> SwinConfig:
    """nnScaler's Swin for 16 GPUs: 48 layers, C = 1024, 32 heads in stage 1 (~10.4B)."""
    return _paper(48, 1024, 32)


def paper_32gpu() -> SwinConfig:
    """nnScaler's Swin for 32 GPUs: 56 layers, C = 1536, 32 heads in stage 1 (~27B)."""
    return _paper(56, 1536, 32)


CONFIGS = {
    "tiny": tiny,
    "swin_tiny_224": swin_tiny_224,
    "paper_4gpu": paper_4gpu,
    "paper_8gpu": paper_8gpu,
    "paper_16gpu": paper_16gpu,
    "paper_32gpu": paper_32gpu,
}


# ---- constants of the windows (numpy, cached per window size and shift) ----------------


@functools.cache
def relative_position_index(window: int) -> tuple[np.ndarray, np.ndarray]:
    """Row and column offsets, shifted to ``0..2w-2``, from each token of a window to
    each other: two int32 ``[w*w, w*w]`` arrays indexing the ``[2w-1, 2w-1]`` grid of
    relative positions (the reference's flat index is ``row * (2w - 1) + col``)."""
    coords = np.stack(np.meshgrid(np.arange(window), np.arange(window), indexing="ij"))
    coords = coords.reshape(2, -1)  # [2, N], row-major over the window
    rel = coords[:, :, None] - coords[:, None, :] + (window - 1)  # [2, N, N]
    rows, cols = rel[0].astype(np.int32), rel[1].astype(np.int32)
    rows.flags.writeable = cols.flags.writeable = False  # cached: shared by every caller
    return rows, cols


def shift_window_segments(resolution: int, window: int, shift: int) -> np.ndarray:
    """Which segment of the rolled image each token of each window came from:
    int ``[windows, w*w]``. The roll by ``-shift`` brings the last ``shift`` rows and
    columns next to the first ones; each axis splits into the bands ``[0, r-w)``,
    ``[r-w, r-shift)`` and ``[r-shift, r)``, and a segment is a pair of bands."""
    bands = np.zeros(resolution, np.int64)
    bands[resolution - window : resolution - shift] = 1
    bands[resolution - shift :] = 2
    segments = bands[:, None] * 3 + bands[None, :]  # [res, res]
    n = resolution // window
    windows = segments.reshape(n, window, n, window).transpose(0, 2, 1, 3)
    return windows.reshape(n * n, window * window)


@functools.cache
def shift_window_mask(resolution: int, window: int, shift: int) -> np.ndarray:
    """Bool ``[windows, w*w, w*w]``: True where a query may attend to a key, i.e. both
    lie in the same segment (for ``shift == 0`` everything is allowed)."""
    seg = shift_window_segments(resolution, window, shift)
    if shift == 0:
        seg = np.zeros_like(seg)
    mask = seg[:, :, None] == seg[:, None, :]
    mask.flags.writeable = False  # cached: shared by every caller
    return mask


def window_partition(x: jax.Array, window: int) -> jax.Array:
    """``[b, h, w, c] -> [b, windows, window*window, c]`` (windows row-major)."""
    b, h, w, c = x.shape
    x = x.reshape(b, h // window, window, w // window, window, c)
    x = x.transpose(0, 1, 3, 2, 4, 5)
    return x.reshape(b, (h // window) * (w // window), window * window, c)


def window_reverse(x: jax.Array, window: int, h: int, w: int) -> jax.Array:
    """The inverse of :func:`window_partition`: ``[b, windows, w*w, c] -> [b, h, w, c]``."""
    b, c = x.shape[0], x.shape[-1]
    x = x.reshape(b, h // window, w // window, window, window, c)
    x = x.transpose(0, 1, 3, 2, 4, 5)
    return x.reshape(b, h, w, c)


def merge_neighbourhoods(x: jax.Array) -> jax.Array:
    """``[b, h, w, c] -> [b, h/2, w/2, 4c]``: the 2x2 neighbourhood of each output token
    concatenated in the reference's order, offsets (0,0), (1,0), (0,1), (1,1) (row, col),
    by a reshape and a transpose (no strided slices)."""
    b, h, w, c = x.shape
    x = x.reshape(b, h // 2, 2, w // 2, 2, c)  # [b, i, di, j, dj, c]
    return x.transpose(0, 1, 3, 4, 2, 5).reshape(b, h // 2, w // 2, 4 * c)  # dj major


# ---- layers ---------------------------------------------------------------------------


_INIT_STD = 0.02  # the reference's truncated-normal weight init


def _bias_init(key: jax.Array, shape: tuple[int, ...], dtype: Any = jnp.float32) -> jax.Array:
    """Small random biases instead of the reference's zeros: a parameter that starts at
    exactly zero is, after one step, only its own update, so a parity check relative to
    its size magnifies fp32 summation-order noise; small random starts avoid that."""
    return _INIT_STD * jax.random.normal(key, shape, dtype)


def _linear(d_in: int, d_out: int, rngs: nnx.Rngs, *, bias: bool = True) -> nnx.Linear:
    """A linear layer with truncated-normal (std 0.02) weights, as in the reference."""
    return nnx.Linear(
        d_in,
        d_out,
        use_bias=bias,
        kernel_init=nnx.initializers.truncated_normal(stddev=_INIT_STD),
        bias_init=_bias_init,
        rngs=rngs,
    )


def _layer_norm(cfg: SwinConfig, dim: int, rngs: nnx.Rngs) -> nnx.LayerNorm:
    return nnx.LayerNorm(dim, epsilon=cfg.norm_eps, bias_init=_bias_init, rngs=rngs)


class WindowAttention(nnx.Module):
    """Multi-head self-attention inside windows, with a learned relative position bias
    and (for shifted windows) a constant mask; the softmax runs in float32."""

    def __init__(
        self,
        dim: int,
        n_heads: int,
        window: int,
        resolution: int,
        shift: int,
        *,
        rngs: nnx.Rngs,
    ):
        self.n_heads = n_heads
        self.head_dim = dim // n_heads
        self.window = window
        self.resolution = resolution
        self.shift = shift
        self.q_proj = _linear(dim, dim, rngs)
        # No key bias: it adds q.b to every score of a query, which the softmax ignores,
        # so its gradient is exactly zero (only rounding noise).
        self.k_proj = _linear(dim, dim, rngs, bias=False)
        self.v_proj = _linear(dim, dim, rngs)
        self.o_proj = _linear(dim, dim, rngs)
        init = nnx.initializers.truncated_normal(stddev=_INIT_STD)
        self.relative_bias = nnx.Param(init(rngs.params(), ((2 * window - 1) ** 2, n_heads)))

    def position_bias(self) -> jax.Array:
        """The ``[heads, w*w, w*w]`` relative position bias of this window size."""
        side = 2 * self.window - 1
        table = self.relative_bias[...].reshape(side, side, self.n_heads)
        rows, cols = relative_position_index(self.window)  # numpy constants
        return table[rows, cols].transpose(2, 0, 1)

    def __call__(self, x: jax.Array) -> jax.Array:
        """Maps windows ``x[batch, windows, tokens, dim]`` to the same shape."""
        b, nw, n, d = x.shape
        heads = (b, nw, n, self.n_heads, self.head_dim)
        q = self.q_proj(x).reshape(heads) * (self.head_dim**-0.5)
        k = self.k_proj(x).reshape(heads)
        v = self.v_proj(x).reshape(heads)
        scores = jnp.einsum("bwqhd,bwkhd->bwhqk", q, k).astype(jnp.float32)
        scores = scores + self.position_bias()[None, None]
        if self.shift:
            mask = shift_window_mask(self.resolution, self.window, self.shift)
            allowed = jnp.asarray(mask)[None, :, None]  # [1, windows, 1, n, n]
            scores = jnp.where(allowed, scores, jnp.finfo(jnp.float32).min)
        probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
        out = jnp.einsum("bwhqk,bwkhd->bwqhd", probs, v).reshape(b, nw, n, d)
        return self.o_proj(out)


class MLP(nnx.Module):
    """``fc2(gelu(fc1(x)))`` with the exact (erf) GELU, as in the reference."""

    def __init__(self, dim: int, hidden: int, *, rngs: nnx.Rngs):
        self.fc1 = _linear(dim, hidden, rngs)
        self.fc2 = _linear(hidden, dim, rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.fc2(jax.nn.gelu(self.fc1(x), approximate=False))


class Block(nnx.Module):
    """A Swin block on ``x[batch, res, res, dim]``: ``x + attn(norm1(x))`` over (possibly
    shifted) windows, then ``x + mlp(norm2(x))``."""

    def __init__(
        self,
        cfg: SwinConfig,
        dim: int,
        n_heads: int,
        resolution: int,
        window: int,
        shift: int,
        *,
        rngs: nnx.Rngs,
    ):
        self.resolution = resolution
        self.window = window
        self.shift = shift
        self.norm1 = _layer_norm(cfg, dim, rngs)
        self.attn = WindowAttention(dim, n_heads, window, resolution, shift, rngs=rngs)
        self.norm2 = _layer_norm(cfg, dim, rngs)
        self.mlp = MLP(dim, cfg.mlp_ratio * dim, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        _, h, w, _ = x.shape
        y = self.norm1(x)
        if self.shift:
            y = jnp.roll(y, (-self.shift, -self.shift), axis=(1, 2))
        y = window_reverse(self.attn(window_partition(y, self.window)), self.window, h, w)
        if self.shift:
            y = jnp.roll(y, (self.shift, self.shift), axis=(1, 2))
        x = x + y
        return x + self.mlp(self.norm2(x))


class PatchMerging(nnx.Module):
    """``[b, h, w, c] -> [b, h/2, w/2, 2c]``: each 2x2 neighbourhood concatenated (in the
    reference's order: (0,0), (1,0), (0,1), (1,1)), normalised, and mapped 4c -> 2c."""

    def __init__(self, cfg: SwinConfig, dim: int, *, rngs: nnx.Rngs):
        self.norm = _layer_norm(cfg, 4 * dim, rngs)
        self.reduction = _linear(4 * dim, 2 * dim, rngs, bias=False)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.reduction(self.norm(merge_neighbourhoods(x)))


class Swin(nnx.Module):
    """Patch embedding, the stages' blocks with patch merging between stages, then a
    final norm, a mean over tokens and a linear classifier."""

    def __init__(self, cfg: SwinConfig, *, rngs: nnx.Rngs):
        self.cfg = cfg
        p = cfg.patch_size
        # The reference's patch embedding is a convolution with its default (fan-in) init.
        self.patch_embed = nnx.Linear(
            p * p * cfg.in_channels, cfg.embed_dim, bias_init=_bias_init, rngs=rngs
        )
        self.patch_norm = _layer_norm(cfg, cfg.embed_dim, rngs)
        self.blocks = nnx.List(
            [
                Block(
                    cfg,
                    cfg.dims[stage],
                    cfg.num_heads[stage],
                    cfg.resolutions[stage],
                    window,
                    shift,
                    rngs=rngs,
                )
                for stage, window, shift in cfg.block_layout()
            ]
        )
        self.merges = nnx.List(
            [PatchMerging(cfg, cfg.dims[i], rngs=rngs) for i in range(cfg.n_stages - 1)]
        )
        self.norm = _layer_norm(cfg, cfg.dims[-1], rngs)
        self.head = _linear(cfg.dims[-1], cfg.num_classes, rngs)

    def embed(self, images: jax.Array) -> jax.Array:
        """``images[b, H, W, c] -> tokens[b, H/p, W/p, embed_dim]``: each patch flattened
        (row, column, channel) and mapped linearly, then normalised."""
        b, h, w, c = images.shape
        p = self.cfg.patch_size
        x = images.reshape(b, h // p, p, w // p, p, c).transpose(0, 1, 3, 2, 4, 5)
        return self.patch_norm(self.patch_embed(x.reshape(b, h // p, w // p, p * p * c)))

    def __call__(self, images: jax.Array) -> jax.Array:
        """Maps ``images[batch, H, W, channels]`` (float32) to ``logits[batch, classes]``."""
        x = self.embed(images)
        stages = [stage for stage, _, _ in self.cfg.block_layout()]
        for i, block in enumerate(self.blocks):
            if i > 0 and stages[i] != stages[i - 1]:
                x = self.merges[stages[i] - 1](x)
            x = block(x)
        x = jnp.mean(self.norm(x), axis=(1, 2))
        return self.head(x)


def loss(model: Swin, batch: dict[str, jax.Array]) -> jax.Array:
    """Mean softmax cross entropy of ``model`` on ``{"images", "labels"}``."""
    logits = model(batch["images"]).astype(jnp.float32)
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["labels"]).mean()


_TEACHER_SEED = 1234  # fixed, so every batch seed is labelled by the same teacher
_TEACHER_GRID = 4  # the teacher sees the image mean-pooled to a 4x4 grid


def synthetic_batch(cfg: SwinConfig, batch_size: int, seed: int = 0) -> dict[str, jax.Array]:
    """A deterministic batch of Gaussian-noise images labelled by a fixed random teacher.

    The label of an image is the argmax of a fixed random linear map of the image
    mean-pooled to a coarse grid, so the labels are a learnable function of the images
    (the teacher is the same for every ``seed``; the seed picks the images).

    Returns:
        ``{"images": float32[batch, H, W, c], "labels": int32[batch]}``.
    """
    s, g, c = cfg.image_size, _TEACHER_GRID, cfg.in_channels
    grid = g if s % g == 0 else 1
    rng = np.random.default_rng(seed)
    images = rng.normal(size=(batch_size, s, s, c)).astype(np.float32)
    pooled = images.reshape(batch_size, grid, s // grid, grid, s // grid, c).mean(axis=(2, 4))
    teacher = np.random.default_rng(_TEACHER_SEED).normal(size=(grid * grid * c, cfg.num_classes))
    labels = np.argmax(pooled.reshape(batch_size, -1) @ teacher, axis=-1).astype(np.int32)
    return {"images": jnp.asarray(images), "labels": jnp.asarray(labels)}


def num_params(cfg: SwinConfig) -> int:
    """The parameter count of ``Swin(cfg)``, from the config alone (no allocation)."""
    norm = lambda d: 2 * d  # noqa: E731  (scale and bias)
    p = cfg.patch_size
    total = p * p * cfg.in_channels * cfg.embed_dim + cfg.embed_dim + norm(cfg.embed_dim)
    for stage, window, _ in cfg.block_layout():
        d, h, hidden = cfg.dims[stage], cfg.num_heads[stage], cfg.mlp_ratio * cfg.dims[stage]
        attn = 4 * d * d + 3 * d + (2 * window - 1) ** 2 * h  # no key bias
        mlp = d * hidden + hidden + hidden * d + d
        total += 2 * norm(d) + attn + mlp
    for d in cfg.dims[:-1]:
        total += norm(4 * d) + 4 * d * 2 * d
    return total + norm(cfg.dims[-1]) + cfg.dims[-1] * cfg.num_classes + cfg.num_classes
