"""A GPT/Llama-style decoder-only transformer written in plain flax.nnx.

This is the main reference model that jscaler traces and parallelises, so it is kept
idiomatic and free of framework imports. The architecture follows Llama: pre-norm blocks
with RMSNorm, causal multi-head attention with rotary position embeddings (RoPE) on the
queries and keys, a SwiGLU MLP, and an untied output projection. Submodule attribute
names are part of the contract: later code names ops by module path, such as
``blocks/0/attn/q_proj``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

__all__ = [
    "GPTConfig",
    "tiny",
    "small",
    "gpt_1_3b",
    "llama_7b",
    "llama_13b",
    "CONFIGS",
    "RMSNorm",
    "Attention",
    "MLP",
    "Block",
    "GPT",
    "loss",
    "synthetic_batch",
    "num_params",
]


@dataclass(frozen=True)
class GPTConfig:
    """Hyper-parameters of the decoder.

    Attributes:
        vocab_size: Number of token ids.
        d_model: Width of the residual stream.
        n_layers: Number of transformer blocks.
        n_heads: Number of attention heads; must divide ``d_model``.
        d_ff: Hidden width of the SwiGLU MLP.
        seq_len: Training sequence length (RoPE works for any length; this sizes batches).
        rope_base: Base of the RoPE frequencies.
        norm_eps: Epsilon of RMSNorm.
        dropout: Residual dropout rate; 0 (the default) builds no dropout layers at all.
        dtype: Computation dtype of the linear layers and the embedding; None (the
            default): their parameters', so a ``precision="bf16"`` plan, which traces the
            step with bf16 parameters, computes them in bf16.
        param_dtype: Storage dtype of the parameters.
        scan_layers: Stack the blocks (every parameter gets a leading layer axis, made by
            ``nnx.vmap`` under ``nnx.split_rngs``) and run them with ``nnx.scan``, as
            MaxText's ``scan_layers`` does; False (the default): a list of blocks.
        remat: Wrap each block's call in ``nnx.remat`` (its activations are recomputed in
            the backward pass), inside the scan when ``scan_layers``.
    """

    vocab_size: int
    d_model: int
    n_layers: int
    n_heads: int
    d_ff: int
    seq_len: int
    rope_base: float = 10000.0
    norm_eps: float = 1e-5
    dropout: float = 0.0
    dtype: Any = None
    param_dtype: Any = jnp.float32
    scan_layers: bool = False
    remat: bool = False

    def __post_init__(self) -> None:
        for name in ("vocab_size", "d_model", "n_layers", "n_heads", "d_ff", "seq_len"):
            if getattr(self, name) <= 0:
                raise ValueError(f"GPTConfig.{name} must be positive, got {getattr(self, name)}")
        if self.d_model % self.n_heads:
            raise ValueError(
                f"GPTConfig.d_model ({self.d_model}) must be divisible by n_heads ({self.n_heads})"
            )
        if self.head_dim % 2:
            raise ValueError(
                f"GPTConfig head dim d_model/n_heads = {self.head_dim} must be even for RoPE"
            )
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"GPTConfig.dropout must be in [0, 1), got {self.dropout}")

    @property
    def head_dim(self) -> int:
        """Width of one attention head."""
        return self.d_model // self.n_heads

    def replace(self, **changes: Any) -> GPTConfig:
        """Returns a copy with ``changes`` applied (and validated)."""
        return dataclasses.replace(self, **changes)


def tiny() -> GPTConfig:
    """A test-sized model (~0.2M parameters) that trains in seconds on a CPU."""
    return GPTConfig(vocab_size=256, d_model=64, n_layers=4, n_heads=4, d_ff=176, seq_len=32)


def small() -> GPTConfig:
    """A benchmark-sized model with ~21M parameters."""
    return GPTConfig(vocab_size=8192, d_model=512, n_layers=4, n_heads=8, d_ff=1408, seq_len=256)


def gpt_1_3b() -> GPTConfig:
    """A ~1.3B-parameter model with GPT-3 XL's shape (24 layers, width 2048)."""
    return GPTConfig(
        vocab_size=32000, d_model=2048, n_layers=24, n_heads=16, d_ff=5504, seq_len=2048
    )


def llama_7b() -> GPTConfig:
    """Llama-7B's shape (~6.7B parameters)."""
    return GPTConfig(
        vocab_size=32000, d_model=4096, n_layers=32, n_heads=32, d_ff=11008, seq_len=2048
    )


def llama_13b() -> GPTConfig:
    """Llama-13B's shape (~13B parameters)."""
    return GPTConfig(
        vocab_size=32000, d_model=5120, n_layers=40, n_heads=40, d_ff=13824, seq_len=2048
    )


