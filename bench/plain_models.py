"""The models of ``jscaler bench plain``: code nobody here wrote for jscaler.

Each builder returns a :class:`BenchModel`: what ``jscaler.parallelize`` is given (a
params pytree or an nnx Module, made fresh per run), the same parameters as a pytree
with a loss over it for the plain-JAX step, one batch, and the Megatron name rules a
user would write for the model's parameter paths (column-parallel for q/k/v, up and
gate, row-parallel for the attention output and down projections, embeddings by
vocabulary).

* ``gpt-fused``: a GPT written here as a function of a params dict, with a fused q/k/v
  projection (one matmul to ``3 d``, then ``jnp.split``), as nanoGPT and GPT-2 write it.
* ``hf-gpt2``, ``hf-llama``: Hugging Face ``FlaxGPT2LMHeadModel`` and
  ``FlaxLlamaForCausalLM`` from small configs, random init, called through
  ``model(ids, params=...)`` (GPT-2 fuses q/k/v too; Llama uses grouped-query attention).
* ``hf-bert``: Hugging Face ``FlaxBertForMaskedLM`` (not in :data:`BUILDERS`: ``jscaler
  bench cost`` measures it, ``bench plain`` does not compare it).
* ``gpt-small``: the registered nnx ``gpt-small``.
* ``swin``: the registered nnx Swin Transformer (``swin-tiny``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import optax
from jax.sharding import PartitionSpec as P

COL, ROW = P(None, "tp"), P("tp", None)  # a (d_in, d_out) kernel split by columns / rows


@dataclass(frozen=True)
class BenchModel:
    """One model of the bench.

    Attributes:
        name: The ``--model`` name.
        description: One line for the table's header.
        make: ``() -> model``: what ``jscaler.parallelize`` gets (fresh each call).
        loss: ``loss(model, batch)`` for ``make()``'s model.
        plain: ``() -> (params, loss(params, batch))``: the same initial parameters as a
            pytree and a loss over it, for the plain-JAX steps.
        batch: The global batch every step trains on.
        rules: ``[(regex on the "/"-joined param path, PartitionSpec)]``: Megatron rules.
    """

    name: str
    description: str
    make: Callable[[], Any]
    loss: Callable
    plain: Callable[[], tuple[Any, Callable]]
    batch: Any
    rules: list[tuple[str, P]]


@dataclass(frozen=True)
class Size:
    """The transformers' shape: width, layers, heads, sequence, batch, vocabulary."""

    d: int = 512
    layers: int = 4
    heads: int = 8
    seq: int = 256
    batch: int = 16
    vocab: int = 8192


SMALL = Size(d=64, layers=2, heads=8, seq=32, batch=8, vocab=512)
HF = Size(d=256, seq=128)  # the Hugging Face models' default: quarter the FLOPs per token


def _tokens(size: Size, seed: int = 0):
    return {"ids": jax.random.randint(jax.random.key(seed), (size.batch, size.seq), 0, size.vocab)}


def _next_token(logits, ids):
    return optax.softmax_cross_entropy_with_integer_labels(logits[:, :-1], ids[:, 1:]).mean()


# ---- a GPT with a fused q/k/v projection, in plain JAX ---------------------------------------


def fused_gpt_init(size: Size, seed: int = 0) -> dict:
    """Parameters of :func:`fused_gpt_loss`: embeddings, blocks with one ``(d, 3d)`` q/k/v
    kernel, an untied lm head."""
    d, f = size.d, 4 * size.d
    keys = iter(jax.random.split(jax.random.key(seed), 4 + 4 * size.layers))

    def dense(n_in, n_out):
        w = jax.random.normal(next(keys), (n_in, n_out)) * (n_in**-0.5)
        return {"kernel": w, "bias": jnp.zeros(n_out)}

    def norm():
        return {"scale": jnp.ones(d), "bias": jnp.zeros(d)}

    blocks = [
        {
            "ln1": norm(),
            "qkv": dense(d, 3 * d),
            "out": dense(d, d),
            "ln2": norm(),
            "up": dense(d, f),
            "down": dense(f, d),
        }
        for _ in range(size.layers)
    ]
    return {
        "wte": jax.random.normal(next(keys), (size.vocab, d)) * 0.02,
        "wpe": jax.random.normal(next(keys), (size.seq, d)) * 0.02,
        "blocks": blocks,
        "ln_f": norm(),
        "lm_head": jax.random.normal(next(keys), (d, size.vocab)) * (d**-0.5),
    }


def _layer_norm(p, x):
    mean = x.mean(-1, keepdims=True)
    var = ((x - mean) ** 2).mean(-1, keepdims=True)
    return (x - mean) * jax.lax.rsqrt(var + 1e-5) * p["scale"] + p["bias"]


