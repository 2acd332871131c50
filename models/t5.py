"""T5 (v1.0): an encoder-decoder transformer with relative position buckets, in flax.nnx.

The model follows Raffel et al. (2020) and the original Mesh-TensorFlow code:

* one token embedding shared by the encoder input, the decoder input and the LM head
  (tied: ``logits = decoder_output * d_model**-0.5 @ embedding.T``, no head parameter);
* pre-norm blocks with T5's LayerNorm (a root-mean-square norm with a scale and no bias
  or mean subtraction) and a final norm closing each stack;
* no absolute positions: every stack has one ``relative_attention_bias`` table
  ``[num_buckets, n_heads]`` looked up with bucketed key-minus-query distances
  (bidirectional buckets in the encoder, causal ones in the decoder); the bias is
  computed once per stack and added to the attention logits of all of its layers;
* attention without the ``1/sqrt(d_kv)`` scaling (T5 folds it into the query's
  initialisation); the decoder's self-attention is causal and its cross-attention reads
  the encoder's (normed) output, with no position bias;
* a non-gated ReLU MLP (``wo(relu(wi(x)))``);
* no dropout here (T5 trains with 0.1), and everything in float32.

Written as plain flax.nnx with no jscaler imports. Two things matter to the pipeline
plans: ``__call__`` looks up both the encoder and the decoder inputs' embeddings first,
before the encoder runs, so every lookup of the (huge, in the paper configs) table comes
before the first repeated layer in program order; and the blocks are the module lists
``encoder/blocks`` and ``decoder/blocks``, so the graph's repeated layers are exactly the
encoder blocks followed by the decoder blocks. Submodule names follow Hugging Face's T5
where they can (``q``, ``k``, ``v``, ``o``, ``wi``, ``wo``).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

__all__ = [
    "T5Config",
    "tiny",
    "paper_4gpu",
    "paper_8gpu",
    "paper_16gpu",
    "paper_32gpu",
    "CONFIGS",
    "relative_position_bucket",
    "T5LayerNorm",
    "Attention",
    "MLP",
    "EncoderBlock",
    "DecoderBlock",
    "Encoder",
    "Decoder",
    "T5",
    "loss",
    "synthetic_batch",
    "num_params",
]

_MASKED = -1e9  # added to the logits of masked (future) keys: exp underflows to exactly 0


@dataclass(frozen=True)
class T5Config:
    """Hyper-parameters of the encoder-decoder.

    Attributes:
        vocab_size: Number of token ids (the shared embedding's rows).
        d_model: Width of the residual stream of both stacks.
        n_heads: Attention heads of every attention layer.
        d_kv: Width of one head; ``n_heads * d_kv`` need not equal ``d_model``.
        d_ff: Hidden width of the (non-gated, ReLU) MLP.
        n_encoder_layers: Blocks in the encoder.
        n_decoder_layers: Blocks in the decoder.
        encoder_len: Training length of the encoder inputs (sizes batches only: relative
            position buckets work for any length).
        decoder_len: Training length of the decoder inputs and targets.
        num_buckets: Relative position buckets of each stack's bias table.
        max_distance: Distance from which all positions share the last bucket.
        norm_eps: Epsilon of T5's LayerNorm.
    """

    vocab_size: int
    d_model: int
    n_heads: int
    d_kv: int
    d_ff: int
    n_encoder_layers: int
    n_decoder_layers: int
    encoder_len: int
    decoder_len: int
    num_buckets: int = 32
    max_distance: int = 128
    norm_eps: float = 1e-6

    def __post_init__(self) -> None:
        for name in (
            "vocab_size",
            "d_model",
            "n_heads",
            "d_kv",
            "d_ff",
            "n_encoder_layers",
            "n_decoder_layers",
            "encoder_len",
            "decoder_len",
            "max_distance",
        ):
            if getattr(self, name) <= 0:
                raise ValueError(f"T5Config.{name} must be positive, got {getattr(self, name)}")
        # Bidirectional buckets halve num_buckets, then half of each half is exact.
        if self.num_buckets < 4 or self.num_buckets % 4:
            raise ValueError(
                f"T5Config.num_buckets must be a positive multiple of 4, got {self.num_buckets}"
            )
        if self.max_distance <= self.num_buckets // 2:
            raise ValueError(
                f"T5Config.max_distance ({self.max_distance}) must exceed num_buckets / 2 "
                f"({self.num_buckets // 2}), where the logarithmic buckets start"
            )
        if self.norm_eps <= 0:
            raise ValueError(f"T5Config.norm_eps must be positive, got {self.norm_eps}")

    @property
    def inner_dim(self) -> int:
        """Width of the concatenated heads, ``n_heads * d_kv``."""
        return self.n_heads * self.d_kv

    def replace(self, **changes: Any) -> T5Config:
        """Returns a copy with ``changes`` applied (and validated)."""
        return dataclasses.replace(self, **changes)


def tiny() -> T5Config:
    """A test-sized model (74k parameters): 2 + 2 layers of width 32, 4 heads of 8,
    vocabulary 512, sequences of 16. Vocabulary, MLP width and the heads' concatenated
    width divide by 8, so tensor parallelism of degree 2, 4 or 8 can split them."""
    return T5Config(
        vocab_size=512,
        d_model=32,
        n_heads=4,
        d_kv=8,
        d_ff=128,
        n_encoder_layers=2,
        n_decoder_layers=2,
        encoder_len=16,
        decoder_len=16,
    )


def _paper(layers: int, hidden: int, heads: int, vocab_k: int) -> T5Config:
    return T5Config(
        vocab_size=vocab_k * 1024,
        d_model=hidden,
        n_heads=heads,
        d_kv=hidden // heads,
        d_ff=4 * hidden,
        n_encoder_layers=layers,
        n_decoder_layers=layers,
        encoder_len=1024,
        decoder_len=1024,
    )


def paper_4gpu() -> T5Config:
    """nnScaler's T5 on 4 GPUs: 24 + 24 layers, width 2048, 32 heads, vocab 512k (~3.9B)."""
    return _paper(24, 2048, 32, 512)


def paper_8gpu() -> T5Config:
    """nnScaler's T5 on 8 GPUs: 32 + 32 layers, width 3072, 48 heads, vocab 1024k (~11.7B)."""
    return _paper(32, 3072, 48, 1024)


def paper_16gpu() -> T5Config:
    """nnScaler's T5 on 16 GPUs: 32 + 32 layers, width 4096, 64 heads, vocab 1536k (~21.5B)."""
    return _paper(32, 4096, 64, 1536)


def paper_32gpu() -> T5Config:
    """nnScaler's T5 on 32 GPUs: 32 + 32 layers, width 6144, 96 heads, vocab 2048k (~46.7B)."""
    return _paper(32, 6144, 96, 2048)


CONFIGS = {
    "tiny": tiny,
    "paper_4gpu": paper_4gpu,
    "paper_8gpu": paper_8gpu,
    "paper_16gpu": paper_16gpu,
    "paper_32gpu": paper_32gpu,
}


def relative_position_bucket(
    relative_position: jax.Array,
    *,
    bidirectional: bool,
    num_buckets: int = 32,
    max_distance: int = 128,
) -> jax.Array:
    """T5's bucket (int32, ``0..num_buckets-1``) of each ``key - query`` distance.

    Bidirectional (the encoder): half the buckets for keys after the query, half for keys
    at or before it. Causal (the decoder): all buckets for keys at or before the query,
    every later key in bucket 0 (masked anyway). Within a half, distances below half of
    it get a bucket each; larger ones share logarithmically wider buckets up to
    ``max_distance``, beyond which all fall in the last bucket.
    """
    rel = jnp.asarray(relative_position, jnp.int32)
    bucket = jnp.zeros_like(rel)
    if bidirectional:
        num_buckets //= 2
        bucket = bucket + (rel > 0).astype(jnp.int32) * num_buckets
        n = jnp.abs(rel)
    else:
        n = -jnp.minimum(rel, 0)
    max_exact = num_buckets // 2
    is_small = n < max_exact
    # distances below max_exact are not used from here on: clamp them off log(0)
    far = jnp.maximum(n, max_exact).astype(jnp.float32)
    large = max_exact + (
        jnp.log(far / max_exact) / math.log(max_distance / max_exact) * (num_buckets - max_exact)
    ).astype(jnp.int32)
    large = jnp.minimum(large, num_buckets - 1)
    return bucket + jnp.where(is_small, n, large)


class T5LayerNorm(nnx.Module):
    """T5's layer norm: ``x * rsqrt(mean(x**2) + eps) * scale`` (no mean, no bias)."""

    def __init__(self, dim: int, *, eps: float = 1e-6):
        self.eps = eps
        self.scale = nnx.Param(jnp.ones((dim,), jnp.float32))

    def __call__(self, x: jax.Array) -> jax.Array:
        variance = jnp.mean(x * x, axis=-1, keepdims=True)
        return x * jax.lax.rsqrt(variance + self.eps) * self.scale[...]


def _linear(d_in: int, d_out: int, std: float, rngs: nnx.Rngs) -> nnx.Linear:
    return nnx.Linear(
        d_in, d_out, use_bias=False, kernel_init=nnx.initializers.normal(std), rngs=rngs
    )


class Attention(nnx.Module):
    """Multi-head attention without logit scaling; ``bias`` (the stack's position bias,
    with the causal mask folded in for the decoder) is added to the logits.

    Initialised as Mesh-TensorFlow's T5: the query with std ``(d_model * d_kv)**-0.5``
    (this is where the missing ``1/sqrt(d_kv)`` went), keys and values ``d_model**-0.5``,
    the output ``inner_dim**-0.5``.
    """

    def __init__(self, cfg: T5Config, *, rngs: nnx.Rngs):
        self.n_heads = cfg.n_heads
        self.d_kv = cfg.d_kv
        d, inner = cfg.d_model, cfg.inner_dim
        self.q = _linear(d, inner, (d * cfg.d_kv) ** -0.5, rngs)
        self.k = _linear(d, inner, d**-0.5, rngs)
        self.v = _linear(d, inner, d**-0.5, rngs)
        self.o = _linear(inner, d, inner**-0.5, rngs)

    def __call__(self, x: jax.Array, kv: jax.Array, bias: jax.Array | None) -> jax.Array:
        """``x[batch, q_len, d_model]`` attends to ``kv[batch, k_len, d_model]``;
        ``bias`` broadcasts to ``[batch, heads, q_len, k_len]``."""
        b, lq, _ = x.shape
        lk = kv.shape[1]
        q = self.q(x).reshape(b, lq, self.n_heads, self.d_kv)
        k = self.k(kv).reshape(b, lk, self.n_heads, self.d_kv)
        v = self.v(kv).reshape(b, lk, self.n_heads, self.d_kv)
        scores = jnp.einsum("bqhd,bkhd->bhqk", q, k)
        if bias is not None:
            scores = scores + bias
        probs = jax.nn.softmax(scores, axis=-1)
        out = jnp.einsum("bhqk,bkhd->bqhd", probs, v).reshape(b, lq, self.n_heads * self.d_kv)
        return self.o(out)


class MLP(nnx.Module):
    """T5 v1.0's feed-forward: ``wo(relu(wi(x)))``."""

    def __init__(self, cfg: T5Config, *, rngs: nnx.Rngs):
        self.wi = _linear(cfg.d_model, cfg.d_ff, cfg.d_model**-0.5, rngs)
        self.wo = _linear(cfg.d_ff, cfg.d_model, cfg.d_ff**-0.5, rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.wo(jax.nn.relu(self.wi(x)))


class EncoderBlock(nnx.Module):
    """``x + attn(norm(x))`` (bidirectional, position-biased), then ``x + mlp(norm(x))``."""

    def __init__(self, cfg: T5Config, *, rngs: nnx.Rngs):
        self.attn_norm = T5LayerNorm(cfg.d_model, eps=cfg.norm_eps)
        self.attn = Attention(cfg, rngs=rngs)
        self.mlp_norm = T5LayerNorm(cfg.d_model, eps=cfg.norm_eps)
        self.mlp = MLP(cfg, rngs=rngs)

    def __call__(self, x: jax.Array, bias: jax.Array) -> jax.Array:
        h = self.attn_norm(x)
        x = x + self.attn(h, h, bias)
        return x + self.mlp(self.mlp_norm(x))


class DecoderBlock(nnx.Module):
    """Causal self-attention, cross-attention on the encoder output, then the MLP; each
    pre-normed and residual."""

    def __init__(self, cfg: T5Config, *, rngs: nnx.Rngs):
        self.self_attn_norm = T5LayerNorm(cfg.d_model, eps=cfg.norm_eps)
        self.self_attn = Attention(cfg, rngs=rngs)
        self.cross_attn_norm = T5LayerNorm(cfg.d_model, eps=cfg.norm_eps)
        self.cross_attn = Attention(cfg, rngs=rngs)
        self.mlp_norm = T5LayerNorm(cfg.d_model, eps=cfg.norm_eps)
        self.mlp = MLP(cfg, rngs=rngs)

    def __call__(self, x: jax.Array, encoded: jax.Array, bias: jax.Array) -> jax.Array:
        h = self.self_attn_norm(x)
        x = x + self.self_attn(h, h, bias)
        x = x + self.cross_attn(self.cross_attn_norm(x), encoded, None)
        return x + self.mlp(self.mlp_norm(x))


class _Stack(nnx.Module):
    """What both stacks share: the relative position bias table and its lookup."""

    def _init_bias(self, cfg: T5Config, bidirectional: bool, rngs: nnx.Rngs) -> None:
        self.bidirectional = bidirectional
        self.num_buckets = cfg.num_buckets
        self.max_distance = cfg.max_distance
        self.relative_attention_bias = nnx.Embed(
            cfg.num_buckets,
            cfg.n_heads,
            embedding_init=nnx.initializers.normal(cfg.d_model**-0.5),
            rngs=rngs,
        )

    def position_bias(self, q_len: int, k_len: int) -> jax.Array:
        """The bias ``[1, heads, q_len, k_len]`` of this stack's bucketed distances."""
        keys, queries = jnp.arange(k_len, dtype=jnp.int32), jnp.arange(q_len, dtype=jnp.int32)
        rel = keys[None, :] - queries[:, None]
        buckets = relative_position_bucket(
            rel,
            bidirectional=self.bidirectional,
            num_buckets=self.num_buckets,
            max_distance=self.max_distance,
        )
        bias = self.relative_attention_bias(buckets)  # [q, k, heads]
        return jnp.transpose(bias, (2, 0, 1))[None]


class Encoder(_Stack):
    """The encoder stack: blocks sharing one bidirectional position bias, a final norm."""

    def __init__(self, cfg: T5Config, *, rngs: nnx.Rngs):
        self._init_bias(cfg, True, rngs)
        self.blocks = nnx.List([EncoderBlock(cfg, rngs=rngs) for _ in range(cfg.n_encoder_layers)])
        self.final_norm = T5LayerNorm(cfg.d_model, eps=cfg.norm_eps)

    def __call__(self, x: jax.Array) -> jax.Array:
        """Embedded inputs ``[batch, len, d_model]`` to the normed encoder output."""
        bias = self.position_bias(x.shape[1], x.shape[1])
        for block in self.blocks:
            x = block(x, bias)
        return self.final_norm(x)


class Decoder(_Stack):
    """The decoder stack: blocks sharing one causal position bias (with the causal mask
    folded in), cross-attending to the encoder output; a final norm."""

    def __init__(self, cfg: T5Config, *, rngs: nnx.Rngs):
        self._init_bias(cfg, False, rngs)
        self.blocks = nnx.List([DecoderBlock(cfg, rngs=rngs) for _ in range(cfg.n_decoder_layers)])
        self.final_norm = T5LayerNorm(cfg.d_model, eps=cfg.norm_eps)

    def __call__(self, y: jax.Array, encoded: jax.Array) -> jax.Array:
        """Embedded decoder inputs ``[batch, len, d_model]`` and the encoder output to
        the normed decoder output."""
        n = y.shape[1]
        bias = self.position_bias(n, n)
        causal = jnp.arange(n)[None, :] <= jnp.arange(n)[:, None]  # key <= query
        bias = jnp.where(causal[None, None], bias, _MASKED)
        for block in self.blocks:
            y = block(y, encoded, bias)
        return self.final_norm(y)


class T5(nnx.Module):
    """Shared embedding, encoder, decoder, and the tied LM head."""

    def __init__(self, cfg: T5Config, *, rngs: nnx.Rngs):
        self.cfg = cfg
        self.embed = nnx.Embed(
            cfg.vocab_size, cfg.d_model, embedding_init=nnx.initializers.normal(1.0), rngs=rngs
        )
        # nnx.Embed fixes its dtype to the parameter's at construction (float32); None lets
        # it follow the parameter as traced (bf16 under a bf16 plan), as nnx.Linear does
        self.embed.dtype = None
        self.encoder = Encoder(cfg, rngs=rngs)
        self.decoder = Decoder(cfg, rngs=rngs)

    def __call__(self, inputs: jax.Array, decoder_inputs: jax.Array) -> jax.Array:
        """Maps ``inputs[batch, enc_len]`` and ``decoder_inputs[batch, dec_len]`` (int32)
        to ``logits[batch, dec_len, vocab]``."""
        # Both lookups first: the embedding ops precede every repeated layer.
        x = self.embed(inputs)
        y = self.embed(decoder_inputs)
        encoded = self.encoder(x)
        out = self.decoder(y, encoded)
        return self.embed.attend(out * self.cfg.d_model**-0.5)


def loss(model: T5, batch: dict[str, jax.Array]) -> jax.Array:
    """Mean token cross entropy of the decoder's logits against ``batch["targets"]``."""
    logits = model(batch["inputs"], batch["decoder_inputs"])
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"]).mean()


def synthetic_batch(cfg: T5Config, batch_size: int, seed: int = 0) -> dict[str, jax.Array]:
    """A deterministic batch of a learnable task: reverse the input sequence.

    Inputs are uniform tokens in ``1..vocab-1`` (0 is the decoder's start token). The
    target at position ``t`` is ``inputs[-1 - t]`` (wrapping when the decoder is longer
    than the encoder), and the decoder reads the targets shifted right behind a 0.

    Returns:
        ``{"inputs": int32[batch, encoder_len], "decoder_inputs": int32[batch,
        decoder_len], "targets": int32[batch, decoder_len]}``.
    """
    rng = np.random.default_rng(seed)
    inputs = rng.integers(1, cfg.vocab_size, size=(batch_size, cfg.encoder_len), dtype=np.int32)
    source = (cfg.encoder_len - 1 - np.arange(cfg.decoder_len)) % cfg.encoder_len
    targets = inputs[:, source]
    decoder_inputs = np.concatenate([np.zeros((batch_size, 1), np.int32), targets[:, :-1]], axis=1)
    return {
        "inputs": jnp.asarray(inputs),
        "decoder_inputs": jnp.asarray(decoder_inputs),
        "targets": jnp.asarray(targets),
    }


def num_params(cfg: T5Config) -> int:
    """The parameter count of ``T5(cfg)``, from the shapes (no allocation).

    Shared embedding ``V*d``; per stack a bias table ``buckets*heads`` and a final norm
    ``d``; an attention ``4*d*inner``, an MLP ``2*d*d_ff``, a norm ``d``; encoder blocks
    have one attention and two norms, decoder blocks two attentions and three norms.
    """
    d, inner = cfg.d_model, cfg.inner_dim
    attn, mlp = 4 * d * inner, 2 * d * cfg.d_ff
    stack = cfg.num_buckets * cfg.n_heads + d
    encoder = cfg.n_encoder_layers * (attn + mlp + 2 * d)
    decoder = cfg.n_decoder_layers * (2 * attn + mlp + 3 * d)
    return cfg.vocab_size * d + 2 * stack + encoder + decoder
