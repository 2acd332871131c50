"""Models nobody on this project wrote, built from other libraries' own layers: tiny
configs, random init with fixed seeds, float32, no dropout (so each loss is deterministic).

Each factory takes no arguments and returns ``(model_or_params, loss, batch)``:
``loss(model_or_params, batch)`` is a float32 scalar, ``batch`` a dict of arrays with 8
rows (one per simulated device). They exist to check that jscaler traces, annotates and
parallelises code written against other libraries' conventions, and the primitives those
libraries emit that our own models do not:

- :func:`tunix_qwen3`: Qwen3 dense decoder from ``google-tunix`` (``tunix.models.qwen3``,
  an nnx Module): grouped-query attention, q/k RMS norms, rotary embeddings.
- :func:`tunix_gemma4_moe`: Gemma 4 from ``google-tunix`` (``tunix.models.gemma4``, nnx)
  with its ``MoERagged`` layer: top-k routing (``approx_top_k``), tokens sorted by expert
  and the experts' matmuls as ``jax.lax.ragged_dot`` (``ragged_dot_general``), local
  sliding-window and global attention layers.
- :func:`hf_gptj`: Hugging Face ``transformers`` (<5) ``FlaxGPTJForCausalLM`` (a linen
  params pytree; the loss closes over the model): its rotary embedding interleaves sin and
  cos with ``jnp.stack`` (the ``stack`` primitive).
- :func:`haiku_lm`: a 2-block decoder made of ``dm-haiku`` layers (``hk.Embed``,
  ``hk.MultiHeadAttention``, ``hk.nets.MLP``, ``hk.LayerNorm``) under ``hk.transform`` (a
  params pytree). Its batch stores (token, next token) pairs that the loss unpacks with
  ``inputs, targets = ...``: JAX lowers that to the ``unstack`` primitive.
- :func:`equinox_lm`: a 2-block decoder made of ``equinox`` layers (``eqx.nn.Embedding``,
  ``eqx.nn.MultiheadAttention``, ``eqx.nn.MLP``, ``eqx.nn.LayerNorm``, ``eqx.nn.Linear``),
  written per example and ``jax.vmap``-ed over the batch; the params are the Module's
  float arrays (``eqx.partition(model, eqx.is_inexact_array)``), and the loss recombines
  them with the static rest.

    pip install google-tunix==0.1.7 dm-haiku==0.0.17 equinox==0.13.8 "transformers<5"
    python examples/third_party_models.py

Imports are inside the factories, so importing this file is quick and needs none of them.
"""

B, S, VOCAB = 8, 16, 128  # rows, sequence length, vocabulary
D, HEADS, LAYERS = 32, 4, 2  # width, attention heads, blocks


def _tokens(seed: int = 1):
    import jax

    return jax.random.randint(jax.random.key(seed), (B, S), 0, VOCAB)


def _next_token_xent(logits, ids):
    """Mean cross-entropy of predicting ``ids[:, t + 1]`` from position ``t``."""
    import optax

    return optax.softmax_cross_entropy_with_integer_labels(logits[:, :-1], ids[:, 1:]).mean()


def _causal_call(model, ids):
    """Calls a tunix decoder on full sequences: positions 0..S-1, a causal mask, no cache."""
    import jax.numpy as jnp

    b, s = ids.shape
    positions = jnp.broadcast_to(jnp.arange(s), (b, s))
    mask = jnp.broadcast_to(jnp.tril(jnp.ones((s, s), bool)), (b, s, s))
    logits, _ = model(ids, positions, None, mask)  # (logits, cache)
    return logits