def _attention(p, x, heads: int):
    b, s, d = x.shape
    qkv = x @ p["qkv"]["kernel"] + p["qkv"]["bias"]
    q, k, v = (t.reshape(b, s, heads, d // heads) for t in jnp.split(qkv, 3, axis=-1))
    scores = jnp.einsum("bqhc,bkhc->bhqk", q, k) / jnp.sqrt(d // heads)
    causal = jnp.tril(jnp.ones((s, s), bool))
    probs = jax.nn.softmax(jnp.where(causal, scores, -1e9), axis=-1)
    out = jnp.einsum("bhqk,bkhc->bqhc", probs, v).reshape(b, s, d)
    return out @ p["out"]["kernel"] + p["out"]["bias"]


def fused_gpt_loss(heads: int):
    """``loss(params, batch)``: next-token cross-entropy of the fused-q/k/v GPT."""

    def loss(params, batch):
        ids = batch["ids"]
        x = params["wte"][ids] + params["wpe"][: ids.shape[1]]
        for p in params["blocks"]:
            x = x + _attention(p, _layer_norm(p["ln1"], x), heads)
            h = jax.nn.gelu(_layer_norm(p["ln2"], x) @ p["up"]["kernel"] + p["up"]["bias"])
            x = x + h @ p["down"]["kernel"] + p["down"]["bias"]
        logits = _layer_norm(params["ln_f"], x) @ params["lm_head"]
        return _next_token(logits, ids)

    return loss


FUSED_GPT_RULES = [
    (r"qkv/kernel$", COL),
    (r"(qkv|up)/bias$", P("tp")),
    (r"up/kernel$", COL),
    (r"(out|down)/kernel$", ROW),
    (r"wte$", ROW),
    (r"lm_head$", COL),
]


def gpt_fused(size: Size) -> BenchModel:
    loss = fused_gpt_loss(size.heads)
    return BenchModel(
        "gpt-fused",
        f"plain-JAX GPT, fused q/k/v: d {size.d}, {size.layers} layers, {size.heads} heads, "
        f"seq {size.seq}, vocab {size.vocab}, batch {size.batch}",
        lambda: fused_gpt_init(size),
        loss,
        lambda: (fused_gpt_init(size), loss),
        _tokens(size),
        FUSED_GPT_RULES,
    )


# ---- Hugging Face Flax models ----------------------------------------------------------------


def _hf(cls, cfg):
    model = cls(cfg, _do_init=False)
    init = jax.jit(model.init_weights, static_argnums=1)
    return model, lambda: init(jax.random.PRNGKey(0), model.input_shape)


def _hf_loss(model):
    def loss(params, batch):
        return _next_token(model(batch["ids"], params=params).logits, batch["ids"])

    return loss


# FlaxConv1D stores its kernel (d_out, d_in): column-parallel splits rows here
HF_GPT2_RULES = [
    (r"attn/c_attn/kernel$", ROW),
    (r"mlp/c_fc/kernel$", ROW),
    (r"(attn/c_attn|mlp/c_fc)/bias$", P("tp")),
    (r"(attn|mlp)/c_proj/kernel$", COL),
    (r"wte/embedding$", ROW),
]


def hf_gpt2(size: Size) -> BenchModel:
    import transformers as hf

    cfg = hf.GPT2Config(
        vocab_size=size.vocab, n_positions=size.seq, n_embd=size.d, n_layer=size.layers,
        n_head=size.heads,
    )  # fmt: skip
    model, init = _hf(hf.FlaxGPT2LMHeadModel, cfg)
    loss = _hf_loss(model)
    return BenchModel(
        "hf-gpt2",
        f"Hugging Face FlaxGPT2LMHeadModel (fused c_attn, tied lm head): d {size.d}, "
        f"{size.layers} layers, {size.heads} heads, seq {size.seq}, vocab {size.vocab}, "
        f"batch {size.batch}",
        init,
        loss,
        lambda: (init(), loss),
        _tokens(size),
        HF_GPT2_RULES,
    )


LLAMA_RULES = [
    (r"self_attn/(q|k|v)_proj/kernel$", COL),
    (r"self_attn/o_proj/kernel$", ROW),
    (r"mlp/(gate|up)_proj/kernel$", COL),
    (r"mlp/down_proj/kernel$", ROW),
    (r"embed_tokens/embedding$", ROW),
    (r"lm_head/kernel$", COL),
]


def hf_llama(size: Size) -> BenchModel:
    import transformers as hf

    cfg = hf.LlamaConfig(
        vocab_size=size.vocab, hidden_size=size.d, intermediate_size=11 * size.d // 4,
        num_hidden_layers=size.layers, num_attention_heads=size.heads,
        num_key_value_heads=size.heads // 2, max_position_embeddings=size.seq,
    )  # fmt: skip
    model, init = _hf(hf.FlaxLlamaForCausalLM, cfg)
    loss = _hf_loss(model)
    return BenchModel(
        "hf-llama",
        f"Hugging Face FlaxLlamaForCausalLM (grouped-query: {size.heads // 2} kv heads): "
        f"d {size.d}, {size.layers} layers, {size.heads} heads, seq {size.seq}, vocab "
        f"{size.vocab}, batch {size.batch}",
        init,
        loss,
        lambda: (init(), loss),
        _tokens(size),
        LLAMA_RULES,
    )


BERT_RULES = [
    (r"attention/self/(query|key|value)/kernel$", COL),
    (r"attention/self/(query|key|value)/bias$", P("tp")),
    (r"attention/output/dense/kernel$", ROW),
    (r"intermediate/dense/kernel$", COL),
    (r"intermediate/dense/bias$", P("tp")),
    (r"layer/\d+/output/dense/kernel$", ROW),
    (r"word_embeddings/embedding$", ROW),
]


def masked_lm_loss(model, vocab: int, every: int = 7):
    """``loss(params, batch)``: BERT's masked-LM objective on a fixed mask: one position
    in ``every`` of each sequence becomes the token ``vocab - 1`` and is predicted."""

    def loss(params, batch):
        ids = batch["ids"]
        masked = jnp.arange(ids.shape[1]) % every == every // 2
        logits = model(jnp.where(masked, vocab - 1, ids), params=params).logits
        ce = optax.softmax_cross_entropy_with_integer_labels(logits, ids)
        return (ce * masked).sum() / (masked.sum() * ids.shape[0])

    return loss


def hf_bert(size: Size) -> BenchModel:
    """Hugging Face ``FlaxBertForMaskedLM`` (bidirectional, post-norm, MLM head tied to
    the word embeddings) from a small config, random init."""
    import transformers as hf

    cfg = hf.BertConfig(
        vocab_size=size.vocab, hidden_size=size.d, num_hidden_layers=size.layers,
        num_attention_heads=size.heads, intermediate_size=4 * size.d,
        max_position_embeddings=size.seq,
    )  # fmt: skip
    model, init = _hf(hf.FlaxBertForMaskedLM, cfg)
    loss = masked_lm_loss(model, size.vocab)
    return BenchModel(
        "hf-bert",
        f"Hugging Face FlaxBertForMaskedLM (masked LM, 1 in 7 tokens): d {size.d}, "
        f"{size.layers} layers, {size.heads} heads, seq {size.seq}, vocab {size.vocab}, "
        f"batch {size.batch}",
        init,
        loss,
        lambda: (init(), loss),
        _tokens(size),
        BERT_RULES,
    )


# ---- registered nnx models -------------------------------------------------------------------


def nnx_plain(make, loss):
    """The Params of an nnx model as a pytree, and the loss over them."""
    from flax import nnx

    def plain():
        graphdef, params, rest = nnx.split(make(), nnx.Param, ...)
        return params, lambda p, batch: loss(nnx.merge(graphdef, p, rest), batch)

    return plain


GPT_RULES = [
    (r"attn/(q|k|v)_proj/kernel$", COL),
    (r"attn/o_proj/kernel$", ROW),
    (r"mlp/(gate|up)_proj/kernel$", COL),
    (r"mlp/down_proj/kernel$", ROW),
    (r"embed/embedding$", ROW),
    (r"lm_head/kernel$", COL),
]


def registered(model: str, name: str, rules, batch_size: int | None = None) -> BenchModel:
    """The registered nnx model ``model`` as bench model ``name`` with Megatron ``rules``
    (``batch_size``: default the registry's)."""
    import models

    spec = models.get(model)
    size = batch_size or spec.batch_size
    make = lambda: spec.init(0)  # noqa: E731
    return BenchModel(
        name,
        f"registered {spec.name} (nnx): {spec.description}, batch {size}",
        make,
        spec.loss,
        nnx_plain(make, spec.loss),
        spec.batch(size, 0),
        rules,
    )


def registered_gpt(small: bool) -> BenchModel:
    return registered("gpt-tiny" if small else "gpt-small", "gpt-small", GPT_RULES)


SWIN_RULES = [
    (r"attn/(q|k|v)_proj/kernel$", COL),
    (r"attn/(q|k|v)_proj/bias$", P("tp")),
    (r"attn/o_proj/kernel$", ROW),
    (r"mlp/fc1/kernel$", COL),
    (r"mlp/fc1/bias$", P("tp")),
    (r"mlp/fc2/kernel$", ROW),
]


def registered_swin(small: bool) -> BenchModel:
    return registered("swin-tiny", "swin", SWIN_RULES, 8 if small else 32)


# the Hugging Face models by name, each taking its Size
HF_MODELS = {"hf-gpt2": hf_gpt2, "hf-llama": hf_llama, "hf-bert": hf_bert}


def _llama(which: str):
    def build(small: bool) -> BenchModel:
        from bench import scan_models

        size = scan_models.SCAN_SMALL if small else scan_models.SCAN_SIZE
        return getattr(scan_models, which)(size)

    return build


BUILDERS = {
    "gpt-fused": lambda small: gpt_fused(SMALL if small else Size()),
    "llama-list": _llama("llama_list"),
    "llama-scan": _llama("llama_scan"),
    "hf-gpt2": lambda small: hf_gpt2(SMALL if small else HF),
    "hf-llama": lambda small: hf_llama(SMALL if small else HF),
    "gpt-small": registered_gpt,
    "swin": registered_swin,
}
