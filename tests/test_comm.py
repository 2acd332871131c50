"""The predicted comm table (materialisation) held to what XLA compiled.

Per (collective, mesh axes), the bytes per device per step predicted from the plan's
layouts must be within 10% of those read from the compiled HLO. XLA's combiners may merge
collectives, so counts are not compared. The CPU backend forms no reduce-scatter: an
all-reduce read only through a 1/n slice is counted as one, but XLA often fuses that
slice into its consumers, so reductions (all-reduce and reduce-scatter) are compared
together per mesh axes. Scalar reductions (the loss, the gradient norm's per-leaf
partial sums) are below 64 bytes and left out of both sides. The HLO text holds a loop
body once, so micro-batching is checked on the prediction alone.

A gradient partial over two mesh axes is reduced by the CPU backend with one all-reduce
per axis; the GPU compiler folds the pair into one over both, and that is how it is read
(``jscaler.compile.hlo``) and predicted.
"""

from collections import defaultdict

import pytest

import models
from jscaler.compile.hlo import collectives
from spaces import dap, dp, expert, megatron, ring, ulysses, usp, zero

from parity import run_plan

SCALAR = 64


def by_kind_and_axes(rows):
    out = defaultdict(int)
    for kind, axes, nbytes in rows:
        if nbytes >= SCALAR:
            kind = "reduction" if kind in ("all-reduce", "reduce-scatter") else kind
            out[(kind, tuple(sorted(axes)))] += nbytes
    return dict(out)


def predicted_and_compiled(model_name, plan, microbatches=1):
    spec = models.get(model_name)
    trainer, _ = run_plan(model_name, plan, steps=0, microbatches=microbatches)
    table = trainer.comm_table()
    pred = by_kind_and_axes((r.collective, r.axes, r.bytes * r.times) for r in table.rows)
    hlo = trainer.hlo(spec.batch(spec.batch_size, 0))
    got = by_kind_and_axes(
        (c.kind, c.axes, c.bytes) for c in collectives(hlo, trainer.plan.mesh.axes)
    )
    return pred, got, table


def assert_close(pred, got):
    problems = []
    for key in sorted(set(pred) | set(got)):
        p, g = pred.get(key, 0), got.get(key, 0)
        if abs(p - g) > 0.1 * max(p, g):
            problems.append(f"{key}: predicted {p / 1e3:.1f} KB, compiled {g / 1e3:.1f} KB")
    assert not problems, "\n".join(problems)


AGREE = {
    ("gpt-tiny", "dp"): dp(),
    ("gpt-tiny", "zero(1)"): zero(1),
    ("gpt-tiny", "zero(2)"): zero(2),
    ("gpt-tiny", "zero(3)"): zero(3),
    ("gpt-tiny", "zero(3, recompute=1/2)"): zero(3, recompute=0.5),
    ("mlp-tiny", "megatron(tp=2, dp=4)"): megatron(tp=2, dp=4),
    ("mlp-tiny", "megatron(tp=2, zero=3)"): megatron(tp=2, zero=3),
    ("convnet-tiny", "megatron(tp=2, zero=2)"): megatron(tp=2, zero=2),
    ("mlp-tiny", "zero(3)"): zero(3),
    ("convnet-tiny", "dp"): dp(),
    ("convnet-tiny", "zero(2)"): zero(2),
    ("gpt-tiny", "ring(sp=8)"): ring(sp=8),
    # a tied embedding (lookups and LM head) gathered once for its three readers
    ("t5-tiny", "zero(3)"): zero(3),
    # a table stored whole with its gradient split by rows: XLA gathers the lookup's
    # cotangent and indices (smaller than t5-tiny's table) and scatters into its own rows
    ("t5-tiny", "zero(2)"): zero(2),
    # two readers of one activation wanting the same all-to-all: XLA makes it once
    ("alphafold2-tiny", "dap(dap=2, dp=4)"): dap(dap=2, dp=4),
    # the zeros a scatter writes into, made split and read whole: made again, not gathered
    ("moe-tiny-dropless", "expert(ep=4, tp=2)"): expert(ep=4, tp=2),
    # gradients partial over two mesh axes: the CPU backend reduces them one axis at a
    # time, which the GPU compiler folds into one all-reduce over both (as counted)
    ("gpt-tiny", "ulysses(sp=4)"): ulysses(sp=4),
    ("gpt-tiny", "megatron(tp=4)"): megatron(tp=4),
    ("gpt-tiny", "megatron(tp=4, sp=True)"): megatron(tp=4, sp=True),
}


@pytest.mark.parametrize("case", list(AGREE), ids=lambda c: f"{c[0]}-{c[1]}")
def test_predicted_collectives_match_the_compiled_hlo(case):
    pred, got, _ = predicted_and_compiled(case[0], AGREE[case])
    assert pred, "the plan implies no collective at all?"
    assert_close(pred, got)


def test_micro_batches_repeat_forward_and_backward_but_not_the_update():
    pred1, _, _ = predicted_and_compiled("mlp-tiny", zero(1))
    pred2, _, t2 = predicted_and_compiled("mlp-tiny", zero(1), microbatches=2)
    assert pred2[("reduction", ("dp",))] == pytest.approx(2 * pred1[("reduction", ("dp",))], 0.01)
    assert pred2[("all-gather", ("dp",))] == pred1[("all-gather", ("dp",))]  # update only
    assert {r.times for r in t2.rows if r.phase == "update"} == {1}


def test_the_table_names_tensors_module_paths_and_phases():
    _, _, table = predicted_and_compiled("gpt-tiny", zero(3))
    text = table.format()
    assert "all-gather" in text and "reduce-scatter" in text and "MB per device" in text
    phases = {r.phase for r in table.rows}
    # zero-3: no update-side movement; each layer's gathers done again for its backward
    assert phases == {"forward", "recompute", "backward"}
    again = [r for r in table.rows if r.phase == "recompute"]
    assert again and all(r.collective == "all-gather" and "blocks/" in r.path for r in again)
    assert any(r.path.startswith("blocks/0/") for r in table.rows)


@pytest.mark.parametrize("plan", [ulysses(sp=4), ring(sp=4), usp(ulysses=2, ring=2)], ids=str)
def test_sequence_parallel_exchanges_match_the_compiled_hlo(plan):
    """All-to-alls and ring hops agree exactly."""
    pred, got, _ = predicted_and_compiled("gpt-tiny", plan)
    moves = [k for k in pred if k[0] in ("all-to-all", "collective-permute")]
    assert moves
    for key in moves:
        assert pred[key] == got.get(key), key
