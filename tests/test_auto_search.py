"""``plan="auto"``: the joint search over the engine's candidates, every registered space's
settings and the registered schedules (jscaler.search.joint)."""

import functools

import jax
import pytest

import jscaler
import models
import schedules  # noqa: F401  (registers the schedules the search tries)
import spaces  # noqa: F401  (registers every space's settings)
from jscaler.cli.common import abstract_model
from jscaler.cost import estimate, estimate_pipeline
from jscaler.search import (
    Auto,
    Candidate,
    build_problem,
    fits_at_all,
    intra_op,
    least_memory,
    search,
    shared_solves,
    solve,
)
from spaces import SPACES
from spaces.grid import NOT_SEARCHED, expression, knob_settings
from spaces.grid import candidates as grid_candidates

from parity import assert_parity

CLUSTER = "dgx2_v100"
N = 8


@functools.cache
def graph_of(model: str, m: int) -> jscaler.Graph:
    """One micro-batch of the model's batch cut into ``m``."""
    spec = models.get(model)
    batch = jax.tree_util.tree_map(
        lambda x: jax.ShapeDtypeStruct((x.shape[0] // m, *x.shape[1:]), x.dtype),
        spec.batch(spec.batch_size, 0),
    )
    return jscaler.trace(spec.loss, abstract_model(spec), batch, strict=False)


def counts(model: str) -> tuple[int, ...]:
    size = models.get(model).batch_size
    return tuple(m for m in (1, 2, 4) if size % m == 0)


@functools.cache
def searched(model: str):
    return search(
        functools.partial(graph_of, model), N, cluster=CLUSTER, microbatches=counts(model),
        cache=False,
    )  # fmt: skip


def space_best(model: str, name: str) -> float | None:
    """The fastest predicted step of space ``name``'s settings, computed here without the
    search: SPMD settings at one micro-batch, pipelines (1F1B or their own schedule) at
    every count offered from their group count up; only settings that fit."""
    best = None
    for kw in knob_settings(name, N):
        pipeline = None
        for m in counts(model):
            if pipeline is False or (pipeline and m < kw.get("pp", 1)):
                continue  # SPMD settings: one micro-batch; pipelines: from their groups up
            try:
                plan = SPACES[name](**kw)(graph_of(model, m), N)
            except jscaler.PlanError:
                break
            pipeline = plan.is_pipeline
            if plan.is_pipeline and m < plan.pipeline_groups:
                continue
            try:
                if plan.is_pipeline:
                    est = estimate_pipeline(plan, CLUSTER, microbatches=m)
                else:
                    est = estimate(plan, CLUSTER, microbatches=m)
            except jscaler.JscalerError:  # 3F1B's three passes on a one-pass model
                continue
            if est.memory["total"] <= 32 * 2**30 and (best is None or est.step_time < best):
                best = est.step_time
    return best


MODELS = [
    "gpt-tiny",
    pytest.param("t5-tiny", marks=pytest.mark.slow),
    pytest.param("swin-tiny", marks=pytest.mark.slow),
]


@pytest.mark.parametrize("model", MODELS)
def test_auto_is_no_slower_than_any_spaces_best_setting(model):
    result = searched(model)
    assert result.best is not None and result.plan is not None
    beaten = {}
    for name in sorted(SPACES):
        if name in NOT_SEARCHED:
            continue
        best = space_best(model, name)
        if best is not None:
            beaten[name] = best
            # the same cost model on the same graphs: equal up to float summation order
            assert result.best.step_time <= best * (1 + 1e-9), (name, best, result.explain())
    assert {"dp", "megatron", "zero"} <= set(beaten)
    print(f"\n{model}: auto {result.best.label()} {result.best.step_time * 1e3:.3f} ms;")
    for name, best in sorted(beaten.items(), key=lambda kv: kv[1]):
        print(f"  {name:<16} {best * 1e3:.3f} ms")


@pytest.mark.parametrize(
    "expr",
    ["dp", "zero(stage=3)", "megatron(tp=4, dp=2)", "megatron(tp=2, recompute=1)",
     "megatron(tp=2, pp=2)", "megatron(pp=4, recompute=1)"],
)  # fmt: skip
def test_the_lower_bound_never_exceeds_a_predicted_step(expr):
    """The search prunes a candidate whose bound is not below the best step found: the
    bound (every op's roofline time at its whole size over the devices, recomputed
    layers' forward again) must be at most what the cost model predicts for any plan,
    and on one device it is the predicted compute itself."""
    from jscaler.cost.estimate import roofline_seconds
    from jscaler.plan.helpers import recomputed_layers
    from spaces.parse import parse_plan

    recompute = 1 if "recompute=1" in expr else 0
    kw = {"dtype": "fp16", "optimizer_slots": 2}
    for m in (2, 4) if "pp=" in expr else (1,):  # gpt-tiny's 8 rows: dp=8 needs m=1
        graph = graph_of("gpt-tiny", m)
        plan = parse_plan(expr)(graph, N)
        predict = estimate_pipeline if plan.is_pipeline else estimate
        est = predict(plan, CLUSTER, microbatches=m, **kw)
        again = {o.id for lay in recomputed_layers(graph, recompute) for o in lay.graph.ops}
        least = roofline_seconds(graph, CLUSTER, "fp16", again)
        assert 0 < least * m / N <= est.step_time, (expr, m, least * m / N, est.step_time)
    graph = graph_of("gpt-tiny", 1)
    one = SPACES["megatron"](tp=1, recompute=recompute)(graph, 1)
    alone = estimate(one, CLUSTER, **kw)
    again = {o.id for lay in recomputed_layers(graph, recompute) for o in lay.graph.ops}
    least = roofline_seconds(graph, CLUSTER, "fp16", again)
    assert least == pytest.approx(alone.compute - optimizer_seconds(one), rel=1e-9)


def optimizer_seconds(plan) -> float:
    """The cost model's gradient and update ops' time on one device (once per step)."""
    from jscaler.compile.comm import needs_grad
    from jscaler.cost.cluster import get_cluster
    from jscaler.cost.estimate import device_times

    times = device_times(plan, get_cluster(CLUSTER), "fp16", needs_grad(plan.graph), set())
    ids = {v.id for v in (*plan.pgraph.grad_ops, *plan.pgraph.update_ops)}
    return sum(t for i in ids for t in times[i][1].values())


def test_the_search_is_deterministic_cached_and_explained(tmp_path, monkeypatch):
    monkeypatch.setenv("JSCALER_CACHE_DIR", str(tmp_path))
    graph = graph_of("gpt-tiny", 2)  # two micro-batches: pipelines and their schedules
    kw = dict(cluster=CLUSTER, microbatches=(2,))
    first = search(graph, N, **kw)
    again = search(graph, N, **kw, cache=False)
    assert [r.label() for r in first.rows] == [r.label() for r in again.rows]
    assert [r.step_time for r in first.rows] == [r.step_time for r in again.rows]
    cached = search(graph, N, **kw)
    assert cached.cached and not first.cached
    assert cached.plan.name == first.plan.name and cached.best == first.best
    assert list(tmp_path.glob("plans/auto-*.json"))
    text = first.explain()
    assert f"winner:    {first.best.label()}" in text
    assert f"runner-up: {first.runner_up.label()}" in text and "faster" in text
    kinds = {r.name for r in first.rows}
    assert {"data_parallel", "intra_op(d=8)", "pipeline(pp=2, intra_op)"} <= kinds
    assert any(r.name.startswith("megatron(") for r in first.rows)
    assert {r.schedule for r in first.rows} >= {"1f1b", "gpipe", "zero_bubble"}
    # as a space, the winner's plan carries its search (train --explain prints it)
    plan = Auto(cluster=CLUSTER, microbatches=2)(graph, N)
    assert plan.name == first.plan.name and plan.searched.best == cached.best
    assert f"winner:    {first.best.label()}" in plan.searched.explain()
    assert first.plan.searched is None  # the table's own plan: not tagged


def test_memory_prunes_and_decides(tmp_path, monkeypatch):
    monkeypatch.setenv("JSCALER_CACHE_DIR", str(tmp_path))
    graph = graph_of("gpt-tiny", 1)
    kw = dict(cluster=CLUSTER, registered=False, cache=False)  # the engine's own candidates
    full = search(graph, N, **kw)
    # a capacity between the leanest plan and the winner's memory: the winner must change
    lean = min(r.memory for r in full.rows if r.predicted)
    capacity = (lean + full.best.memory) / 2
    assert lean < full.best.memory
    tight = search(graph, N, capacity=capacity, **kw)
    assert tight.best.memory <= capacity and tight.best.fits
    # a leaner plan (the ILP re-solves under the capacity), no faster than the free winner
    assert tight.best.memory < full.best.memory
    assert tight.best.step_time >= full.best.step_time
    assert all(not r.fits for r in tight.rows if r.predicted and r.memory > capacity)
    # a capacity below any plan's model state: pruned unplanned, and a clear error
    none = search(graph, N, capacity=1e3, **kw)
    assert none.best is None and none.plan is None
    assert any(r.note.startswith("pruned: model state") for r in none.rows)
    with pytest.raises(jscaler.PlanError, match="no candidate fits"):
        jscaler.search.auto(CLUSTER, capacity=1e3, cache=False)(graph, N)


def test_a_space_that_finds_nothing_fits_tries_more_microbatches(tmp_path, monkeypatch):
    """The ILP raises OutOfMemoryError where no strategy choice fits one micro-batch's
    activations; the search goes on to two micro-batches, where one fits."""
    monkeypatch.setenv("JSCALER_CACHE_DIR", str(tmp_path))
    mesh = jscaler.MeshSpec.create(d=N)
    one, two = (build_problem(graph_of("gpt-tiny", m), mesh, CLUSTER) for m in (1, 2))
    # least_memory is a lower bound: it leaves out the activations a reader keeps gathered
    # (Problem.regathers), which the leanest choice of two micro-batches holds (1.29x)
    capacity = least_memory(two.memory, two.peaks) * 1.4
    assert least_memory(one.memory, one.peaks) > capacity
    ilp = Candidate("ilp", intra_op({"d": N}, CLUSTER, cache=False), state_shards=N)
    result = search(
        functools.partial(graph_of, "gpt-tiny"), N, cluster=CLUSTER, capacity=capacity,
        microbatches=(1, 2), candidates=(ilp,), builtin=False, registered=False, cache=False,
    )  # fmt: skip
    first, second = sorted(result.rows, key=lambda r: r.microbatches)
    assert first.note.startswith("does not fit: no plan on mesh d=8 fits")
    assert second.fits and result.best is second
    with pytest.raises(jscaler.OutOfMemoryError):
        intra_op({"d": N}, CLUSTER, capacity, cache=False)(graph_of("gpt-tiny", 1), N)


def test_a_time_limit_returns_the_best_so_far_and_says_so():
    graph = graph_of("mlp-tiny", 1)
    result = search(graph, N, cluster=CLUSTER, time_limit=0.0, cache=False)
    assert "time limit" in result.stopped and "stopped early" in result.explain()


def test_candidates_of_ones_own_join_the_search():
    graph = graph_of("mlp-tiny", 1)

    def tp(g, n):
        return SPACES["megatron"](tp=2)(g, n)

    extra = Candidate("mine: megatron(tp=2)", tp, state_shards=2)
    result = search(graph, N, cluster=CLUSTER, candidates=(extra,), registered=False,
                    cache=False)  # fmt: skip
    assert "mine: megatron(tp=2)" in {r.name for r in result.rows}
    assert not any(r.name.startswith("zero(") for r in result.rows)  # registered=False
    with pytest.raises(jscaler.PlanError, match="both named"):
        search(graph, N, candidates=(extra, extra), cache=False)


@pytest.mark.parametrize("model", ["mlp-tiny", "gpt-tiny"])
def test_auto_trains_equal_to_one_device(model):
    """``plan="auto"`` (searched for the cpu cluster, as parallelize does) trains with
    SGD to the single-device losses, gradients and parameters (tests.parity's fp32
    tolerance)."""
    assert_parity(model, "auto")


def test_one_search_solves_the_same_ilp_problem_once(tmp_path, monkeypatch):
    """Inside shared_solves (every joint search), an intra_op on the same graph, mesh and
    knobs as an earlier one (its mesh written out or not, cached or not) returns the
    earlier plan; outside, it solves again, to an equal plan."""
    monkeypatch.setenv("JSCALER_CACHE_DIR", str(tmp_path))
    graph = graph_of("gpt-tiny", 1)
    written = intra_op({"d": N}, CLUSTER, cache=False, recompute=1)
    implied = intra_op(None, CLUSTER, cache=True, recompute=1)
    with shared_solves():
        first = written(graph, N)
        assert implied(graph, N) is first
        assert intra_op({"d": N}, CLUSTER, cache=False)(graph, N) is not first  # other knobs
    again = written(graph, N)
    assert again is not first and again == first


def test_a_problem_nothing_fits_fails_before_its_edges_as_the_solver_would():
    """Below the least memory any strategy choice needs (every cluster's leanest, with
    each phase beside what is kept), building fails fast with the solver's error. That
    bound leaves out the activations a reader keeps gathered (``Problem.regathers``, a
    pair of choices' cost): gpt-tiny's leanest choice holds 1.27x it, and the solver
    finds it there."""
    graph = graph_of("gpt-tiny", 1)
    mesh = jscaler.MeshSpec.create(d=N)
    full = build_problem(graph, mesh, CLUSTER)
    least = least_memory(full.memory, full.peaks)
    for capacity in (least / 2, least * 0.999):
        assert not fits_at_all(full.memory, capacity, full.peaks)
        with pytest.raises(jscaler.OutOfMemoryError, match="no plan on mesh d=8 fits") as solver:
            solve(build_problem(graph, mesh, CLUSTER, capacity=capacity), time_limit=3.0)
        with pytest.raises(jscaler.OutOfMemoryError) as early:
            build_problem(graph, mesh, CLUSTER, capacity=capacity, fail_fast=True)
        assert str(early.value) == str(solver.value)
    assert fits_at_all(full.memory, least * 1.001, full.peaks)
    tight = build_problem(graph, mesh, CLUSTER, capacity=least * 1.001, fail_fast=True)
    assert tight.edges == full.edges and tight.memory == full.memory
    with pytest.raises(jscaler.OutOfMemoryError):  # every choice gathers something
        solve(tight, time_limit=3.0)
    room = build_problem(graph, mesh, CLUSTER, capacity=least * 1.3)
    assert least * 1.2 < solve(room, time_limit=3.0).memory <= least * 1.3


def test_the_winner_is_the_plan_its_candidate_makes_again():
    """The search returns the winner as it was planned during the search (not planned a
    second time): the same plan and prediction its candidate makes afresh."""
    graph = graph_of("gpt-tiny", 1)
    result = search(graph, N, cluster=CLUSTER, registered=False, cache=False)
    name = result.best.name
    cand = next(c for c in jscaler.search.builtin_candidates(graph, N, CLUSTER) if c.name == name)
    knobs = dict(cluster=CLUSTER, capacity=result.capacity, dtype="fp32", optimizer_slots=0)
    fresh = jscaler.search.candidates.tuned(cand.space, microbatches=1, **knobs)(graph, N)
    assert fresh == result.plan
    assert estimate(fresh, CLUSTER).step_time == result.estimate.step_time == result.best.step_time


def test_the_expert_grid_holds_ep_with_tp_and_zero_and_auto_beats_each_point():
    """Expert parallelism's settings on moe-tiny (4 experts) at 8 devices: ep alone, with
    tp inside the experts and with ZeRO-1/3 (tried only where ep alone does not fit),
    never an ep the experts cannot take; the search predicts each as jscaler.estimate
    does and its winner is no slower than any."""
    graph = graph_of("moe-tiny", 1)
    grid = knob_settings("expert", N, graph)
    assert {"ep": 2, "tp": 2} in grid and {"ep": 4, "tp": 2} in grid and {"ep": 2, "tp": 4} in grid
    assert {"ep": 2, "zero": 1} in grid and {"ep": 4, "zero": 3} in grid
    assert {"ep": 2} in grid and not any(kw["ep"] == 8 for kw in grid)
    assert {"ep": 8, "zero": 3} in knob_settings("expert", N)  # no graph: every ep of N
    assert knob_settings("expert", N, graph_of("gpt-tiny", 1)) == []  # no experts
    cands = {c.name: c for c in grid_candidates(graph, N) if c.name.startswith("expert(")}
    assert cands["expert(ep=4, zero=3)"].fallback_of == "expert(ep=4)"
    assert cands["expert(ep=2, tp=2)"].fallback_of is None
    result = searched("moe-tiny")
    rows = {r.name: r for r in result.rows if r.microbatches == 1}
    for kw in grid:
        est = estimate(SPACES["expert"](**kw)(graph, N), CLUSTER)
        name = expression("expert", kw)
        assert "zero" in kw or rows[name].step_time == est.step_time, (name, rows.get(name))
        assert result.best.step_time <= est.step_time * (1 + 1e-9), (kw, result.explain())
    # below every plain expert plan's memory, above ZeRO-3's: the ZeRO fallbacks decide
    zero3 = estimate(SPACES["expert"](ep=4, zero=3)(graph, N), CLUSTER).memory["total"]
    plain = min(rows[n].memory for n in cands if "zero" not in n)
    assert zero3 < plain
    tight = search(graph, N, cluster=CLUSTER, capacity=(zero3 + plain) / 2, builtin=False,
                   registered=False, candidates=tuple(cands.values()), cache=False)  # fmt: skip
    assert tight.best is not None and "zero=3" in tight.best.name, tight.explain()


def test_a_skewed_router_slows_the_searchs_dropless_expert_plans(tmp_path, monkeypatch):
    """``expert_skew`` reaches every prediction of the search and its cache key: a
    dropless model's expert plans wait for their busiest ep device (up to skew x their
    share, at most ep x), dense data parallelism does not."""
    monkeypatch.setenv("JSCALER_CACHE_DIR", str(tmp_path))
    graph = graph_of("moe-tiny-dropless", 1)
    cands = tuple(c for c in grid_candidates(graph, N) if c.name.startswith(("expert(", "dp(")))
    kw = dict(cluster=CLUSTER, builtin=False, registered=False, candidates=cands)
    balanced = search(graph, N, **kw)
    skewed = search(graph, N, expert_skew=4, **kw)
    assert not skewed.cached, "a search under another skew reused the balanced one's table"
    assert search(graph, N, expert_skew=4.0, **kw).cached
    before = {r.name: r.step_time for r in balanced.rows if r.predicted}
    after = {r.name: r.step_time for r in skewed.rows if r.predicted}
    assert after["dp()"] == before["dp()"]
    experts = [n for n in before if n.startswith("expert(")]
    assert len(experts) >= 5, experts  # ep x tp; the ZeRO ones only where these do not fit
    for name in experts:
        assert after[name] > before[name], (name, before[name], after[name])
    slower = {n: after[n] - before[n] for n in ("expert(ep=2)", "expert(ep=4)")}
    assert slower["expert(ep=4)"] > slower["expert(ep=2)"], slower  # 4x its share vs 2x
    for bad in (0.5, float("nan"), True, "2"):
        with pytest.raises(jscaler.PlanError, match="expert_skew must be a number >= 1"):
            search(graph, N, expert_skew=bad, **kw)
    with pytest.raises(jscaler.PlanError, match="expert_skew must be a number >= 1"):
        jscaler.search.auto(CLUSTER, expert_skew=0.9)
