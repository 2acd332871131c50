"""Models built from other libraries' layers (``examples/third_party_models.py``: tunix
Qwen3 and Gemma 4 MoE, Hugging Face Flax GPT-J, a Haiku and an Equinox decoder) trace
with every op annotated, and train under data, tensor (Megatron) and ZeRO-3 parallelism
on 8 devices as on one device.

The point is the primitives those libraries emit that our own models do not:
``ragged_dot_general`` and top-k routing (Gemma 4's MoE), ``stack`` (GPT-J's rotary),
``unstack`` (unpacking an array: ``inputs, targets = ...``).
"""

import functools
import importlib.util
import sys
from pathlib import Path

import jax
import optax
import pytest

import jscaler
from jscaler.runtime.reference import ATOL, RTOL, compare, reference_steps, trainer_steps
from spaces import dp, expert, megatron, zero

_PATH = Path(__file__).resolve().parent.parent / "examples" / "third_party_models.py"
_spec = importlib.util.spec_from_file_location("third_party_models", _PATH)
tpm = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = tpm  # dataclasses (equinox Modules) look their module up
_spec.loader.exec_module(tpm)

# the dev extra installs them; a missing one fails here, loudly, rather than skipping
import equinox  # noqa: E402, F401
import haiku  # noqa: E402, F401
import tunix  # noqa: E402, F401

LR, STEPS = 0.1, 3
NAMES = list(tpm.FACTORIES)
# each model must hold these primitives (anywhere in its graph), one of each set
PRIMITIVES = {
    "tunix_qwen3": [{"dot_general"}],
    "tunix_gemma4_moe": [{"ragged_dot_general"}, {"approx_top_k", "top_k"}],
    "hf_gptj": [{"stack"}],
    "haiku_lm": [{"unstack"}],
    "equinox_lm": [{"dot_general"}],
}
PLANS = {"dp": dp(), "megatron": megatron(tp=2, dp=4), "zero3": zero(stage=3)}
# fp32 tolerances: |a - b| <= RTOL |b| + atol * max|b| per leaf (jscaler.runtime.reference;
# defaults: atol 1e-5 for gradients, 1e-6 for updated parameters, RTOL alone for the loss).
# Where a model's own trajectory amplifies fp32 rounding, atol is set from its noise floor:
# how far the one-device run drifts from itself when its initial parameters move by
# 2^-23 max|p| (one ulp). Every plan stays within that floor; a wrong layout or a missing
# reduction moves values by orders of magnitude more.
ATOL_OVERRIDES = {
    # tunix initialises weights with std 0.01 while their gradients reach 0.3: each
    # sgd(0.1) step moves a weight by several times its size. Floor after 3 steps:
    # Qwen3 1.1e-5 (grads) 3e-6 (params); the plans 3.5e-6 and 1.4e-6
    "tunix_qwen3": {"grad": 3e-5, "param": 1e-5},
    # Gemma 4 more so: floor 5.2e-4 (grads) 1.5e-4 (params); the plans 1.8e-4 and 8.5e-5
    "tunix_gemma4_moe": {"grad": 2e-3, "param": 5e-4},
    # the attention key biases' gradients are exactly zero (softmax cancels them) and
    # hold rounding noise alone, ~6e-5 of the largest gradient (floor 5.8e-5, plans 5.6e-5)
    "haiku_lm": {"grad": 2e-4},
}


def _walk(ops):
    for op in ops:
        yield op
        if op.body is not None:
            yield from _walk(op.body.ops)


def _batches(batch):
    """``STEPS`` batches: the example's, then its tokens shifted through the vocabulary
    (a permutation of the token ids, so (token, next token) pairs stay pairs)."""
    return [
        jax.tree_util.tree_map(lambda x, k=k: (x + 37 * k) % tpm.VOCAB, batch) for k in range(STEPS)
    ]


@functools.cache
def _graph(name):
    model, loss, batch = tpm.FACTORIES[name]()
    return jscaler.trace(loss, model, batch, strict=True)


@functools.cache
def _reference(name):
    """Loss, gradients and updated parameters per SGD step on one device (shared by the
    three plans)."""
    model, loss, batch = tpm.FACTORIES[name]()
    return reference_steps(model, loss, optax.sgd(LR), _batches(batch))


@pytest.mark.parametrize("name", NAMES)
def test_traces_strictly_with_full_coverage(name):
    graph = _graph(name)  # strict: an op without a dim annotation raises
    cov = graph.coverage()
    assert (cov.ops, cov.flops) == (1.0, 1.0), cov
    prims = {op.primitive for op in _walk(graph.ops)}
    for want in PRIMITIVES[name]:
        assert want & prims, f"{name}: none of {sorted(want)} in {sorted(prims)}"
    assert all(op.annotation is not None for op in _walk(graph.ops))


@pytest.mark.parametrize("plan", PLANS)
@pytest.mark.parametrize("name", NAMES)
def test_plan_matches_one_device(name, plan, record_property):
    """3 SGD steps on 8 devices: losses, gradients and updated parameters as on one
    device, within the fp32 tolerances above."""
    want = _reference(name)
    model, loss, batch = tpm.FACTORIES[name]()  # fresh: nnx models train in place
    trainer = jscaler.parallelize(model, loss, optax.sgd(LR), batch, devices=8, plan=PLANS[plan])
    got = trainer_steps(trainer, _batches(batch))
    atol = {**ATOL, **ATOL_OVERRIDES.get(name, {})}
    mm = compare(got, want, rtol=RTOL, atol=atol)
    record_property("max_err", mm.max_err)
    print(f"{name} {plan}: max |diff| {mm.max_err} (rtol {RTOL}, atol {atol})")
    assert mm.ok, "\n".join(mm.lines[:10])
    if plan == "megatron":  # tensor parallelism split some weight over tp
        specs = jax.tree_util.tree_leaves(
            trainer.shardings(), is_leaf=lambda s: isinstance(s, jax.sharding.Sharding)
        )
        assert any("tp" in jax.tree_util.tree_leaves(tuple(s.spec)) for s in specs), name


def test_expert_parallel_gemma4_moe_matches_one_device():
    """tunix's Gemma 4 MoE (dropless: sorted rows, ragged_dot over a stacked expert
    weight) under expert(ep=4, dp=2): its experts found from the ragged_dots' group dim,
    stored split over ep, and training as on one device."""
    name = "tunix_gemma4_moe"
    want = _reference(name)
    model, loss, batch = tpm.FACTORIES[name]()
    trainer = jscaler.parallelize(
        model, loss, optax.sgd(LR), batch, devices=8, plan=expert(ep=4, dp=2)
    )
    got = trainer_steps(trainer, _batches(batch))
    mm = compare(got, want, rtol=RTOL, atol={**ATOL, **ATOL_OVERRIDES[name]})
    assert mm.ok, "\n".join(mm.lines[:10])
    specs = jax.tree_util.tree_leaves(
        trainer.shardings(), is_leaf=lambda s: isinstance(s, jax.sharding.Sharding)
    )
    assert sum(s.spec == jax.sharding.PartitionSpec("ep") for s in specs) == 4
