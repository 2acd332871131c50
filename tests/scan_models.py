"""Models whose layers are stacked under a scan, in the three ways users write it.

* ``jax.lax.scan`` over a stacked params pytree: :mod:`bench.scan_models`' Llama (GQA,
  SwiGLU, RoPE), with ``jax.checkpoint`` around the layer or without;
* ``nnx.scan`` over ``nnx.vmap``-stacked blocks (``nnx.split_rngs``, ``StateAxes``): the
  registered ``gpt-tiny-scan`` and ``gpt-tiny-scan-remat``;
* linen ``nn.scan`` (``variable_axes``, ``split_rngs``), with ``nn.remat`` or without:
  :class:`LinenDecoder` here.

Each builder returns ``(model_or_params, loss, batches)`` for ``assert_matches_reference``.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax

from bench.plain_models import Size
from bench.scan_models import llama_init, scan_loss, stack_layers

VOCAB, SEQ, D, HEADS, LAYERS, BATCH = 128, 16, 32, 4, 4, 8


def _ids(seed: int, vocab: int = VOCAB, seq: int = SEQ, batch: int = BATCH):
    return {"ids": jax.random.randint(jax.random.key(seed), (batch, seq), 0, vocab)}


def lax_scan(remat: bool = False, steps: int = 3):
    """The plain-JAX Llama of ``bench.scan_models`` at a test size (4 layers)."""
    size = Size(d=32, layers=LAYERS, heads=8, seq=SEQ, batch=BATCH, vocab=VOCAB)
    params = stack_layers(llama_init(size))
    return params, scan_loss(size.heads, remat=remat), [_ids(s) for s in range(steps)]


class _Block(nn.Module):
    @nn.compact
    def __call__(self, x, _):
        b, s, d = x.shape
        h = nn.LayerNorm(name="norm1")(x)
        q, k, v = (
            nn.Dense(d, use_bias=False, name=n)(h).reshape(b, s, HEADS, d // HEADS) for n in "qkv"
        )
        scores = jnp.einsum("bqhc,bkhc->bhqk", q, k) / jnp.sqrt(d // HEADS)
        scores = jnp.where(jnp.tril(jnp.ones((s, s), bool)), scores, -1e9)
        out = jnp.einsum("bhqk,bkhc->bqhc", jax.nn.softmax(scores, -1), v).reshape(b, s, d)
        x = x + nn.Dense(d, name="o")(out)
        h = nn.gelu(nn.Dense(4 * d, name="up")(nn.LayerNorm(name="norm2")(x)))
        return x + nn.Dense(d, name="down")(h), None


class LinenDecoder(nn.Module):
    """Embedding, ``nn.scan`` over :class:`_Block` (optionally ``nn.remat``-ed), a head."""

    remat: bool = False

    @nn.compact
    def __call__(self, ids):
        x = nn.Embed(VOCAB, D, name="embed")(ids)
        block = nn.remat(_Block) if self.remat else _Block
        stack = nn.scan(
            block, variable_axes={"params": 0}, split_rngs={"params": True}, length=LAYERS
        )
        x, _ = stack(name="layers")(x, None)
        return nn.Dense(VOCAB, name="head")(nn.LayerNorm(name="norm")(x))


def linen_scan(remat: bool = False, steps: int = 3):
    model = LinenDecoder(remat=remat)
    batches = [_ids(s) for s in range(steps)]
    variables = model.init(jax.random.key(0), batches[0]["ids"])

    def loss(variables, batch):
        logits = model.apply(variables, batch["ids"])
        labels = batch["ids"][:, 1:]
        return optax.softmax_cross_entropy_with_integer_labels(logits[:, :-1], labels).mean()

    return variables, loss, batches


# name -> builder(remat) of the ways outside the model registry (nnx.scan is registered)
WAYS = {"jax.lax.scan": lax_scan, "nn.scan": linen_scan}