CONFIGS = {
    "tiny": tiny,
    "small": small,
    "gpt_1_3b": gpt_1_3b,
    "llama_7b": llama_7b,
    "llama_13b": llama_13b,
}


class RMSNorm(nnx.Module):
    """Root-mean-square layer norm with a learned ``scale``, computed in float32."""

    def __init__(self, dim: int, *, eps: float = 1e-5, param_dtype: Any = jnp.float32):
        self.eps = eps
        self.scale = nnx.Param(jnp.ones((dim,), param_dtype))

    def __call__(self, x: jax.Array) -> jax.Array:
        x32 = x.astype(jnp.float32)
        normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        return (normed * self.scale[...].astype(jnp.float32)).astype(x.dtype)


def _linear(cfg: GPTConfig, d_in: int, d_out: int, rngs: nnx.Rngs) -> nnx.Linear:
    return nnx.Linear(
        d_in, d_out, use_bias=False, dtype=cfg.dtype, param_dtype=cfg.param_dtype, rngs=rngs
    )


def rope(x: jax.Array, base: float) -> jax.Array:
    """Applies rotary position embeddings to ``x[batch, seq, heads, head_dim]``.

    Positions are ``0..seq-1``. Uses the "rotate half" layout (as in Llama): the first and
    second halves of each head are the two coordinates of each rotated pair.
    """
    seq, head_dim = x.shape[1], x.shape[-1]
    half = head_dim // 2
    inv_freq = base ** (-jnp.arange(half, dtype=jnp.float32) / half)
    angles = jnp.arange(seq, dtype=jnp.float32)[:, None] * inv_freq[None, :]  # [seq, half]
    sin = jnp.sin(angles)[None, :, None, :]
    cos = jnp.cos(angles)[None, :, None, :]
    x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x.dtype)


