"""A seeded generator of transformer variants, written the many ways people write them.

Each :class:`Variant` draws every choice independently (:data:`CHOICES`) from its own
``random.Random(f"{seed}:{index}")``, so variant ``i`` of seed ``S`` is the same on every
machine and run:

* attention: MHA, GQA (2 or 4 key/value heads of 8) or MQA (1); q/k/v as separate
  projections, one fused q/k/v kernel cut by ``jnp.split`` or by a reshape into heads, or q
  apart and a fused k/v kernel; the core by ``einsum`` or ``jax.nn.dot_product_attention``,
  grouped queries by a reshape into (kv heads, group) or by ``jnp.repeat`` of k and v; the
  causal mask by ``where``, an additive bias or ``is_causal``; biases on the projections
  or not;
* positions by RoPE or a learned table; the MLP GELU, SwiGLU, or SwiGLU with a fused
  gate/up kernel, optionally a top-2 mixture of experts (every expert on every token,
  weighted by the gate, as simple JAX MoE code writes it); the embedding tied to the
  output head or not; pre- or post-norm, LayerNorm or RMSNorm;
* the loss by ``optax.softmax_cross_entropy_with_integer_labels``, by ``log_softmax`` and
  ``take_along_axis``, or by a one-hot product;
* layers as a Python list or stacked and run by ``jax.lax.scan``;
* the parameters held as a plain pytree, as ``nnx.Param``s of an nnx Module, or as a linen
  Module's params (the loss closing over ``module.apply``);
* the shape: width 128 or 256, 2 or 3 layers, sequence 64 or 128.

Alongside each variant, the plain-JAX layouts a user would write for it
(:meth:`VariantModel.rules`): Megatron name rules for the variant's parameter names at a
given tensor-parallel degree (q/k/v, up and gate column-parallel; output and down
projections row-parallel; key/value projections replicated when the kv heads are fewer
than tp; the embedding split by vocabulary or by width, both offered so that the bench
keeps whichever uses less memory). The other layouts (dp, FSDP, FSDP x TP) are
:mod:`bench.plain_baselines`' over the same pytree.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import jax
import jax.numpy as jnp
import optax
from jax.sharding import PartitionSpec as P

HEADS = 8
CHOICES: dict[str, tuple] = {
    "attn": ("mha", "gqa", "mqa"),
    "kv_heads": (2, 4),  # gqa only
    "proj": ("separate", "fused-split", "fused-reshape", "fused-kv"),
    "core": ("einsum", "dpa"),
    "group": ("reshape", "repeat"),  # gqa / mqa only
    "mask": ("where", "bias", "is_causal"),  # is_causal: dpa only
    "bias": (False, True),
    "pos": ("rope", "learned"),
    "mlp": ("gelu", "swiglu", "swiglu-fused"),
    "moe": (False, False, False, True),  # one variant in four
    "tied": (False, True),
    "norm": ("pre-ln", "pre-rms", "post-ln", "post-rms"),
    "loss": ("optax", "log_softmax", "onehot"),
    "layers": ("list", "scan"),
    "form": ("params", "nnx", "linen"),
    "d": (128, 256),
    "depth": (2, 3),
    "seq": (64, 128),
}
BATCH, VOCAB, EXPERTS = 16, 1024, 4


@dataclass(frozen=True)
class Variant:
    """One drawn transformer (see the module's docstring for what each field means)."""

    seed: int
    index: int
    attn: str
    kv_heads: int
    proj: str
    core: str
    group: str
    mask: str
    bias: bool
    pos: str
    mlp: str
    moe: bool
    tied: bool
    norm: str
    loss: str
    layers: str
    form: str
    d: int
    depth: int
    seq: int

    @property
    def name(self) -> str:
        return f"v{self.seed}-{self.index}"

    def choices(self) -> dict[str, Any]:
        """The drawn choices that shape this variant (those that do not apply dropped)."""
        out = {k: v for k, v in asdict(self).items() if k not in ("seed", "index")}
        if self.attn == "mha":
            out.pop("group")
        return out

    def describe(self) -> str:
        c = self.choices()
        heads = f"{c.pop('attn')} {HEADS}q/{c.pop('kv_heads')}kv"
        size = f"d{c.pop('d')} x{c.pop('depth')} s{c.pop('seq')}"
        flags = [f for k, f in (("bias", "biased"), ("moe", "moe"), ("tied", "tied")) if c.pop(k)]
        return " ".join([heads, *map(str, c.values()), *flags, size])


def draw(seed: int, index: int) -> Variant:
    """Variant ``index`` of ``seed``: every choice drawn independently, then the few
    combinations that do not exist made valid (``is_causal`` is an argument of
    ``dot_product_attention`` only; experts keep their gate and up kernels apart)."""
    rng = random.Random(f"{seed}:{index}")
    c = {k: rng.choice(v) for k, v in CHOICES.items()}
    c["kv_heads"] = {"mha": HEADS, "mqa": 1}.get(c["attn"], c["kv_heads"])
    if c["attn"] == "mha":
        c["group"] = "-"
    if c["mask"] == "is_causal" and c["core"] != "dpa":
        c["mask"] = rng.choice(("where", "bias"))
    if c["moe"] and c["mlp"] == "swiglu-fused":  # experts keep gate and up apart
        c["mlp"] = "swiglu"
    return Variant(seed, index, **c)


def draw_many(seed: int, n: int) -> list[Variant]:
    return [draw(seed, i) for i in range(n)]


# ---- parameters --------------------------------------------------------------------------


def init(v: Variant, key: int = 0) -> dict:
    """The variant's parameters as a pytree (the names its rules match)."""
    d, kv = v.d, v.kv_heads * (v.d // HEADS)
    f = 4 * d if v.mlp == "gelu" else 3 * d
    keys = iter(jax.random.split(jax.random.key(key), 64 * v.depth + 8))

    def dense(n_in, *n_out, bias=v.bias):
        shape = (n_in, *n_out)
        p = {"kernel": jax.random.normal(next(keys), shape) * n_in**-0.5}
        if bias:
            p["bias"] = jnp.zeros(shape[1:])
        return p

    def norm():
        p = {"scale": jnp.ones(d)}
        if v.norm.endswith("ln"):
            p["bias"] = jnp.zeros(d)
        return p

    def attention():
        if v.proj == "separate":
            return {"q": dense(d, d), "k": dense(d, kv), "v": dense(d, kv), "o": dense(d, d)}
        if v.proj == "fused-kv":
            return {"q": dense(d, d), "kv": dense(d, 2 * kv), "o": dense(d, d)}
        return {"qkv": dense(d, d + 2 * kv), "o": dense(d, d)}

    def mlp():
        if v.moe:
            e = lambda *s: jax.random.normal(next(keys), (EXPERTS, *s)) * s[0] ** -0.5  # noqa: E731
            up = {"up": e(d, f)} if v.mlp == "gelu" else {"gate": e(d, f), "up": e(d, f)}
            return {"router": dense(d, EXPERTS, bias=False), **up, "down": e(f, d)}
        if v.mlp == "gelu":
            return {"up": dense(d, f), "down": dense(f, d)}
        if v.mlp == "swiglu":
            return {"gate": dense(d, f), "up": dense(d, f), "down": dense(f, d)}
        return {"gate_up": dense(d, 2 * f), "down": dense(f, d)}

    layers = [
        {"norm1": norm(), "attn": attention(), "norm2": norm(), "mlp": mlp()}
        for _ in range(v.depth)
    ]
    params = {"embed": jax.random.normal(next(keys), (VOCAB, d)) * 0.02, "layers": layers}
    if v.pos == "learned":
        params["pos"] = jax.random.normal(next(keys), (v.seq, d)) * 0.02
    params["norm_f"] = norm()
    if not v.tied:
        params["head"] = jax.random.normal(next(keys), (d, VOCAB)) * d**-0.5
    if v.layers == "scan":
        params["layers"] = jax.tree.map(lambda *xs: jnp.stack(xs), *layers)
    return params


# ---- the forward pass and the loss ----------------------------------------------------------


def _dense(p, x):
    y = x @ p["kernel"]
    return y + p["bias"] if "bias" in p else y


def _norm(p, x):
    if "bias" in p:  # LayerNorm
        mean = x.mean(-1, keepdims=True)
        var = ((x - mean) ** 2).mean(-1, keepdims=True)
        return (x - mean) * jax.lax.rsqrt(var + 1e-5) * p["scale"] + p["bias"]
    return x * jax.lax.rsqrt((x * x).mean(-1, keepdims=True) + 1e-6) * p["scale"]


def _rope(x):
    _, s, _, c = x.shape
    freq = 1.0 / (10000 ** (jnp.arange(0, c, 2) / c))
    angle = jnp.arange(s)[:, None] * freq[None, :]
    cos, sin = jnp.cos(angle)[None, :, None, :], jnp.sin(angle)[None, :, None, :]
    x1, x2 = x[..., ::2], x[..., 1::2]
    return jnp.stack([x1 * cos - x2 * sin, x1 * sin + x2 * cos], -1).reshape(x.shape)


def _qkv(v: Variant, p, x):
    """q ``(b, s, H, hd)``, k and v ``(b, s, K, hd)`` as the variant projects them."""
    b, s, d = x.shape
    hd, k_heads = d // HEADS, v.kv_heads
    heads = lambda t, n: t.reshape(b, s, n, hd)  # noqa: E731
    if v.proj == "separate":
        return (heads(_dense(p["q"], x), HEADS), heads(_dense(p["k"], x), k_heads),
                heads(_dense(p["v"], x), k_heads))  # fmt: skip
    if v.proj == "fused-kv":
        k, val = jnp.split(_dense(p["kv"], x), 2, axis=-1)
        return heads(_dense(p["q"], x), HEADS), heads(k, k_heads), heads(val, k_heads)
    qkv = _dense(p["qkv"], x)
    if v.proj == "fused-split":
        q, k, val = jnp.split(qkv, [d, d + k_heads * hd], axis=-1)
        return heads(q, HEADS), heads(k, k_heads), heads(val, k_heads)
    qkv = heads(qkv, HEADS + 2 * k_heads)  # fused-reshape: into heads, then cut
    return qkv[:, :, :HEADS], qkv[:, :, HEADS : HEADS + k_heads], qkv[:, :, HEADS + k_heads :]


def _attend(v: Variant, q, k, val):
    b, s, _, hd = q.shape
    groups = HEADS // v.kv_heads
    causal = jnp.tril(jnp.ones((s, s), bool))
    if groups > 1 and v.group == "repeat":
        k, val = jnp.repeat(k, groups, axis=2), jnp.repeat(val, groups, axis=2)
        groups = 1
    if v.core == "dpa":
        kw = {"is_causal": True} if v.mask == "is_causal" else (
            {"mask": causal[None, None]} if v.mask == "where"
            else {"bias": jnp.where(causal, 0.0, -1e9)[None, None]}
        )  # fmt: skip
        return jax.nn.dot_product_attention(q, k, val, implementation="xla", **kw).reshape(b, s, -1)
    if groups > 1:  # queries grouped by their key/value head
        q = q.reshape(b, s, v.kv_heads, groups, hd)
        scores = jnp.einsum("bqhgc,bkhc->bhgqk", q, k) / jnp.sqrt(hd)
    else:
        scores = jnp.einsum("bqhc,bkhc->bhqk", q, k) / jnp.sqrt(hd)
    if v.mask == "where":
        scores = jnp.where(causal, scores, -1e9)
    else:
        scores = scores + jnp.where(causal, 0.0, -1e9)
    probs = jax.nn.softmax(scores, axis=-1)
    if groups > 1:
        return jnp.einsum("bhgqk,bkhc->bqhgc", probs, val).reshape(b, s, -1)
    return jnp.einsum("bhqk,bkhc->bqhc", probs, val).reshape(b, s, -1)


def _attention(v: Variant, p, x):
    q, k, val = _qkv(v, p, x)
    if v.pos == "rope":
        q, k = _rope(q), _rope(k)
    return _dense(p["o"], _attend(v, q, k, val))


def _act(v: Variant, p, x, up: Callable):
    if v.mlp == "gelu":
        return jax.nn.gelu(up(p["up"], x))
    if v.mlp == "swiglu" or v.moe:
        return jax.nn.silu(up(p["gate"], x)) * up(p["up"], x)
    gate, u = jnp.split(up(p["gate_up"], x), 2, axis=-1)
    return jax.nn.silu(gate) * u


def _mlp(v: Variant, p, x):
    if not v.moe:
        return _dense(p["down"], _act(v, p, x, _dense))
    probs = jax.nn.softmax(_dense(p["router"], x), axis=-1)  # (b, s, E)
    top, idx = jax.lax.top_k(probs, 2)
    gates = (jax.nn.one_hot(idx, EXPERTS) * top[..., None]).sum(-2)
    gates = gates / gates.sum(-1, keepdims=True)
    h = _act(v, p, x, lambda w, t: jnp.einsum("bsd,edf->bsef", t, w))
    out = jnp.einsum("bsef,efd->bsed", h, p["down"])
    return jnp.einsum("bsed,bse->bsd", out, gates)


def _layer(v: Variant, p, x):
    if v.norm.startswith("pre"):
        x = x + _attention(v, p["attn"], _norm(p["norm1"], x))
        return x + _mlp(v, p["mlp"], _norm(p["norm2"], x))
    x = _norm(p["norm1"], x + _attention(v, p["attn"], x))
    return _norm(p["norm2"], x + _mlp(v, p["mlp"], x))


def _loss_of(v: Variant, logits, labels):
    if v.loss == "optax":
        return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()
    logp = jax.nn.log_softmax(logits, axis=-1)
    if v.loss == "log_softmax":
        return -jnp.take_along_axis(logp, labels[..., None], axis=-1).mean()
    return -(jax.nn.one_hot(labels, logits.shape[-1]) * logp).sum(-1).mean()


def params_loss(v: Variant) -> Callable:
    """``loss(params, batch)``: next-token cross-entropy of the variant over :func:`init`'s
    pytree."""

    def loss(params, batch):
        ids = batch["ids"]
        x = params["embed"][ids]
        if v.pos == "learned":
            x = x + params["pos"][: ids.shape[1]]
        if v.layers == "scan":
            x, _ = jax.lax.scan(lambda h, p: (_layer(v, p, h), None), x, params["layers"])
        else:
            for p in params["layers"]:
                x = _layer(v, p, x)
        x = _norm(params["norm_f"], x)
        logits = x @ (params["embed"].T if v.tied else params["head"])
        return _loss_of(v, logits[:, :-1], ids[:, 1:])

    return loss


# ---- the three ways to hold the parameters ----------------------------------------------------


def _nnx(v: Variant, params):
    from flax import nnx

    class VariantLM(nnx.Module):
        def __init__(self, params):
            self.params = nnx.data(jax.tree.map(nnx.Param, params))

    loss = params_loss(v)
    is_var = lambda x: isinstance(x, nnx.Variable)  # noqa: E731

    def nnx_loss(model, batch):
        return loss(jax.tree.map(lambda p: p[...], model.params, is_leaf=is_var), batch)

    return VariantLM(params), nnx_loss


def _linen(v: Variant, params, batch):
    import flax.linen as nn

    loss = params_loss(v)

    class VariantLM(nn.Module):
        values: Any

        @nn.compact
        def __call__(self, batch):
            p = {k: self.param(k, lambda _, x=x: x) for k, x in self.values.items()}
            return loss(p, batch)

    module = VariantLM(params)
    variables = module.init(jax.random.key(0), batch)
    return variables, module.apply


@dataclass(frozen=True)
class VariantModel:
    """A drawn variant ready for the bench: what ``jscaler.parallelize`` gets and the
    same numbers as a pytree for plain JAX."""

    variant: Variant
    batch: Any

    @property
    def name(self) -> str:
        return self.variant.name

    def make(self) -> tuple[Any, Callable]:
        """``(model, loss(model, batch))`` in the variant's form, fresh each call."""
        v, params = self.variant, init(self.variant)
        if v.form == "nnx":
            return _nnx(v, params)
        if v.form == "linen":
            return _linen(v, params, self.batch)
        return params, params_loss(v)

    def plain(self) -> tuple[Any, Callable]:
        """The parameters as a pytree and a loss over it (the plain-JAX steps')."""
        return init(self.variant), params_loss(self.variant)

    def rules(self, tp: int, embed: str = "vocab") -> list[tuple[str, P]]:
        """Megatron name rules for this variant's parameter paths at degree ``tp``; the
        embedding split by ``"vocab"`` or ``"width"``."""
        v = self.variant
        lead = (None,) if v.layers == "scan" else ()
        col, row = P(*lead, None, "tp"), P(*lead, "tp", None)
        expert_col, expert_row = P(*lead, None, None, "tp"), P(*lead, None, "tp", None)
        kv_split = v.kv_heads % tp == 0
        rules = [
            (r"attn/(q|qkv)/kernel$", col),
            (r"attn/(q|qkv)/bias$", P(*lead, "tp")),
            (r"attn/o/kernel$", row),
        ]
        if kv_split:
            rules += [(r"attn/(k|v|kv)/kernel$", col), (r"attn/(k|v|kv)/bias$", P(*lead, "tp"))]
        if v.moe:
            rules += [(r"mlp/(gate|up)$", expert_col), (r"mlp/down$", expert_row)]
        else:
            rules += [
                (r"mlp/(gate|up|gate_up)/kernel$", col),
                (r"mlp/(gate|up|gate_up)/bias$", P(*lead, "tp")),
                (r"mlp/down/kernel$", row),
            ]
        rules.append((r"^embed$", P("tp", None) if embed == "vocab" else P(None, "tp")))
        rules.append((r"^head$", P(None, "tp")))
        return rules


def build(v: Variant) -> VariantModel:
    ids = jax.random.randint(jax.random.key(1), (BATCH, v.seq), 0, VOCAB)
    return VariantModel(v, {"ids": ids})
