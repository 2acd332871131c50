"""A Llama-style decoder written twice: its layers in a Python list, and stacked and scanned.

Grouped-query attention, SwiGLU, RoPE and RMSNorm over a params pytree, as MaxText-style
code writes them. ``llama_list`` loops over ``params["layers"]`` (a list of per-layer
dicts); ``llama_scan`` stacks the same parameters (every leaf gets a leading layer axis)
and runs ``jax.lax.scan`` over them. Both start from the same numbers, so their losses
agree. Name rules for plain JAX come with each: the scanned rules are the list rules with
one more leading ``None`` on every stacked leaf.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax
from jax.sharding import PartitionSpec as P

from bench.plain_models import BenchModel, Size

SCAN_SIZE = Size(d=512, layers=4, heads=8, seq=256, batch=16, vocab=8192)
SCAN_SMALL = Size(d=64, layers=2, heads=8, seq=32, batch=8, vocab=512)
KV_GROUPS = 4  # query heads per key/value head


def llama_init(size: Size, seed: int = 0) -> dict:
    """The list twin's parameters: embeddings, per-layer dicts, a final norm, a head."""
    d, f, hd = size.d, 3 * size.d, size.d // size.heads
    kv = size.heads // KV_GROUPS * hd
    keys = iter(jax.random.split(jax.random.key(seed), 2 + 7 * size.layers))

    def w(n_in, n_out):
        return jax.random.normal(next(keys), (n_in, n_out)) * (n_in**-0.5)

    layers = [
        {
            "attn_norm": jnp.ones(d),
            "wq": w(d, d),
            "wk": w(d, kv),
            "wv": w(d, kv),
            "wo": w(d, d),
            "mlp_norm": jnp.ones(d),
            "w_gate": w(d, f),
            "w_up": w(d, f),
            "w_down": w(f, d),
        }
        for _ in range(size.layers)
    ]
    return {
        "embed": jax.random.normal(next(keys), (size.vocab, d)) * 0.02,
        "layers": layers,
        "norm": jnp.ones(d),
        "head": w(d, size.vocab),
    }


def stack_layers(params: dict) -> dict:
    """The scanned twin's parameters: ``layers`` as one dict of stacked leaves."""
    stacked = jax.tree.map(lambda *xs: jnp.stack(xs), *params["layers"])
    return {**params, "layers": stacked}


def _rms(scale, x):
    return x * jax.lax.rsqrt((x * x).mean(-1, keepdims=True) + 1e-6) * scale


def _rope(x):
    b, s, h, c = x.shape
    freq = 1.0 / (10000 ** (jnp.arange(0, c, 2) / c))
    angle = jnp.arange(s)[:, None] * freq[None, :]
    cos, sin = jnp.cos(angle)[None, :, None, :], jnp.sin(angle)[None, :, None, :]
    x1, x2 = x[..., ::2], x[..., 1::2]
    return jnp.stack([x1 * cos - x2 * sin, x1 * sin + x2 * cos], -1).reshape(x.shape)


def _layer(p, x, heads: int):
    b, s, d = x.shape
    hd = d // heads
    kv_heads = heads // KV_GROUPS
    h = _rms(p["attn_norm"], x)
    q = _rope((h @ p["wq"]).reshape(b, s, heads, hd))
    k = _rope((h @ p["wk"]).reshape(b, s, kv_heads, hd))
    v = (h @ p["wv"]).reshape(b, s, kv_heads, hd)
    q = q.reshape(b, s, kv_heads, KV_GROUPS, hd)
    scores = jnp.einsum("bqhgc,bkhc->bhgqk", q, k) / jnp.sqrt(hd)
    causal = jnp.tril(jnp.ones((s, s), bool))
    probs = jax.nn.softmax(jnp.where(causal, scores, -1e9), axis=-1)
    out = jnp.einsum("bhgqk,bkhc->bqhgc", probs, v).reshape(b, s, d)
    x = x + out @ p["wo"]
    h = _rms(p["mlp_norm"], x)
    return x + (jax.nn.silu(h @ p["w_gate"]) * (h @ p["w_up"])) @ p["w_down"]


def _head(params, x, ids):
    logits = _rms(params["norm"], x) @ params["head"]
    return optax.softmax_cross_entropy_with_integer_labels(logits[:, :-1], ids[:, 1:]).mean()


def list_loss(heads: int):
    def loss(params, batch):
        ids = batch["ids"]
        x = params["embed"][ids]
        for p in params["layers"]:
            x = _layer(p, x, heads)
        return _head(params, x, ids)

    return loss


def scan_loss(heads: int, remat: bool = False):
    def loss(params, batch):
        ids = batch["ids"]
        x = params["embed"][ids]
        step = lambda x, p: (_layer(p, x, heads), None)  # noqa: E731
        if remat:
            step = jax.checkpoint(step)
        x, _ = jax.lax.scan(step, x, params["layers"])
        return _head(params, x, ids)

    return loss


_COL, _ROW = P(None, "tp"), P("tp", None)
LIST_RULES = [
    (r"(wq|wk|wv|w_gate|w_up)$", _COL),
    (r"(wo|w_down)$", _ROW),
    (r"embed$", _ROW),
    (r"head$", _COL),
]
SCAN_RULES = [
    (r"layers/(wq|wk|wv|w_gate|w_up)$", P(None, None, "tp")),
    (r"layers/(wo|w_down)$", P(None, "tp", None)),
    (r"embed$", _ROW),
    (r"head$", _COL),
]


def _batch(size: Size):
    return {"ids": jax.random.randint(jax.random.key(1), (size.batch, size.seq), 0, size.vocab)}


def _describe(size: Size, how: str) -> str:
    return (
        f"plain-JAX Llama, layers {how}: GQA ({size.heads} q / {size.heads // KV_GROUPS} kv "
        f"heads), SwiGLU, RoPE; d {size.d}, {size.layers} layers, seq {size.seq}, vocab "
        f"{size.vocab}, batch {size.batch}"
    )


def llama_list(size: Size) -> BenchModel:
    loss = list_loss(size.heads)
    init = lambda: llama_init(size)  # noqa: E731
    return BenchModel(
        "llama-list", _describe(size, "in a list"), init, loss, lambda: (init(), loss),
        _batch(size), LIST_RULES,
    )  # fmt: skip


def llama_scan(size: Size) -> BenchModel:
    loss = scan_loss(size.heads)
    init = lambda: stack_layers(llama_init(size))  # noqa: E731
    return BenchModel(
        "llama-scan", _describe(size, "stacked under jax.lax.scan"), init, loss,
        lambda: (init(), loss), _batch(size), SCAN_RULES,
    )  # fmt: skip
