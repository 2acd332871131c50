"""The first spaces on the three model kinds: parity with one device, and the layouts.

Parity: SGD, 3 steps; loss, gradients and updated params per leaf within
|a-b| <= 1e-5*|b| + 1e-7*max|b| (fp32).
"""

import re

import optax
import pytest
from jax.sharding import PartitionSpec as P

import jscaler
import models
from jscaler.compile.hlo import collectives, summarize
from jscaler.report import explain
from spaces import dp, megatron, zero

from parity import assert_parity, leaves

MODELS = ["gpt-tiny", "convnet-tiny", "mlp-tiny"]
SPACES = {
    "dp": dp(),
    "megatron(tp=2)": megatron(tp=2),
    "megatron(tp=4)": megatron(tp=4),
    "megatron(tp=8)": megatron(tp=8),
    "megatron(tp=2, dp=4)": megatron(tp=2, dp=4),
    "zero(1)": zero(1),
    "zero(2)": zero(2),
    "zero(3)": zero(3),
    "megatron(tp=4, sp=True)": megatron(tp=4, sp=True),
    "megatron(tp=2, dp=4, sp=True)": megatron(tp=2, dp=4, sp=True),
    "megatron(tp=2, zero=3)": megatron(tp=2, zero=3),
    "megatron(tp=2, dp=4, sp=True, zero=2)": megatron(tp=2, dp=4, sp=True, zero=2),
}
SLOW = {
    ("gpt-tiny", "megatron(tp=8)"),
    ("gpt-tiny", "zero(2)"),
    ("convnet-tiny", "zero(2)"),
    ("convnet-tiny", "megatron(tp=2, dp=4, sp=True)"),
    ("mlp-tiny", "megatron(tp=2, dp=4, sp=True)"),
    ("convnet-tiny", "megatron(tp=2, dp=4, sp=True, zero=2)"),
    ("mlp-tiny", "megatron(tp=2, dp=4, sp=True, zero=2)"),
}


@pytest.mark.parametrize(
    "model, space",
    [
        pytest.param(m, s, marks=pytest.mark.slow) if (m, s) in SLOW else (m, s)
        for m in MODELS
        for s in SPACES
    ],
)
def test_space_matches_one_device(model, space):
    assert_parity(model, SPACES[space])


def specs_by_name(trainer):
    names = [t.name for t in trainer.graph.params()]
    return dict(zip(names, (s.spec for s in leaves(trainer.shardings()))))


def test_megatron_tp4_splits_mlp_weights_and_attention_four_ways():
    trainer = make_trainer("gpt-tiny", megatron(tp=4))
    s = specs_by_name(trainer)
    for i in range(4):
        assert s[f"blocks/{i}/mlp/gate_proj/kernel"] == P(None, "tp")  # column
        assert s[f"blocks/{i}/mlp/up_proj/kernel"] == P(None, "tp")
        assert s[f"blocks/{i}/mlp/down_proj/kernel"] == P("tp")  # row
        for n in "qkv":
            assert s[f"blocks/{i}/attn/{n}_proj/kernel"] == P(None, "tp")
        assert s[f"blocks/{i}/attn/o_proj/kernel"] == P("tp")
        assert s[f"blocks/{i}/norm1/scale"] == P()
    assert s["embed/embedding"] == P("tp")  # vocabulary-parallel
    text = explain(trainer.plan)
    assert "blocks/0/attn/q_proj" in text and "partial" in text


def test_megatron_with_zero_splits_each_tensor_parallel_shard_further_over_dp():
    trainer = make_trainer("mlp-tiny", megatron(tp=2, zero=3))
    specs = specs_by_name(trainer)
    assert specs["layers/0/w"] == P("dp", "tp")  # column-parallel: tp on its outputs
    assert specs["layers/0/b"] == P(("tp", "dp"))  # the tp shard of the bias, over dp
    assert specs["layers/1/b"] == P("dp")  # replicated over tp: ZeRO alone


def test_zero3_splits_every_param_with_a_dim_divisible_by_8():
    trainer = make_trainer("gpt-tiny", zero(3))
    for t, sharding in zip(trainer.graph.params(), leaves(trainer.shardings())):
        if any(d % 8 == 0 for d in t.shape):
            assert "dp" in str(sharding.spec), t.name
            dim = max(range(len(t.shape)), key=lambda a: (t.shape[a] % 8 == 0, t.shape[a]))
            assert sharding.spec[dim] == "dp", (t.name, sharding.spec)
        else:
            assert sharding.spec == P(), t.name


def make_trainer(model_name, plan, batch_size=None, devices=8):
    spec = models.get(model_name)
    return jscaler.parallelize(
        spec.init(0),
        spec.loss,
        optax.sgd(0.1),
        spec.batch(batch_size or spec.batch_size, 0),
        devices=devices,
        plan=plan,
    )