class Attention(nnx.Module):
    """Causal multi-head self-attention with RoPE; the softmax runs in float32."""

    def __init__(self, cfg: GPTConfig, *, rngs: nnx.Rngs):
        self.n_heads = cfg.n_heads
        self.head_dim = cfg.head_dim
        self.rope_base = cfg.rope_base
        self.q_proj = _linear(cfg, cfg.d_model, cfg.d_model, rngs)
        self.k_proj = _linear(cfg, cfg.d_model, cfg.d_model, rngs)
        self.v_proj = _linear(cfg, cfg.d_model, cfg.d_model, rngs)
        self.o_proj = _linear(cfg, cfg.d_model, cfg.d_model, rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        b, s, d = x.shape
        heads = (b, s, self.n_heads, self.head_dim)
        q = rope(self.q_proj(x).reshape(heads), self.rope_base)
        k = rope(self.k_proj(x).reshape(heads), self.rope_base)
        v = self.v_proj(x).reshape(heads)
        scores = jnp.einsum("bqhd,bkhd->bhqk", q, k).astype(jnp.float32)
        scores = scores / jnp.sqrt(jnp.float32(self.head_dim))
        causal = jnp.tril(jnp.ones((s, s), dtype=jnp.bool_))
        scores = jnp.where(causal, scores, jnp.finfo(jnp.float32).min)
        probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
        out = jnp.einsum("bhqk,bkhd->bqhd", probs, v).reshape(b, s, d)
        return self.o_proj(out)


class MLP(nnx.Module):
    """SwiGLU feed-forward: ``down(silu(gate(x)) * up(x))``."""

    def __init__(self, cfg: GPTConfig, *, rngs: nnx.Rngs):
        self.gate_proj = _linear(cfg, cfg.d_model, cfg.d_ff, rngs)
        self.up_proj = _linear(cfg, cfg.d_model, cfg.d_ff, rngs)
        self.down_proj = _linear(cfg, cfg.d_ff, cfg.d_model, rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.down_proj(jax.nn.silu(self.gate_proj(x)) * self.up_proj(x))


class Block(nnx.Module):
    """A pre-norm transformer block: ``x + attn(norm1(x))`` then ``x + mlp(norm2(x))``."""

    def __init__(self, cfg: GPTConfig, *, rngs: nnx.Rngs):
        self.norm1 = RMSNorm(cfg.d_model, eps=cfg.norm_eps, param_dtype=cfg.param_dtype)
        self.attn = Attention(cfg, rngs=rngs)
        self.norm2 = RMSNorm(cfg.d_model, eps=cfg.norm_eps, param_dtype=cfg.param_dtype)
        self.mlp = MLP(cfg, rngs=rngs)
        # Dropout layers exist only when asked for, so the default graph has no RNG state.
        self.dropout = nnx.Dropout(cfg.dropout, rngs=rngs) if cfg.dropout > 0 else None

    def _drop(self, x: jax.Array) -> jax.Array:
        return x if self.dropout is None else self.dropout(x)

    def __call__(self, x: jax.Array) -> jax.Array:
        x = x + self._drop(self.attn(self.norm1(x)))
        return x + self._drop(self.mlp(self.norm2(x)))


class GPT(nnx.Module):
    """The decoder: token embedding, ``n_layers`` blocks, final norm, and an LM head."""

    def __init__(self, cfg: GPTConfig, *, rngs: nnx.Rngs):
        self.cfg = cfg
        self.embed = nnx.Embed(
            cfg.vocab_size, cfg.d_model, dtype=cfg.dtype, param_dtype=cfg.param_dtype, rngs=rngs
        )
        # nnx.Embed fixes a None dtype to its parameter's at construction (float32); None
        # lets it follow the parameter as traced (bf16 under a bf16 plan), as nnx.Linear does
        self.embed.dtype = cfg.dtype
        if cfg.scan_layers:

            @nnx.split_rngs(splits=cfg.n_layers)
            @nnx.vmap(in_axes=(0,), out_axes=0)
            def stacked(rngs: nnx.Rngs) -> Block:
                return Block(cfg, rngs=rngs)

            self.blocks = stacked(rngs)
        else:
            self.blocks = nnx.List([Block(cfg, rngs=rngs) for _ in range(cfg.n_layers)])
        self.norm_f = RMSNorm(cfg.d_model, eps=cfg.norm_eps, param_dtype=cfg.param_dtype)
        self.lm_head = _linear(cfg, cfg.d_model, cfg.vocab_size, rngs)

    def __call__(self, tokens: jax.Array) -> jax.Array:
        """Maps ``tokens[batch, seq]`` (int32) to ``logits[batch, seq, vocab]``."""
        x = self.embed(tokens)

        def run(block: Block, x: jax.Array) -> jax.Array:
            return block(x)

        if self.cfg.remat:
            run = nnx.remat(run)
        if self.cfg.scan_layers:
            # dropout draws its own random bits in each layer: the Rngs state is split
            # across the layers like the parameters
            axes = nnx.StateAxes({nnx.RngState: 0, ...: 0})

            @nnx.scan(in_axes=(nnx.Carry, axes), out_axes=nnx.Carry)
            def layers(x: jax.Array, block: Block) -> jax.Array:
                return run(block, x)

            x = layers(x, self.blocks)
        else:
            for block in self.blocks:
                x = run(block, x)
        return self.lm_head(self.norm_f(x))


def loss(model: GPT, batch: dict[str, jax.Array]) -> jax.Array:
    """Mean next-token cross entropy of ``model`` on ``{"tokens", "targets"}``."""
    logits = model(batch["tokens"]).astype(jnp.float32)
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"]).mean()


_CHAIN_SEED = 20240601  # fixed, so every batch seed samples the same Markov chain
_CHAIN_BRANCHING = 2  # successors per token: the best achievable loss is ln(2)


def _markov_successors(vocab_size: int) -> np.ndarray:
    """The fixed random successor table ``[vocab, branching]`` of the synthetic chain."""
    rng = np.random.default_rng(_CHAIN_SEED)
    return rng.integers(0, vocab_size, size=(vocab_size, _CHAIN_BRANCHING))


def synthetic_batch(cfg: GPTConfig, batch_size: int, seed: int = 0) -> dict[str, jax.Array]:
    """A deterministic batch of sequences from a fixed sparse random Markov chain.

    Each token has only ``_CHAIN_BRANCHING`` possible successors (chosen uniformly), so a
    model can quickly learn the bigram table and the loss falls from ~ln(vocab) towards
    ln(branching). The chain is the same for every ``seed``; the seed picks the sequences.

    Returns:
        ``{"tokens": int32[batch, seq_len], "targets": int32[batch, seq_len]}`` where
        ``targets`` is ``tokens`` shifted left by one (the next token at each position).
    """
    succ = _markov_successors(cfg.vocab_size)
    rng = np.random.default_rng(seed)
    seqs = np.empty((batch_size, cfg.seq_len + 1), dtype=np.int32)
    seqs[:, 0] = rng.integers(0, cfg.vocab_size, size=batch_size)
    choices = rng.integers(0, _CHAIN_BRANCHING, size=(batch_size, cfg.seq_len))
    for t in range(cfg.seq_len):
        seqs[:, t + 1] = succ[seqs[:, t], choices[:, t]]
    return {"tokens": jnp.asarray(seqs[:, :-1]), "targets": jnp.asarray(seqs[:, 1:])}


def num_params(cfg: GPTConfig) -> int:
    """The parameter count of ``GPT(cfg)``, found by abstract evaluation (no allocation)."""
    model = nnx.eval_shape(lambda: GPT(cfg, rngs=nnx.Rngs(0)))
    leaves = jax.tree.leaves(nnx.state(model, nnx.Param))
    return sum(int(np.prod(leaf.shape)) for leaf in leaves)
