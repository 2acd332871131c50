"""Repeated layers of a function of a params pytree (no module paths on its ops): found
from the parameters' names (``blocks/3/qkv/kernel``), so ZeRO-3 reshards each layer after
its forward, as it does for Flax modules."""

import functools
import sys

import optax
import pytest
from test_fused_projection import fused_gpt

import jscaler
from spaces import megatron, zero

from parity import assert_matches_reference


@functools.cache
def model():
    return fused_gpt(layers=3)


def test_a_params_pytree_function_has_one_layer_per_list_entry():
    params, loss, batch = model()
    graph = jscaler.trace(loss, params, batch(0))
    assert not any(o.path for o in graph.ops)  # nothing to read layers from but the params
    layers = graph.layers()
    assert [(lay.name, lay.index) for lay in layers] == [(f"blocks/{i}", i) for i in range(3)]
    for lay in layers:
        read = {
            graph.tensors[t].name.split("/")[1]
            for o in lay.graph.ops
            for t in o.tensor_inputs
            if graph.tensors[t].role == "param" and graph.tensors[t].name.startswith("blocks/")
        }
        assert read == {str(lay.index)}
    # every op reading a layer's kernel is in that layer; the head and embedding in none
    inside = {o.id for lay in layers for o in lay.graph.ops}
    for o in graph.ops:
        names = [graph.tensors[t].name for t in o.tensor_inputs if graph.tensors[t].role == "param"]
        if any(n.startswith("blocks/") for n in names):
            assert o.id in inside
        if any(n in ("wte", "head/kernel") for n in names):
            assert o.id not in inside


def test_zero3_regathers_a_pytree_layer_for_its_backward_and_matches_one_device():
    params, loss, batch = model()
    trainer = assert_matches_reference(params, loss, [batch(k) for k in range(3)], zero(3))
    regathered = {
        r.tensor for r in trainer.comm_table().rows if r.phase == "recompute"
    }  # the second gather of each layer's weights, for its backward
    # 9 weights per layer; the ones read through a view may keep their first gather
    assert len(regathered) >= 3 * 5, trainer.comm_table()


def _memory(trainer, b):
    m = trainer.program.compiled(trainer.state, b).memory_analysis()
    return m.argument_size_in_bytes + m.temp_size_in_bytes + m.output_size_in_bytes


@pytest.mark.parametrize(
    "plan, reshards", [(zero(3), True), (megatron(tp=4, dp=2, zero=3), False)], ids=str
)
def test_a_layer_is_resharded_only_where_that_saves_memory(plan, reshards, monkeypatch):
    """ZeRO-3 over 8 devices gathers far more weight per layer than the layer's input
    activation: reshard. megatron(tp=4, dp=2, zero=3) gathers a quarter of each weight
    over 2 devices, less than the activation the checkpointed layer keeps a copy of:
    resharding there cost 7-26 MB on three GPTs, so the layer keeps its gathers."""
    params, loss, batch = fused_gpt(d=64, layers=3, seq=64, ffn=128)
    b, opt = batch(0), optax.adamw(1e-3)

    def compiled():
        trainer = jscaler.parallelize(params, loss, opt, b, devices=8, plan=plan)
        regathers = [r for r in trainer.comm_table().rows if r.phase == "recompute"]
        return _memory(trainer, b), bool(regathers)

    chosen, resharded = compiled()
    assert resharded == reshards
    reshard_module = sys.modules["jscaler.compile.reshard"]
    monkeypatch.setattr(reshard_module, "worth_it", lambda low, unit: not resharded)
    other, _ = compiled()
    assert chosen <= other, (chosen, other)
