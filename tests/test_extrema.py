"""The vocabulary stays split through the loss: softmax cross-entropy's max in two levels
(jscaler.ir.extrema) and its label lookup as a partial sum (a gather with batch dims), so
megatron never gathers the logits, as Megatron-LM's vocabulary-parallel cross-entropy."""

import functools

import jax
import jax.numpy as jnp
import optax
import pytest
from test_fused_projection import fused_gpt

import jscaler
from jscaler.compile.hlo import collectives, summarize
from jscaler.ir.extrema import MIN_LENGTH
from spaces import megatron

from parity import assert_matches_reference

VOCAB = 1024
SEQ = 16


@functools.cache
def model():
    return fused_gpt(seq=SEQ, vocab=VOCAB)


def _maxes(graph):
    return [o for o in graph.ops if o.primitive == "reduce_max"]


def test_the_loss_max_over_the_vocabulary_is_taken_over_block_maxima():
    params, loss, batch = model()
    graph = jscaler.trace(loss, params, batch(0))
    shapes = {graph.tensors[o.inputs[0]].shape for o in _maxes(graph)}
    # (b, s-1, 64 blocks, 16) -> (b, s-1, 64) -> (b, s-1); attention's max over 16 keys stays
    assert (8, SEQ - 1, 64, VOCAB // 64) in shapes and (8, SEQ - 1, 64) in shapes
    assert (8, SEQ - 1, VOCAB) not in shapes
    assert (8, 4, SEQ, SEQ) in shapes
    assert jscaler.check_annotations(graph, params, batch(0)) > 100
    got = jax.jit(graph.as_fn())(params, batch(0))
    assert jnp.array_equal(jax.tree_util.tree_leaves(got)[0], jax.jit(loss)(params, batch(0)))


def test_a_max_that_takes_a_gradient_stays_one_reduction():
    """The derivative of a max shares the cotangent among ties; two levels would share it
    differently, so only a max that reaches stop_gradient is rewritten."""
    x = jnp.zeros((4, 2 * MIN_LENGTH))  # all tied

    def loss(params, batch):
        return jnp.max(batch["x"] * params["w"], axis=-1).sum()

    graph = jscaler.trace(loss, {"w": jnp.ones(())}, {"x": x})
    assert [graph.tensors[o.inputs[0]].shape for o in _maxes(graph)] == [(4, 2 * MIN_LENGTH)]


@pytest.mark.parametrize("plan", [megatron(tp=8), megatron(tp=4, dp=2)], ids=str)
def test_megatron_keeps_the_logits_split_and_matches_one_device(plan):
    params, loss, batch = model()
    trainer = assert_matches_reference(params, loss, [batch(k) for k in range(3)], plan)
    b = batch(0)
    tp = trainer.plan.mesh.shape["tp"]
    rows = b["ids"].shape[0] // (8 // tp) * (SEQ - 1)
    logits = rows * VOCAB * 4  # fp32 (b, s-1, vocab) of one data-parallel replica
    colls = collectives(trainer.hlo(b), trainer.plan.mesh.axes)
    big = [c for c in colls if c.kind == "all-gather" and c.bytes >= logits // tp]
    assert not big, summarize(colls)
    table = trainer.comm_table()
    predicted = [r for r in table.rows if r.collective == "all-gather" and r.bytes >= logits // tp]
    assert not predicted, table


def test_a_vocabulary_of_512_is_taken_in_two_levels():
    """The small Hugging Face configs' vocabulary: one reduction over it made Megatron
    all-gather the logits (docs/cost-model.md, Llama's Megatron rows)."""
    vocab = 512

    def loss(params, batch):
        logits = batch["x"] @ params["w"]
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()

    params = {"w": jnp.ones((8, vocab)) / vocab}
    batch = {"x": jnp.ones((4, 3, 8)), "y": jnp.zeros((4, 3), jnp.int32)}
    graph = jscaler.trace(loss, params, batch)
    shapes = {graph.tensors[o.inputs[0]].shape for o in _maxes(graph)}
    assert shapes == {(4, 3, 64, vocab // 64), (4, 3, 64)}, shapes