def tunix_qwen3():
    """Tunix Qwen3 (dense), an nnx Module; next-token cross-entropy."""
    from flax import nnx
    from tunix.models.qwen3 import model as qwen3

    cfg = qwen3.ModelConfig(
        num_layers=LAYERS,
        vocab_size=VOCAB,
        embed_dim=D,
        hidden_dim=2 * D,
        num_heads=HEADS,
        head_dim=D // HEADS,
        num_kv_heads=2,  # grouped-query attention
        rope_theta=10_000,
        norm_eps=1e-6,
        use_tied_embedding=False,
    )
    model = qwen3.Qwen3(cfg, rngs=nnx.Rngs(0))

    def loss(model, batch):
        return _next_token_xent(_causal_call(model, batch["ids"]), batch["ids"])

    return model, loss, {"ids": _tokens()}


def tunix_gemma4_moe():
    """Tunix Gemma 4 with mixture-of-experts layers (``MoERagged``: top-2 of 4 experts,
    ``ragged_dot`` expert matmuls) beside its dense MLP, an nnx Module; next-token
    cross-entropy."""
    from flax import nnx
    from tunix.models.gemma4 import model as gemma4

    cfg = gemma4.ModelConfig(
        num_layers=LAYERS,
        num_embed=VOCAB,
        embed_dim=D,
        hidden_dim=2 * D,
        num_heads=HEADS,
        head_dim=D // HEADS,
        num_kv_heads=2,
        sliding_window_size=8,
        attention_pattern=(gemma4.AttentionType.LOCAL_SLIDING, gemma4.AttentionType.GLOBAL),
        global_key_size=D // HEADS,
        enable_moe=True,
        num_experts=4,
        num_experts_per_tok=2,
        expert_dim=16,
        moe_dense_hidden_dim=2 * D,
    )
    model = gemma4.Gemma4(cfg, rngs=nnx.Rngs(0))

    def loss(model, batch):
        return _next_token_xent(_causal_call(model, batch["ids"]), batch["ids"])

    return model, loss, {"ids": _tokens()}


def hf_gptj():
    """Hugging Face ``FlaxGPTJForCausalLM`` (linen): a params pytree, the loss calls
    ``model(ids, params=params)`` (``train=False``: no dropout)."""
    import jax
    import transformers

    transformers.logging.set_verbosity_error()  # 4.5x warns its Flax classes are deprecated
    cfg = transformers.GPTJConfig(
        vocab_size=VOCAB, n_embd=D, n_layer=LAYERS, n_head=HEADS, n_positions=S, rotary_dim=4
    )
    model = transformers.FlaxGPTJForCausalLM(cfg, _do_init=False)
    # the jitted init: the constructor's own init runs op by op
    params = jax.jit(model.init_weights, static_argnums=1)(jax.random.PRNGKey(0), (1, S))

    def loss(params, batch):
        logits = model(batch["ids"], params=params, train=False).logits
        return _next_token_xent(logits, batch["ids"])

    return params, loss, {"ids": _tokens()}


def haiku_lm():
    """A pre-norm decoder from Haiku layers under ``hk.transform`` (no dropout, so
    ``apply`` takes no RNG); a params pytree. The batch holds (token, next token) pairs,
    ``pairs[b, t] = (x_t, x_{t+1})``."""
    import haiku as hk
    import jax
    import jax.numpy as jnp
    import optax

    def decoder(ids):
        x = hk.Embed(VOCAB, D, name="embed")(ids)
        pos = hk.get_parameter("pos", [S, D], init=hk.initializers.TruncatedNormal(0.02))
        x = x + pos[: ids.shape[1]]
        mask = jnp.tril(jnp.ones((ids.shape[1], ids.shape[1]), bool))[None, None]
        for i in range(LAYERS):
            with hk.name_scope(f"block_{i}"):
                h = hk.LayerNorm(-1, create_scale=True, create_offset=True, name="ln1")(x)
                attn = hk.MultiHeadAttention(
                    HEADS, D // HEADS, w_init=hk.initializers.VarianceScaling(1.0), name="attn"
                )
                x = x + attn(h, h, h, mask=mask)
                h = hk.LayerNorm(-1, create_scale=True, create_offset=True, name="ln2")(x)
                x = x + hk.nets.MLP([4 * D, D], activation=jax.nn.gelu, name="mlp")(h)
        x = hk.LayerNorm(-1, create_scale=True, create_offset=True, name="ln_f")(x)
        return hk.Linear(VOCAB, name="head")(x)

    net = hk.transform(decoder)
    params = net.init(jax.random.PRNGKey(0), jnp.zeros((B, S), jnp.int32))

    def loss(params, batch):
        inputs, targets = jnp.moveaxis(batch["pairs"], -1, 0)  # [B, S, 2] -> two [B, S]
        logits = net.apply(params, None, inputs)
        return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()

    ids = jax.random.randint(jax.random.key(1), (B, S + 1), 0, VOCAB)
    pairs = jnp.stack([ids[:, :-1], ids[:, 1:]], axis=-1)
    return params, loss, {"pairs": pairs}


