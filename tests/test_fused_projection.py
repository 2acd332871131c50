"""Fused projections cut by heads: one matmul to q, k and v (or an MLP's gate and up)
whose output ``jnp.split`` cuts in parts, as Hugging Face's GPT-2 ``c_attn`` and many JAX
LLMs write it. Under megatron(tp=n) each device computes its own heads of q, of k and of v
(its hidden features of gate and of up) from its columns of the fused weight, and
attention runs on local heads: no activation is gathered.
"""

import functools

import jax
import jax.numpy as jnp
import optax
import pytest

import jscaler
from jscaler.compile.hlo import collectives, summarize
from jscaler.plan.pieces import op_pieces
from spaces import megatron

from parity import assert_matches_reference

STEPS = 3


def fused_gpt(d=32, layers=2, heads=4, seq=16, vocab=64, ffn=64, seed=0):
    """A plain params-pytree GPT whose attention reads q, k, v from one (d, 3d) matmul
    (with bias) and whose MLP reads gate and up from one (d, 2 ffn) matmul (SwiGLU)."""
    keys = iter(jax.random.split(jax.random.key(seed), 8 + 10 * layers))

    def dense(shape):
        return jax.random.normal(next(keys), shape) * shape[0] ** -0.5

    def norm():  # not at zero: updated parameters are compared relative to their size
        return {
            "scale": 1 + 0.1 * jax.random.normal(next(keys), (d,)),
            "bias": 0.1 * jax.random.normal(next(keys), (d,)),
        }

    params = {
        "wte": jax.random.normal(next(keys), (vocab, d)) * 0.5,
        "wpe": jax.random.normal(next(keys), (seq, d)) * 0.5,
        "blocks": [
            {
                "ln1": norm(),
                "qkv": {
                    "kernel": dense((d, 3 * d)),
                    "bias": 0.1 * jax.random.normal(next(keys), (3 * d,)),
                },
                "proj": {"kernel": dense((d, d))},
                "ln2": norm(),
                "gate_up": {"kernel": dense((d, 2 * ffn))},
                "down": {"kernel": dense((ffn, d))},
            }
            for _ in range(layers)
        ],
        "lnf": norm(),
        "head": {"kernel": dense((d, vocab))},
    }

    def layer_norm(p, x):
        mu = x.mean(-1, keepdims=True)
        var = ((x - mu) ** 2).mean(-1, keepdims=True)
        return (x - mu) * jax.lax.rsqrt(var + 1e-5) * p["scale"] + p["bias"]

    def attention(p, x):
        b, s, _ = x.shape
        qkv = x @ p["qkv"]["kernel"] + p["qkv"]["bias"]
        q, k, v = (t.reshape(b, s, heads, d // heads) for t in jnp.split(qkv, 3, axis=-1))
        scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / jnp.sqrt(d // heads)
        causal = jnp.tril(jnp.ones((s, s), bool))
        weights = jax.nn.softmax(jnp.where(causal, scores, -1e9), axis=-1)
        out = jnp.einsum("bhqk,bkhd->bqhd", weights, v).reshape(b, s, d)
        return out @ p["proj"]["kernel"]

    def mlp(p, x):
        gate, up = jnp.split(x @ p["gate_up"]["kernel"], 2, axis=-1)
        return (jax.nn.silu(gate) * up) @ p["down"]["kernel"]

    def loss(params, batch):
        ids = batch["ids"]
        x = params["wte"][ids] + params["wpe"][: ids.shape[1]]
        for p in params["blocks"]:
            x = x + attention(p, layer_norm(p["ln1"], x))
            x = x + mlp(p, layer_norm(p["ln2"], x))
        logits = layer_norm(params["lnf"], x) @ params["head"]["kernel"]
        return optax.softmax_cross_entropy_with_integer_labels(logits[:, :-1], ids[:, 1:]).mean()

    def batch(k, size=8):
        return {"ids": jax.random.randint(jax.random.key(100 + k), (size, seq), 0, vocab)}

    return params, loss, batch


@functools.cache
def tiny():
    return fused_gpt()


@functools.cache
def gpt2():
    from test_external_models import gpt2 as hf_gpt2  # transformers: only where needed

    return hf_gpt2()


MODELS = {"fused-gpt": tiny, "hf-gpt2": gpt2}
# collective bytes per step under megatron(tp=4, dp=2) when the fused output was split by
# columns and gathered (before jscaler.ir.unfuse): 245,394 and 195,568
BYTES_BEFORE = {"fused-gpt": 245_394, "hf-gpt2": 195_568}


def test_the_trace_computes_a_fused_projection_on_its_parts_view():
    params, loss, batch = tiny()
    graph = jscaler.trace(loss, params, batch(0))
    assert not [o for o in graph.ops if o.primitive == "split"]
    views = [o for o in graph.ops if o.primitive == "dot_general" and len(o.outputs) == 1]
    shapes = {graph.tensors[o.outputs[0]].shape for o in views}
    assert (8, 16, 3, 32) in shapes and (8, 16, 2, 64) in shapes  # q|k|v, gate|up
    assert jscaler.check_annotations(graph, params, batch(0)) > 100
    got = jax.jit(graph.as_fn())(params, batch(0))
    assert jnp.array_equal(jax.tree_util.tree_leaves(got)[0], jax.jit(loss)(params, batch(0)))


@pytest.mark.parametrize(
    "plan", [megatron(tp=2), megatron(tp=4, dp=2), megatron(tp=4, dp=2, regions=True)], ids=str
)
@pytest.mark.parametrize("name", MODELS)
def test_megatron_cuts_a_fused_projection_by_heads_like_one_device(name, plan):
    """regions=True: a manual region per attention and MLP; the LM head's vocabulary
    class, cut by the loss's label lookup, stays with XLA (it raised a LayoutError)."""
    params, loss, batch = MODELS[name]()
    assert_matches_reference(params, loss, [batch(k) for k in range(STEPS)], plan)


def _heads_per_device(trainer, op):
    """The extent of the heads axis (axis 2 of q, k: (b, s, h, hd)) each device's piece of
    the attention scores einsum reads."""
    (piece, *_) = op_pieces(trainer.plan, op)
    return piece.inputs[0].shape[2]


@pytest.mark.parametrize("name", MODELS)
def test_attention_runs_on_local_heads_and_no_fused_activation_is_gathered(name):
    params, loss, batch = MODELS[name]()
    b = batch(0)
    trainer = jscaler.parallelize(
        params, loss, optax.sgd(0.1), b, devices=8, plan=megatron(tp=4, dp=2)
    )
    graph = trainer.plan.graph
    # the scores einsum: q and k, (b, s, h, hd) each, contracted over hd
    scores = [
        o
        for o in graph.ops
        if o.primitive == "dot_general"
        and all(graph.tensors[t].role == "value" for t in o.tensor_inputs)
        and len(graph.tensors[o.tensor_inputs[0]].shape) == 4
    ]
    assert scores and all(_heads_per_device(trainer, o) == 1 for o in scores)  # 4 heads / 4

    # each device reads its heads' columns of q, k and v from the fused kernel's view
    def parts_of(t):  # the slices taking a fused output's parts (after the bias add)
        users = graph.consumers(t)
        return (
            users
            and all(u.primitive == "slice" for u in users)
            or any(u.primitive == "add" and parts_of(u.outputs[0]) for u in users)
        )

    fused = [  # (b, s, parts, features) = x @ the kernel's (d, parts, features) view
        o
        for o in graph.ops
        if o.primitive == "dot_general"
        and len(graph.tensors[o.outputs[0]].shape) == 4
        and parts_of(o.outputs[0])
    ]
    assert len(fused) == {"fused-gpt": 4, "hf-gpt2": 2}[name]
    for o in fused:
        (piece, *_) = op_pieces(trainer.plan, o)
        parts, features = graph.tensors[o.outputs[0]].shape[2:]
        assert piece.outputs[0].shape[2:] == (parts, features // 4)
    # no collective over tp moves the fused (b, s, 3d) output, nor (b, s, 2 ffn)
    rows = b["ids"].shape[0] // 2 * b["ids"].shape[1]  # per dp replica
    colls = collectives(trainer.hlo(b), trainer.plan.mesh.axes)
    moved = {c.bytes for c in colls if c.axes == ("tp",)}
    assert not moved & {rows * 3 * 32 * 4, rows * 2 * 64 * 4}, summarize(colls)
    assert sum(c.bytes for c in colls) < BYTES_BEFORE[name], summarize(colls)


def test_megatron_warns_when_the_heads_do_not_split_tp_ways():
    """It replicated the attention silently (4 heads under tp=8)."""
    import warnings

    params, loss, batch = tiny()  # 4 heads
    with pytest.warns(UserWarning, match=r"megatron\(tp=8\): .* 4 heads, which 8 does not"):
        megatron(tp=8)(jscaler.trace(loss, params, batch(0)), 8)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        megatron(tp=4, dp=2)(jscaler.trace(loss, params, batch(0)), 8)
