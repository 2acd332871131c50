"""Flax models nobody here wrote train under jscaler as on one device: Hugging Face
``transformers`` GPT-2, BERT, ViT, Llama and ResNet (linen; random init from tiny configs,
no downloads), called through their own ``model(inputs, params=...)``.

``transformers`` is a dev dependency, pinned ``<5`` (v5 dropped its Flax models).
"""

import functools

import jax
import jax.numpy as jnp
import optax
import pytest
import transformers as hf

import jscaler
from jscaler.compile.hlo import collectives, summarize
from spaces import megatron, zero

from parity import assert_matches_reference

STEPS = 3
B, S, VOCAB = 8, 16, 128


def _init(cls, cfg, **kw):
    """A Hugging Face Flax model and its randomly initialised params (jitted: the
    constructor's own init runs op by op)."""
    model = cls(cfg, _do_init=False, **kw)
    params = jax.jit(model.init_weights, static_argnums=1)(jax.random.PRNGKey(0), model.input_shape)
    return model, params


def _ids(k):
    return jax.random.randint(jax.random.key(k), (B, S), 0, VOCAB)


def _images(k):
    key = jax.random.key(k)
    return {  # NCHW, as the Hugging Face vision models take them
        "images": jax.random.normal(key, (B, 3, 16, 16)),
        "labels": jax.random.randint(jax.random.fold_in(key, 1), (B,), 0, 10),
    }


def _causal_lm(model):
    def loss(params, batch):  # next-token prediction
        logits = model(batch["ids"], params=params).logits
        return optax.softmax_cross_entropy_with_integer_labels(
            logits[:, :-1], batch["ids"][:, 1:]
        ).mean()

    return loss


@functools.cache
def gpt2():
    cfg = hf.GPT2Config(vocab_size=VOCAB, n_positions=S, n_embd=32, n_layer=2, n_head=4)
    model, params = _init(hf.FlaxGPT2LMHeadModel, cfg)
    return params, _causal_lm(model), lambda k: {"ids": _ids(k)}


@functools.cache
def llama(vocab=VOCAB):
    cfg = hf.LlamaConfig(
        vocab_size=vocab,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,  # grouped-query attention
        max_position_embeddings=S,
    )
    model, params = _init(hf.FlaxLlamaForCausalLM, cfg)
    return params, _causal_lm(model), lambda k: {"ids": _ids(k)}


@functools.cache
def bert():
    cfg = hf.BertConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=64,
        max_position_embeddings=S,
    )
    model, params = _init(hf.FlaxBertForMaskedLM, cfg)

    def loss(params, batch):  # masked-LM logits at every position
        logits = model(batch["ids"], params=params).logits
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch["labels"]).mean()

    return params, loss, lambda k: {"ids": _ids(k), "labels": _ids(k + 100)}


@functools.cache
def vit():
    cfg = hf.ViTConfig(
        image_size=16,
        patch_size=4,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=64,
        num_labels=10,
    )
    model, params = _init(hf.FlaxViTForImageClassification, cfg)

    def loss(params, batch):
        logits = model(batch["images"], params=params).logits
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch["labels"]).mean()

    return params, loss, _images


@functools.cache
def resnet():
    """BatchNorm: variables {"params", "batch_stats"}; with train=True the model returns
    (outputs, {"batch_stats": ...}), so it trains with has_aux=True."""
    cfg = hf.ResNetConfig(
        embedding_size=8, hidden_sizes=[8, 16], depths=[1, 1], layer_type="basic", num_labels=10
    )
    model, variables = _init(hf.FlaxResNetForImageClassification, cfg, input_shape=(1, 16, 16, 3))

    def loss(variables, batch):
        out, new = model(batch["images"], params=variables, train=True)
        xent = optax.softmax_cross_entropy_with_integer_labels(out.logits, batch["labels"])
        return xent.mean(), new

    return variables, loss, _images