def equinox_lm():
    """A pre-norm decoder from Equinox layers, written for one sequence and vmapped over
    the batch; the params are the Module's float arrays (``eqx.partition``)."""
    import equinox as eqx
    import jax
    import jax.numpy as jnp

    class Block(eqx.Module):
        ln1: eqx.nn.LayerNorm
        attn: eqx.nn.MultiheadAttention
        ln2: eqx.nn.LayerNorm
        mlp: eqx.nn.MLP

        def __init__(self, key):
            k1, k2 = jax.random.split(key)
            self.ln1 = eqx.nn.LayerNorm(D)
            self.attn = eqx.nn.MultiheadAttention(HEADS, D, key=k1)
            self.ln2 = eqx.nn.LayerNorm(D)
            self.mlp = eqx.nn.MLP(D, D, 4 * D, 1, activation=jax.nn.gelu, key=k2)

        def __call__(self, x, mask):  # x: [S, D]
            h = jax.vmap(self.ln1)(x)
            x = x + self.attn(h, h, h, mask=mask, inference=True)
            return x + jax.vmap(self.mlp)(jax.vmap(self.ln2)(x))

    class Decoder(eqx.Module):
        embed: eqx.nn.Embedding
        pos: jax.Array
        blocks: list
        ln_f: eqx.nn.LayerNorm
        head: eqx.nn.Linear

        def __init__(self, key):
            keys = jax.random.split(key, LAYERS + 3)
            self.embed = eqx.nn.Embedding(VOCAB, D, key=keys[0])
            self.pos = 0.02 * jax.random.normal(keys[1], (S, D))
            self.blocks = [Block(k) for k in keys[2:-1]]
            self.ln_f = eqx.nn.LayerNorm(D)
            self.head = eqx.nn.Linear(D, VOCAB, key=keys[-1])

        def __call__(self, ids):  # ids: [S] -> logits [S, VOCAB]
            x = jax.vmap(self.embed)(ids) + self.pos[: ids.shape[0]]
            mask = jnp.tril(jnp.ones((ids.shape[0], ids.shape[0]), bool))
            for block in self.blocks:
                x = block(x, mask)
            return jax.vmap(self.head)(jax.vmap(self.ln_f)(x))

    params, static = eqx.partition(Decoder(jax.random.key(0)), eqx.is_inexact_array)

    def loss(params, batch):
        model = eqx.combine(params, static)
        return _next_token_xent(jax.vmap(model)(batch["ids"]), batch["ids"])

    return params, loss, {"ids": _tokens()}


FACTORIES = {
    "tunix_qwen3": tunix_qwen3,
    "tunix_gemma4_moe": tunix_gemma4_moe,
    "hf_gptj": hf_gptj,
    "haiku_lm": haiku_lm,
    "equinox_lm": equinox_lm,
}


if __name__ == "__main__":
    from jscaler.setup import use_cpu_devices

    use_cpu_devices(8)
    import jscaler

    for name, factory in FACTORIES.items():
        model, loss, batch = factory()
        graph = jscaler.trace(loss, model, batch)
        print(f"{name}: loss {float(loss(model, batch)):.4f}, {len(graph.ops)} ops traced")