@pytest.mark.parametrize(
    "plan, message",
    [
        (megatron(tp=3), "divisible by tp"),
        (megatron(tp=2, dp=2), "uses dp\\*tp=4 devices"),
        (megatron(tp=2, pp=3), "divisible by tp\\*pp=6"),
    ],
)
def test_degrees_that_do_not_divide_the_devices_are_errors(plan, message):
    with pytest.raises(jscaler.PlanError, match=message):
        make_trainer("mlp-tiny", plan)


def test_megatron_sp_reduce_scatters_out_of_and_all_gathers_into_each_region():
    spec = models.get("gpt-tiny")
    trainer = assert_parity("gpt-tiny", megatron(tp=4, sp=True))
    hlo = trainer.hlo(spec.batch(8, 0))
    plain = make_trainer("gpt-tiny", megatron(tp=4)).hlo(spec.batch(8, 0))
    assert hlo.count("reduce-scatter(") >= 8  # o_proj and down_proj of 4 blocks
    assert plain.count("reduce-scatter(") == 0
    assert hlo.count("all-reduce(") < plain.count("all-reduce(")


@pytest.mark.parametrize("fraction, chosen", [(0.5, [1, 3]), (1, [0, 1, 2, 3]), (0.25, [3])])
def test_recompute_fraction_spreads_over_the_layers(fraction, chosen):
    spec = models.get("gpt-tiny")
    graph = jscaler.trace(spec.loss, spec.init(0), spec.batch(8, 0))
    plan = zero(3, recompute=fraction)(graph, 8)
    layers = graph.layers()
    done = [i for i, layer in enumerate(layers) if plan.is_recomputed(layer.graph.ops[0].id)]
    assert done == chosen


def test_zero3_with_recompute_half_matches_one_device():
    assert_parity("gpt-tiny", zero(3, recompute=0.5))
    assert_parity("gpt-tiny", megatron(tp=2, dp=4, sp=True, recompute=0.5))


def test_recompute_needs_repeated_layers():
    with pytest.raises(jscaler.PlanError, match="no repeated layers"):
        assert_parity("mlp-tiny", dp(recompute=0.5))


def _gather_events(text: str) -> list[str]:
    """The scheduled HLO's all-gathers ("G<layer>") and compute ("<layer>") of the ops of
    ``blocks/<layer>``, in order."""
    events = []
    for line in text[text.index("ENTRY") :].splitlines():
        name = re.search(r'op_name="([^"]*)"', line)
        layer = re.search(r"blocks/(\d+)/", name.group(1)) if name else None
        if layer is None:
            continue
        if re.search(r"= \S+ all-gather(-start)?\(", line):
            events.append("G" + layer.group(1))
        elif re.search(r"= \S+ (fusion|dot|convolution)\(", line):
            events.append(layer.group(1))
    return events


def _largest_axis_over_dp(path, x):
    """Plain FSDP's rule: each parameter split over all devices on its largest divisible
    axis."""
    for d in sorted(range(x.ndim), key=lambda d: -x.shape[d]):
        if x.shape[d] % 8 == 0:
            return P(*[("dp" if k == d else None) for k in range(x.ndim)])
    return P()


def test_zero3_gathers_each_layer_at_its_use_and_again_for_its_backward():
    """FSDP's reshard after forward, read from the scheduled HLO: layer i's parameters are
    gathered once layer i-1 has computed (not all at the start), dropped, and gathered
    again in the backward, after layer i+1's. The comm table counts the second gather
    as the HLO does, and the step needs less memory than plain jax.jit FSDP."""
    from bench.plain_jax import PlainStep, plain_dp

    spec = models.get("gpt-tiny")
    trainer = assert_parity("gpt-tiny", zero(3))
    batch = spec.batch(8, 0)
    text = trainer.hlo(batch)
    events = _gather_events(text)
    last = {}
    for i in range(4):
        gathers = [k for k, e in enumerate(events) if e == f"G{i}"]
        if i:
            assert gathers[0] > events.index(str(i - 1)), (i, events)
        assert len(gathers) >= 9 + 5, (i, events)  # 9 parameters; 7 gathered again here
        last[i] = gathers[-1]
    assert last[0] > last[1] > last[2] > last[3] > events.index("3"), events
    hlo = summarize(collectives(text, None))
    assert trainer.comm_table().total_bytes == pytest.approx(
        sum(b for _, b in hlo.values()), rel=0.02
    )
    opt = optax.sgd(1e-3)
    dp_mesh = plain_dp(spec.init(0), spec.loss, opt, batch, 8).mesh
    plain = PlainStep(spec.init(0), spec.loss, opt, batch, dp_mesh, _largest_axis_over_dp,
                      P("dp"))  # fmt: skip
    mine = jscaler.parallelize(spec.init(0), spec.loss, opt, batch, plan=zero(3))
    used = [
        c.memory_analysis().temp_size_in_bytes
        for c in (plain.compiled(batch), mine.program.compiled(mine.state, batch))
    ]
    assert used[1] < used[0], used
