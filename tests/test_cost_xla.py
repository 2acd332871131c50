"""The cost model held to XLA (``jscaler bench cost``'s rows) and the out-of-memory
preflight tried both ways on small capacities.

Tolerances are what the cost model reaches today (docs/cost-model.md has the whole
table): argument bytes within 1%; collective bytes within 5% and the total per-device
memory (the preflight's number) within 10% on the rows below, which reach the issue's
targets; other rows miss them by up to the bench's largest error (docs/cost-model.md).
"""

import dataclasses

import optax
import pytest

import jscaler
import models
from bench import cost
from jscaler.cost import get_cluster
from spaces.parse import parse_plan

from parity import xla_0_12_1_memory

ARGS_TOL, COMM_TOL, TOTAL_TOL = 0.01, 0.05, 0.10

# jaxlib 0.12.1's CPU backend reduces ZeRO-3's (dp=8) gradients in pairs, as the backward
# makes them (40 all-reduces where 0.12.0 combined them into 3): XLA's temporaries fell
# 25-28% below what the one-collective rule of jscaler.cost.memory charges, which now
# overestimates the total by 27-32% (docs/cost-model.md, known misses). Strict: a cost
# model that follows it, or a jaxlib that combines again, fails these until updated.
ZERO3_PAIRS = xla_0_12_1_memory(
    "ZeRO-3 gradients reduced in pairs on CPU; the estimate charges one combined "
    "reduction (27-32% over)"
)


def _check(row: cost.Row) -> None:
    assert row.error is None
    errs = {c: cost.error(getattr(row, c)) for c in ("stored", "total", "comm")}
    assert abs(errs["stored"]) <= ARGS_TOL, (row, errs)
    assert abs(errs["comm"]) <= COMM_TOL, (row, errs)
    assert abs(errs["total"]) <= TOTAL_TOL, (row, errs)


@pytest.mark.parametrize(
    "model, expr",
    [
        ("gpt-tiny", "dp"),
        pytest.param("gpt-tiny", "zero(stage=3)", marks=ZERO3_PAIRS),
        ("gpt-tiny", "megatron(tp=4, dp=2, zero=3)"),
        # a dropless MoE: JAX lowers ragged_dot on CPU as a dense dot over the (local)
        # groups, whose expanded rows XLA keeps to the backward (ragged_expansions)
        ("moe-tiny-dropless", "expert(ep=2, dp=4)"),
        ("moe-tiny-dropless", "dp"),
        # T5's embedding, read by both lookups and the tied LM head: each reader's
        # gradient contribution and their sum live at the reduction (shared_params)
        pytest.param("t5-tiny", "zero(stage=3)", marks=ZERO3_PAIRS),
        pytest.param("hf-gpt2", "dp", marks=pytest.mark.slow),
        pytest.param("hf-llama", "dp", marks=pytest.mark.slow),
        # the loss's max over a vocabulary of 512 in two levels: no gathered logits
        pytest.param(
            "hf-llama",
            "megatron(tp=4, dp=2, zero=3)",
            marks=[pytest.mark.slow, xla_0_12_1_memory("argument bytes 1.7% over (4.1 kB)")],
        ),  # fmt: skip
        # views of ZeRO-3-gathered weights (FlaxConv1D's transposed kernels, the tied LM
        # head) dropped with the weights
        pytest.param("hf-gpt2", "megatron(tp=4, dp=2, zero=3)", marks=pytest.mark.slow),
        # BERT's head mask, a product with a constant, keeps the probabilities in no
        # backward; the backward holds the logits' cotangent and the decoder's gradient at
        # its start (+12% while the one was kept and the other not counted)
        pytest.param("hf-bert", "megatron(tp=4, dp=2, zero=3)", marks=pytest.mark.slow),
        # FlaxConv1D's transposed kernels: a stage's residuals, one copy per micro-batch
        pytest.param("hf-gpt2", "megatron(pp=2)", marks=pytest.mark.slow),
        # T5's embedding is read on both stages, by two lookups of one module path: each
        # stage reduces its own readers' gradients (+24% when matched by path)
        pytest.param("t5-tiny", "megatron(pp=2)", marks=pytest.mark.slow),
    ],
)
def test_bench_cost_rows_within_targets(model, expr):
    _check(cost.measure(model, expr))


@pytest.mark.slow
def test_a_recycling_pass_has_no_backward_collectives():
    """AlphaFold2's trunk runs three times, the first two under stop_gradient: the comm
    table reduces cotangents only where a gradient flows (DAP's bytes were +78% when it
    mirrored all three passes; +6% now, its forward all-to-alls: docs/cost-model.md)."""
    row = cost.measure("alphafold2-tiny", "dap(dap=2)")
    assert abs(cost.error(row.stored)) <= ARGS_TOL, row
    assert abs(cost.error(row.comm)) <= 0.07, row


@pytest.mark.slow
def test_pipeline_row_args_and_bytes():
    """A pipeline's stored bytes (stage copies + the update's share of the master and
    optimizer state) and collective bytes (each micro-batch's gradient reduction)."""
    row = cost.measure("gpt-tiny", "megatron(pp=2)")
    assert abs(cost.error(row.stored)) <= ARGS_TOL, row
    assert abs(cost.error(row.comm)) <= COMM_TOL, row


def _peak(trainer, batch) -> int:
    ma = trainer.compiled(batch).memory_analysis()
    return (
        ma.argument_size_in_bytes
        + ma.output_size_in_bytes
        - ma.alias_size_in_bytes
        + ma.temp_size_in_bytes
    )


@pytest.mark.parametrize(
    "expr",
    [
        "dp",
        "megatron(tp=2)",
        "megatron(tp=4, dp=2, zero=3)",
        # XLA's CPU backend all-reduces ZeRO's gradients whole, then slices them: the
        # estimate charges the whole reduced gradient on the "cpu" cluster
        pytest.param("zero(stage=3)", marks=ZERO3_PAIRS),
    ],
)
def test_preflight_both_ways(expr):
    """On capacities around XLA's measured peak and the predicted total: an admitted plan
    compiles, runs and fits; a refused one does not fit; both within TOTAL_TOL."""
    spec = models.get("gpt-tiny")
    batch = spec.batch(spec.batch_size, 0)

    def make(cluster=None):
        return jscaler.parallelize(
            spec.init(0), spec.loss, optax.adamw(1e-3), batch, devices=8,
            plan=parse_plan(expr), cluster=cluster,
        )  # fmt: skip

    free = make()  # CPU devices report no memory limit: no preflight
    peak, predicted = _peak(free, batch), free.estimate("cpu").memory["total"]
    verdicts = {}
    for capacity in (0.85 * peak, 0.99 * predicted, 1.01 * predicted, 1.15 * peak):
        cluster = dataclasses.replace(get_cluster("cpu"), memory=capacity)
        try:
            trainer = make(cluster)
        except jscaler.OutOfMemoryError as e:
            assert "predicted to need" in str(e)
            verdicts[capacity] = "refused"
            assert peak > capacity / (1 + TOTAL_TOL), (peak, predicted, capacity)
            continue
        verdicts[capacity] = "admitted"
        trainer.step(batch)  # it compiles and runs
        assert _peak(trainer, batch) <= capacity * (1 + TOTAL_TOL), (peak, predicted, capacity)
    assert verdicts[0.99 * predicted] == "refused" and verdicts[1.01 * predicted] == "admitted"
