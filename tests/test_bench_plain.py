"""``jscaler bench plain`` on tiny configs: the table is produced, the plain and jscaler
losses agree, the ratios come from the measured values, and a plan that fails is a row
holding its error. No timing assertions (simulated CPU devices share two cores)."""

import functools

import jax.numpy as jnp
import pytest
from jax.sharding import PartitionSpec as P

from bench import plain
from bench.plain_baselines import _rule, _shard_largest
from bench.plain_models import BUILDERS
from spaces import dp, megatron, zero


@functools.cache
def _results():
    pairs = {
        "gpt-fused": [
            ("dp", "dp", "jscaler dp()", dp()),
            ("tp", "tp", "jscaler megatron(tp=3)", megatron(tp=3)),  # 3 does not divide 8
        ],
        "hf-gpt2": [("zero3", "fsdp", "jscaler zero(stage=3)", zero(stage=3))],
    }
    return {
        name: (BUILDERS[name](True), plain.run_model(BUILDERS[name](True), 8, 1, p))
        for name, p in pairs.items()
    }


def test_plain_and_jscaler_losses_agree_and_ratios_are_the_measured_ones():
    for _, pairs in _results().values():
        for pair in pairs:
            if pair.key == "tp":
                continue
            a, b = pair.jscaler, pair.plain
            assert a.error is None and b.error is None, (a.error, b.error)
            assert pair.loss_rel is not None and pair.loss_rel <= plain.LOSS_RTOL
            assert a.memory > 0 and b.memory > 0 and a.step_s > 0 and b.step_s > 0
            assert pair.ratio("memory") == a.memory / b.memory
            assert pair.ratio("comm") == a.comm_bytes / b.comm_bytes
            assert pair.ratio("time") == a.step_s / b.step_s
            assert a.pred_memory and a.pred_comm is not None


def test_table_has_a_row_per_side_and_the_failing_plan_as_an_error_row():
    bm, pairs = _results()["gpt-fused"]
    failed = pairs[1]
    assert failed.plain.error is None and failed.plain.memory > 0  # the rules still ran
    assert failed.jscaler.error and failed.ratio("memory") is None
    lines = plain.table(bm, pairs, 8)
    rows = {line.split("  ")[0].strip(): line for line in lines[4:]}
    assert set(rows) == {
        "plain dp", "jscaler dp()", "plain Megatron rules tp=8", "jscaler megatron(tp=3)"
    }  # fmt: skip
    err = rows["jscaler megatron(tp=3)"]
    assert "ERROR " in err and failed.jscaler.error.split(":")[0] in err
    assert f"{pairs[0].ratio('memory'):.2f}x" in rows["jscaler dp()"]
    assert "loss ok" in rows["jscaler dp()"]
    verdicts = plain.target_lines(_results())
    assert any("n/a (a side failed)" in line for line in verdicts)


def test_targets_judge_the_ratio_against_the_bound():
    def side(name, mem, comm):
        return plain.Side(name, memory=mem, comm={"all-reduce": (1, comm)}, step_s=1.0)

    pair = plain.Pair("m", "tp", side("p", 100, 100), side("j", 90, 85))
    got = {what: (r, met) for _, _, what, r, _, met in plain.targets([pair])}
    assert got["memory"] == (0.9, True)
    assert got["comm"] == (0.85, False)  # megatron(tp=8) must move <= 0.8x the bytes
    assert got["time"] == (1.0, True)


def test_baseline_layouts():
    x = jnp.zeros((24, 64))
    assert _shard_largest([None, None], x, "dp", 8) == P(None, "dp")
    assert _shard_largest([None], jnp.zeros(10), "dp", 8) == P(None)  # 8 does not divide
    rules = [(r"qkv/kernel$", P(None, "tp"))]
    assert _rule(rules, "blocks/0/qkv/kernel", x, 4) == [None, "tp"]
    assert _shard_largest(_rule(rules, "blocks/0/qkv/kernel", x, 4), x, "dp", 2) == P("dp", "tp")
    assert _rule(rules, "blocks/0/qkv/kernel", jnp.zeros((4, 6)), 4) == [None, None]


@pytest.mark.parametrize("name", ["gpt-fused", "hf-gpt2", "hf-llama"])
def test_models_build_with_matching_parameters(name):
    bm = BUILDERS[name](True)
    params, loss = bm.plain()
    assert float(loss(params, bm.batch)) == pytest.approx(float(bm.loss(bm.make(), bm.batch)))


def test_bench_moe_pairs_expert_plans_with_plain_expert_rules():
    """``bench moe --small``: the expert plan and the plain expert rules train the same
    losses; the expert plan's all-to-alls move fewer bytes than GSPMD's gathers of the
    expert weights, and the target line names the best pair."""
    from bench import moe

    bm, measured = moe.run(small=True, steps=1)
    ep = [p for p in measured if p.key == "ep"]
    assert ep and all(p.jscaler.error is None and p.plain.error is None for p in ep)
    for pair in measured:
        assert pair.loss_rel is not None and pair.loss_rel <= plain.LOSS_RTOL
    best = min(ep, key=lambda p: p.ratio("comm"))
    assert best.jscaler.comm.get("all-to-all", (0, 0))[1] > 0
    assert best.ratio("comm") < 1.0
    line = moe.target_lines(measured)[-1]
    assert any(p.jscaler.name.removeprefix("jscaler ") in line for p in ep), line


def test_bench_scan_puts_the_scan_beside_its_list_twin_and_plain_jax():
    from bench import scan

    rows = scan.run(small=True, plans=[("megatron(tp=8)", "tp")])
    lines = scan.table(rows, small=True, n=8)
    assert any(line.startswith("megatron(tp=8)") for line in lines)
    (row,) = rows
    assert row.plain is not None and row.plain.memory
    found = {what: (value, met) for what, value, _, met in scan.targets(rows)}
    assert found["megatron(tp=8) scan/list memory"][1]  # met on the small model too
    assert found["megatron(tp=8) scan/list bytes"][1]
    assert abs(found["megatron(tp=8) predicted memory error"][0]) <= 0.10
