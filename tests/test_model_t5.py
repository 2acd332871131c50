"""T5 (models/t5.py): its graph, parameter count, properties, and parity under plans.

The parity cases train 3 SGD steps on 8 simulated devices and compare loss, gradients
and parameters with single-device training (fp32 tolerances of jscaler.runtime.reference).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jscaler
import models
from models import t5
from schedules import one_f_one_b
from spaces import dp, megatron, zero

from parity import assert_parity

NAME = "t5-tiny"


@functools.cache
def tiny_model() -> t5.T5:
    return t5.T5(t5.tiny(), rngs=nnx.Rngs(0))


@functools.cache
def tiny_graph() -> jscaler.Graph:
    return jscaler.trace(t5.loss, tiny_model(), t5.synthetic_batch(t5.tiny(), 8, 0))


@functools.cache
def logits_fn():
    return nnx.jit(lambda m, x, y: m(x, y))


# ---- the traced graph ------------------------------------------------------------------


def test_every_op_is_annotated():
    graph = tiny_graph()
    assert graph.coverage() == jscaler.Coverage(ops=1.0, flops=1.0), sorted(
        {o.primitive for o in graph.unannotated()}
    )


def test_layers_are_the_encoder_then_the_decoder_blocks():
    layers = tiny_graph().layers()
    assert [layer.name for layer in layers] == [
        "encoder/blocks/0",
        "encoder/blocks/1",
        "decoder/blocks/0",
        "decoder/blocks/1",
    ]
    assert len({len(layer.graph) for layer in layers[:2]}) == 1  # repeated: same op count
    assert len({len(layer.graph) for layer in layers[2:]}) == 1


def test_both_embedding_lookups_come_before_the_first_layer():
    graph = tiny_graph()
    first_layer = min(o.id for o in graph.layers()[0].graph.ops)
    (table,) = (t for t in graph.inputs if graph.tensors[t].name == "embed/embedding")
    lookups = [o for o in graph.consumers(table) if o.primitive == "gather"]
    assert len(lookups) == 2 and all(o.id < first_layer for o in lookups)
    # the tied LM head reads the same table (transposed), after the last layer
    last_layer = max(o.id for o in graph.layers()[-1].graph.ops)
    (head,) = (o for o in graph.consumers(table) if o.primitive != "gather")
    assert head.id > last_layer
    assert [u.primitive for u in graph.consumers(head.outputs[0])] == ["dot_general"]


# ---- sizes -----------------------------------------------------------------------------


def test_num_params_counts_the_tiny_model():
    leaves = jax.tree.leaves(nnx.state(tiny_model(), nnx.Param))
    assert t5.num_params(t5.tiny()) == sum(int(np.prod(x.shape)) for x in leaves) == 74368


def test_paper_configs_sizes():
    cfgs = [t5.paper_4gpu(), t5.paper_8gpu(), t5.paper_16gpu(), t5.paper_32gpu()]
    shapes = [
        (c.n_encoder_layers, c.n_decoder_layers, c.d_model, c.n_heads, c.vocab_size) for c in cfgs
    ]
    assert shapes == [
        (24, 24, 2048, 32, 512 * 1024),
        (32, 32, 3072, 48, 1024 * 1024),
        (32, 32, 4096, 64, 1536 * 1024),
        (32, 32, 6144, 96, 2048 * 1024),
    ]
    assert all(c.d_ff == 4 * c.d_model and c.inner_dim == c.d_model for c in cfgs)
    assert all(c.encoder_len == c.decoder_len == 1024 for c in cfgs)
    assert 3.85e9 < t5.num_params(cfgs[0]) < 3.95e9
    counts = [t5.num_params(c) for c in cfgs]
    assert counts == sorted(counts)


def test_config_validation():
    with pytest.raises(ValueError, match="d_model"):
        t5.tiny().replace(d_model=0)
    with pytest.raises(ValueError, match="num_buckets"):
        t5.tiny().replace(num_buckets=30)
    with pytest.raises(ValueError, match="max_distance"):
        t5.tiny().replace(max_distance=8)


# ---- properties ------------------------------------------------------------------------


def test_relative_position_buckets_match_hand_computed_values():
    # key - query distances; bidirectional: 16 buckets a side, 8 exact, log up to 128
    rel = jnp.array([0, -1, -3, 3, -8, -12, 12, -20, -40, -100, -1000, 1000])
    want = [0, 1, 3, 19, 8, 9, 25, 10, 12, 15, 15, 31]
    got = t5.relative_position_bucket(rel, bidirectional=True)
    assert got.tolist() == want
    # causal: 32 buckets for the past, 16 exact; the future is bucket 0
    rel = jnp.array([5, 1, 0, -1, -5, -15, -16, -24, -40, -64 - 8, -127, -500])
    want = [0, 0, 0, 1, 5, 15, 16, 19, 23, 27, 31, 31]
    got = t5.relative_position_bucket(rel, bidirectional=False)
    assert got.tolist() == want
    assert got.dtype == jnp.int32


def test_the_decoder_is_causal_and_the_encoder_is_not():
    model, fn = tiny_model(), logits_fn()
    b = t5.synthetic_batch(t5.tiny(), 2, 0)
    x, y = b["inputs"], b["decoder_inputs"]
    base = np.asarray(fn(model, x, y))
    j = 9
    changed = np.asarray(fn(model, x, y.at[:, j].set((y[:, j] + 7) % 512)))
    np.testing.assert_array_equal(changed[:, :j], base[:, :j])
    assert not np.allclose(changed[:, j:], base[:, j:])
    # the last encoder position reaches the first decoder position
    enc_changed = np.asarray(fn(model, x.at[:, -1].set((x[:, -1] + 7) % 512), y))
    assert not np.allclose(enc_changed[:, 0], base[:, 0])


def test_each_stack_has_one_bias_table_and_the_head_is_tied():
    state = nnx.state(tiny_model(), nnx.Param)
    names = {"/".join(str(k) for k in path) for path, _ in nnx.to_flat_state(state)}
    assert {n for n in names if "relative_attention_bias" in n} == {
        "encoder/relative_attention_bias/embedding",
        "decoder/relative_attention_bias/embedding",
    }
    assert {n for n in names if n.startswith("embed")} == {"embed/embedding"}
    assert not any("head" in n for n in names)
    # logits are the scaled decoder output against the same table
    model, b = tiny_model(), t5.synthetic_batch(t5.tiny(), 2, 0)
    logits = logits_fn()(model, b["inputs"], b["decoder_inputs"])
    assert logits.shape == (2, 16, 512)
    table = model.embed.embedding[...]
    out = nnx.jit(lambda m, x, y: m.decoder(m.embed(y), m.encoder(m.embed(x))))(
        model, b["inputs"], b["decoder_inputs"]
    )
    np.testing.assert_allclose(logits, out * 32**-0.5 @ table.T, rtol=1e-5, atol=1e-5)


def test_synthetic_batch_reverses_the_inputs_and_is_deterministic():
    cfg = t5.tiny()
    a, again, other = (t5.synthetic_batch(cfg, 4, s) for s in (3, 3, 4))
    assert {k: (v.shape, v.dtype) for k, v in a.items()} == {
        "inputs": ((4, 16), jnp.int32),
        "decoder_inputs": ((4, 16), jnp.int32),
        "targets": ((4, 16), jnp.int32),
    }
    for k in a:
        np.testing.assert_array_equal(a[k], again[k])
    assert not np.array_equal(a["inputs"], other["inputs"])
    np.testing.assert_array_equal(a["targets"], a["inputs"][:, ::-1])
    np.testing.assert_array_equal(a["decoder_inputs"][:, 1:], a["targets"][:, :-1])
    assert (a["decoder_inputs"][:, 0] == 0).all()


def test_registry_entry_builds_the_tiny_model():
    spec = models.get(NAME)
    model, batch = spec.init(0), spec.batch(spec.batch_size, 0)
    assert isinstance(model, t5.T5) and model.cfg == t5.tiny()
    value = nnx.jit(spec.loss)(model, batch)
    assert np.isfinite(float(value)) and abs(float(value) - np.log(512)) < 1.5


# ---- parity with one device ------------------------------------------------------------


@pytest.mark.parametrize(
    "plan",
    [dp(), megatron(tp=2, dp=4), megatron(tp=8), zero(stage=3)],
    ids=["dp", "megatron(tp=2,dp=4)", "megatron(tp=8)", "zero(stage=3)"],
)
def test_plan_matches_one_device(plan):
    assert_parity(NAME, plan)


def assert_pipeline_parity(model_name, plan, schedule, m):
    return assert_parity(model_name, plan, microbatches=m, schedule=schedule)


def test_one_f_one_b_pipeline_matches_one_device():
    trainer = assert_pipeline_parity(NAME, megatron(pp=2), one_f_one_b, 2)
    names = [{trainer.graph.tensors[t].name for t in st.params} for st in trainer.program.stages]
    # the encoder on the first stage, the decoder on the second; the tied table on both
    assert any(n.startswith("encoder/blocks/") for n in names[0])
    assert not any(n.startswith("decoder/blocks/") for n in names[0])
    assert any(n.startswith("decoder/blocks/") for n in names[1])
    assert not any(n.startswith("encoder/blocks/") for n in names[1])
    assert all("embed/embedding" in n for n in names)


def test_interlaced_pipeline_matches_one_device():
    from schedules import interlaced_head
    from spaces import interlaced

    trainer = assert_pipeline_parity(NAME, interlaced(pp=2, tp=2), interlaced_head, 2)
    embed, first, last, head = trainer.program.stages
    assert len(embed.low.mesh.devices.flat) == 8 and embed.group == 2
    assert head.group == 2 and any("lm_head" in o.path or o.path == "" for o in head.ops)
    names = {trainer.graph.tensors[t].name for t in embed.params}
    assert "embed/embedding" in names
    assert not any("/blocks/" in n for n in names)
    table = next(t for t in embed.params if trainer.graph.tensors[t].name == "embed/embedding")
    assert embed.sharding(table).spec[0] == "tp"  # vocabulary split 8 ways
    assert {d.id for d in first.low.mesh.devices.flat} == {0, 1, 2, 3}
    assert {d.id for d in last.low.mesh.devices.flat} == {4, 5, 6, 7}
    assert [tuple(g) for g in trainer.program.log.blocks] == [
        tuple(g) for g in trainer.program.schedule.groups
    ]