PARAMS_MODELS = {"gpt2": gpt2, "llama": llama, "bert": bert, "vit": vit}
# weights megatron(tp=2) splits, by path: attention projections (heads), MLP hidden
# features, the vocabulary. GPT-2 fuses q, k and v in one matmul whose output is cut in
# three (a `split` op): each tp device computes its heads of q, k and v from the (d, 3, d)
# view of the replicated c_attn kernel (tests/test_fused_projection.py)
TP_SPLIT = {
    "gpt2": ["h/0/attn/c_proj/kernel", "h/0/mlp/c_fc/kernel", "h/0/mlp/c_proj/kernel", "wte"],
    "llama": ["0/self_attn/k_proj/", "0/self_attn/o_proj/", "0/mlp/up_proj/", "lm_head"],
    "bert": ["0/attention/self/query/kernel", "0/output/dense/kernel", "word_embeddings"],
    "vit": ["0/attention/attention/key/kernel", "0/intermediate/dense/kernel", "classifier"],
}


@pytest.mark.parametrize("name", [*PARAMS_MODELS, "resnet"])
def test_traces_with_every_op_annotated_and_checked(name):
    model = {**PARAMS_MODELS, "resnet": resnet}[name]
    params, loss, batch = model()
    has_aux = name == "resnet"
    graph = jscaler.trace(loss, params, batch(0), has_aux=has_aux)
    assert graph.coverage().ops == 1.0
    assert jscaler.check_annotations(graph, params, batch(0)) > 100  # rules hold on values
    replayed = jax.jit(graph.as_fn())(params, batch(0))  # the graph's ops, one by one
    want = jax.jit(loss)(params, batch(0))
    for x, y in zip(jax.tree_util.tree_leaves(replayed), jax.tree_util.tree_leaves(want)):
        assert jnp.allclose(x, y, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("name", PARAMS_MODELS)
def test_data_parallel_matches_one_device(name):
    params, loss, batch = PARAMS_MODELS[name]()
    assert_matches_reference(params, loss, [batch(k) for k in range(STEPS)], "dp")


@pytest.mark.parametrize("name", PARAMS_MODELS)
def test_megatron_matches_one_device_and_splits_the_layers(name):
    params, loss, batch = PARAMS_MODELS[name]()
    trainer = assert_matches_reference(
        params, loss, [batch(k) for k in range(STEPS)], megatron(tp=2, dp=4)
    )
    split = [
        jax.tree_util.keystr(path, simple=True, separator="/")
        for path, s in jax.tree_util.tree_flatten_with_path(trainer.shardings())[0]
        if "tp" in jax.tree_util.tree_leaves(tuple(s.spec))
    ]
    for want in TP_SPLIT[name]:
        assert any(want in p for p in split), f"{want} not split over tp; split: {split}"


@pytest.mark.slow
def test_megatron_keeps_a_vocabulary_of_512_split_through_the_loss():
    """At 512 the loss's max over the vocabulary is taken in two levels
    (jscaler.ir.extrema): no all-gather of the logits over tp, and the same training."""
    vocab = 512
    params, loss, batch = llama(vocab)
    plan = megatron(tp=4, dp=2, zero=3)
    trainer = assert_matches_reference(params, loss, [batch(k) for k in range(STEPS)], plan)
    logits = B // 2 * (S - 1) * vocab * 4  # f32 (b, s - 1, vocab) of one dp replica
    colls = collectives(trainer.hlo(batch(0)), trainer.plan.mesh.axes)
    big = [c for c in colls if c.kind == "all-gather" and "tp" in c.axes and c.bytes >= logits // 4]
    assert not big, summarize(colls)


@pytest.mark.parametrize(
    "plan", ["dp", zero(stage=3), megatron(tp=2, dp=4)], ids=["dp", "zero3", "megatron"]
)
def test_resnet_batch_stats_match_one_device(plan):
    variables, loss, batch = resnet()
    batches = [batch(k) for k in range(STEPS)]
    trainer = assert_matches_reference(variables, loss, batches, plan, has_aux=True)
    assert set(trainer.variables) == {"params", "batch_stats"}
