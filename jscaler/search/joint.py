"""``plan="auto"``: one search over the candidates of :mod:`jscaler.search.candidates`.

Every (candidate, micro-batch count, schedule) is planned on the real graph and predicted by
the cost model (:func:`jscaler.estimate`, :func:`estimate_pipeline`); the winner is the
fastest predicted step of the same global batch that fits the devices' memory (ties: less
memory, then the name). A candidate runs at the first micro-batch count offered, a
pipeline at every count offered from its group count up; a plan that does not fit tries
the next count (smaller micro-batches keep fewer activations).

The search's size is kept in check as the field does: identical layers share one strategy
in the ILP (solve one, reuse); a candidate whose model state cannot fit however it is split
is pruned unplanned, and so is one whose lower bound (every op's roofline time at its
whole size, its recomputed layers' forward again, over every device:
:func:`jscaler.cost.estimate.roofline_seconds`) is not below the best step found,
candidates being tried in order of that bound; an ILP problem met twice (Alpa's one-stage
plan is the engine's ILP with recompute) is solved once
(:func:`jscaler.search.shared_solves`), and one no strategy choice fits fails before its
edges are priced; each ILP has a solver work limit
(its FEASIBLE answer is the best it found, and the row says so); ``time_limit`` caps the
whole search and returns the best so far, saying so. A pipeline predicted under several
schedules of the same stages shares their per-stage costs
(:func:`jscaler.cost.pipeline.shared_costs`). Same inputs, same result: the order is
fixed and the solvers are deterministic (HiGHS single-threaded and seeded, stopped by a
work limit; only its wall-clock backstop, at three times that, ends where a machine's speed
says, and the row says so); the winner is returned as
it was planned. While an ILP solves, a second thread plans and predicts the candidates next
in line (:mod:`jscaler.search.lookahead`); the search still takes each in its own order,
so its rows are the same. Results are cached: the table of every candidate's prediction
under ``<cache_dir>/plans/auto-*.json``, keyed by the graphs, devices, cluster, capacity, dtype,
optimizer slots, expert skew, the candidates' names and the search version; a cached
search rebuilds only the winner.

Mixture-of-experts: ``expert_skew`` (the router's load imbalance, the busiest
expert-parallel device's rows over the mean; :func:`jscaler.estimate` takes it) is
charged to every prediction, so under a skewed router a dropless model's high-``ep``
plans, whose busiest device waits longest, lose to lower ``ep`` or to dense plans.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import time
from collections.abc import Callable
from dataclasses import dataclass

from jscaler.cost.cluster import Cluster, get_cluster
from jscaler.cost.estimate import Estimate, check_expert_skew, estimate, roofline_seconds
from jscaler.cost.pipeline import estimate_pipeline, shared_costs
from jscaler.errors import JscalerError, OutOfMemoryError, PlanError
from jscaler.ir.graph import Graph
from jscaler.plan.helpers import recomputed_layers
from jscaler.plan.kind import AnyPlan
from jscaler.search.auto import SEARCH_VERSION, shared_solves, write_atomically
from jscaler.search.candidates import (
    Candidate,
    builtin_candidates,
    registered_candidates,
    registered_schedules,
    tuned,
)
from jscaler.search.collect import fewer_collections
from jscaler.search.lookahead import Lookahead

__all__ = ["Auto", "Row", "SearchResult", "auto", "search"]

ONE_F_ONE_B = "1f1b"
NO_FIT = "does not fit: "  # a row whose space found no plan under the capacity


@dataclass(frozen=True)
class Row:
    """One (candidate, micro-batch count, schedule) of a search and what it was found."""

    name: str
    microbatches: int
    schedule: str = ""  # pipelines: the schedule's name ("" for SPMD plans)
    plan: str = ""  # the plan's own name
    step_time: float | None = None  # seconds, None: not predicted
    memory: float | None = None  # bytes on the fullest device
    comm_bytes: float | None = None
    compute: float | None = None
    exposed_comm: float | None = None
    bubble: float = 0.0
    fits: bool = False
    seconds: float = 0.0  # planning and predicting it
    note: str = ""  # why it was not predicted, or what the solver said

    @property
    def predicted(self) -> bool:
        return self.step_time is not None

    def label(self) -> str:
        extra = [f"m={self.microbatches}"] + ([self.schedule] if self.schedule else [])
        return f"{self.name} [{', '.join(extra)}]"


@dataclass(frozen=True)
class SearchResult:
    """A search's rows, ranked (fitting by step time, then those that do not fit, then the
    rest), with the winner's plan and estimate."""

    rows: tuple[Row, ...]
    plan: AnyPlan | None
    estimate: Estimate | None
    devices: int
    cluster: str
    capacity: float
    seconds: float
    stopped: str = ""  # why the search stopped before trying every candidate
    cached: bool = False
    made_ahead: int = 0  # evaluations made on a second thread while the ILP solved

    @property
    def best(self) -> Row | None:
        return self.rows[0] if self.rows and self.rows[0].fits else None

    @property
    def runner_up(self) -> Row | None:
        fitting = [r for r in self.rows if r.fits]
        return fitting[1] if len(fitting) > 1 else None

    def explain(self) -> str:
        """Why the winner won: its figures against the runner-up's."""
        counts: dict[str, int] = {}
        for r in self.rows:
            kind = "fit" if r.fits else "too big" if r.predicted else r.note.split(":")[0]
            counts[kind] = counts.get(kind, 0) + 1
        said = ", ".join(f"{v} {k}" for k, v in sorted(counts.items()))
        lines = [
            f"auto: {len(self.rows)} tries on {self.devices} x {self.cluster} "
            f"(capacity {self.capacity / 2**30:.1f} GiB): {said}; "
            f"{self.seconds:.1f} s{' (cached)' if self.cached else ''}"
            + (f", {self.made_ahead} made while an ILP solved" if self.made_ahead else "")
        ]
        if self.stopped:
            lines.append(f"stopped early: {self.stopped}; the best so far is returned")
        best, second = self.best, self.runner_up
        if best is None:
            lines.append("no candidate fits")
            return "\n".join(lines)
        lines.append(f"winner:    {_figures(best)}")
        if second is None:
            lines.append("runner-up: none fits")
            return "\n".join(lines)
        lines.append(f"runner-up: {_figures(second)}")
        gain = second.step_time - best.step_time
        why = [f"{gain * 1e3:.3f} ms ({gain / second.step_time:.1%}) faster"]
        for what, a, b in (
            ("compute", best.compute, second.compute),
            ("exposed collectives", best.exposed_comm, second.exposed_comm),
        ):
            if a is not None and b is not None and abs(a - b) >= 5e-7:  # 0.001 ms
                why.append(f"{what} {(a - b) * 1e3:+.3f} ms")
        if best.bubble or second.bubble:
            why.append(f"bubble {best.bubble:.0%} vs {second.bubble:.0%}")
        why.append(f"memory {(best.memory - second.memory) / 2**30:+.2f} GiB")
        why.append(f"collective bytes {(best.comm_bytes - second.comm_bytes) / 1e6:+.1f} MB")
        lines.append("why:       " + "; ".join(why))
        return "\n".join(lines)

    def table(self, top: int | None = None) -> list[str]:
        head = (
            f"{'candidate':<52} {'step ms':>9} {'GiB/dev':>8} {'fits':>5} {'comm MB':>9} {'s':>6}"
        )
        out = [head, "-" * len(head)]
        for r in self.rows[:top] if top else self.rows:
            if not r.predicted:
                out.append(f"{r.label():<52} {r.note}")
                continue
            out.append(
                f"{r.label():<52} {r.step_time * 1e3:>9.3f} {r.memory / 2**30:>8.2f} "
                f"{'yes' if r.fits else 'NO':>5} {r.comm_bytes / 1e6:>9.1f} {r.seconds:>6.1f}"
                + (f"  {r.note}" if r.note else "")
            )
        return out


def _figures(r: Row) -> str:
    return (
        f"{r.label()} = {r.plan}: step {r.step_time * 1e3:.3f} ms, "
        f"{r.memory / 2**30:.2f} GiB/device, {r.comm_bytes / 1e6:.1f} MB collectives"
        + (f", bubble {r.bubble:.0%}" if r.bubble else "")
    )


def search(
    graph: Graph | Callable[[int], Graph],
    n_devices: int,
    *,
    cluster: str | Cluster = "cpu",
    capacity: float | None = None,
    dtype: str = "fp32",
    optimizer_slots: int = 0,
    expert_skew: float = 1.0,
    microbatches: tuple[int, ...] = (1,),
    candidates: tuple[Candidate, ...] = (),
    builtin: bool = True,
    registered: bool = True,
    time_limit: float | None = None,
    ilp_time_limit: float = 10.0,
    ilp_meshes: str = "one",
    cache: bool = True,
    progress: bool = False,
    lookahead: bool = True,
) -> SearchResult:
    """Searches the candidates (see the module doc) for ``n_devices`` of ``cluster``.

    Args:
      graph: the graph of one micro-batch, or ``m -> graph`` of one micro-batch when the
        global batch is cut into ``m`` (for more than one count in ``microbatches``).
      capacity: bytes per device (default the cluster's memory).
      expert_skew: a mixture-of-experts router's load imbalance (>= 1; 1: balanced), as
        :func:`jscaler.estimate` takes it: every candidate is predicted under it.
      microbatches: the micro-batch counts offered, the first the default.
      candidates: more candidates, beside the engine's (``builtin``) and the registered
        ones (``registered``).
      time_limit: seconds for the whole search (None: no limit); ``ilp_time_limit``: the
        ILP's work limit per solve (seconds of HiGHS's work, deterministic:
        :func:`jscaler.search.ilp.solve`); ``ilp_meshes``: the meshes the engine's
        ILP runs on (``"one"`` axis, or ``"all"`` two-axis ones too; see
        :func:`builtin_candidates`).
      lookahead: while the ILP solves, plan and predict the next candidates on a second
        thread (:mod:`jscaler.search.lookahead`); the same rows either way.
    """
    start = time.perf_counter()
    cl = get_cluster(cluster)
    capacity = capacity if capacity is not None else cl.memory
    expert_skew = check_expert_skew(expert_skew)
    offered = tuple(dict.fromkeys(int(m) for m in microbatches))
    if not offered or min(offered) < 1:
        raise PlanError(f"microbatches must be positive counts; got {microbatches!r}")
    graphs: dict[int, Graph] = {}

    def graph_of(m: int) -> Graph:
        if m not in graphs:
            graphs[m] = graph(m) if callable(graph) else graph
        return graphs[m]

    if not callable(graph) and len(offered) > 1:
        raise PlanError("one graph holds one micro-batch count: pass m -> graph for several")
    first = graph_of(offered[0])
    cands = list(candidates)
    if builtin:
        cands += builtin_candidates(
            first, n_devices, cl, time_limit=ilp_time_limit, cache=cache, ilp_meshes=ilp_meshes
        )
    if registered:
        cands += registered_candidates(first, n_devices)
    names = [c.name for c in cands]
    if len(set(names)) != len(names):
        dup = next(n for n in names if names.count(n) > 1)
        raise PlanError(f"two search candidates are both named {dup!r}; names must be unique")
    schedules = registered_schedules()
    knobs = dict(
        cluster=cl, capacity=capacity, dtype=dtype, optimizer_slots=optimizer_slots
    )  # fmt: skip
    key = _key(
        [graph_of(m) for m in offered], n_devices, cl, capacity, dtype, optimizer_slots,
        offered, names, sorted(schedules), time_limit, ilp_time_limit, expert_skew,
    )  # fmt: skip
    knobs["expert_skew"] = expert_skew  # for the predictions (and a space taking it)
    path = _cache_path(key) if cache else None
    if path is not None and path.is_file():
        try:
            rows = tuple(Row(**r) for r in json.loads(path.read_text())["rows"])
            plan, est = _rebuild(rows, cands, graph_of, n_devices, knobs, schedules)
            return SearchResult(
                rows, plan, est, n_devices, cl.name, capacity, time.perf_counter() - start,
                cached=True,
            )  # fmt: skip
        except (PlanError, ValueError, KeyError, TypeError):
            pass  # stale or unreadable: search again and overwrite it
    with shared_solves(), shared_costs(), fewer_collections():
        rows, stopped, kept, ahead = _run(
            cands, offered, graph_of, n_devices, knobs, schedules, time_limit, progress, start,
            lookahead,
        )  # fmt: skip
        ranked = tuple(sorted(rows, key=_rank))
        if kept is not None and ranked and kept[0] is ranked[0]:
            plan, est = kept[1], kept[2]  # the winner as it was planned: not planned again
        else:
            plan, est = _rebuild(ranked, cands, graph_of, n_devices, knobs, schedules)
    if path is not None and not stopped:
        write_atomically(path, json.dumps({"rows": [dataclasses.asdict(r) for r in ranked]}))
    return SearchResult(
        ranked, plan, est, n_devices, cl.name, capacity, time.perf_counter() - start, stopped,
        made_ahead=ahead,
    )  # fmt: skip


def _rank(r: Row):
    if r.fits:
        return (0, r.step_time, r.memory, r.label())
    if r.predicted:
        return (1, r.memory, r.step_time, r.label())
    return (2, 0.0, 0.0, r.label())


def _state_bytes(graph: Graph, dtype: str, slots: int) -> float:
    """Parameters, gradients and optimizer state at the least: half precision values
    for the first two when computing in half, fp32 optimizer slots."""
    value = 2 if dtype in ("fp16", "bf16") else 4
    n = sum(math.prod(t.shape) for t in graph.params())
    return n * (2 * value + 4 * slots)


def _run(cands, offered, graph_of, n, knobs, schedules, time_limit, progress, start, lookahead):
    """Every (candidate, count, schedule) tried in order of its lower bound."""
    cl, dtype = knobs["cluster"], knobs["dtype"]
    least = {}

    def bound(c: Candidate, m: int) -> float:
        """No plan of ``c`` is faster: m micro-batches of every op at its roofline time
        (its recomputed layers' forward twice), spread evenly over the devices. No
        pipeline bubble: a schedule such as zero-bubble may fill it."""
        if (m, c.recompute) not in least:
            g = graph_of(m)
            layers = recomputed_layers(g, c.recompute) if g.layers() else []  # none: it fails
            again = {o.id for lay in layers for o in lay.graph.ops}
            least[(m, c.recompute)] = roofline_seconds(g, cl, dtype, again)
        return least[(m, c.recompute)] * m / n

    queue = []
    for i, c in enumerate(cands):
        if c.microbatches:
            counts = [c.microbatches]
        elif c.stages == 1:
            counts = list(offered)  # the first; the next ones only if it does not fit
        else:
            counts = [m for m in offered if m >= c.stages]
        counts = counts[: c.counts] if c.counts else counts
        if not counts:
            continue  # a pipeline needs at least as many micro-batches as groups
        queue.append((bound(c, counts[0]), i, c, counts))
    queue.sort(key=lambda q: (q[0], q[1]))
    state = _state_bytes(graph_of(offered[0]), knobs["dtype"], knobs["optimizer_slots"])
    rows: list[Row] = []
    fits: dict[str, bool] = {}
    best = float("inf")
    kept = None  # (row, plan, estimate) of the best-ranked fitting row so far
    stopped = ""
    at = 0  # the queue's entry being tried

    def unneeded(c: Candidate) -> bool:
        """A fallback (recompute and the like) whose plain plan fits or is not tried."""
        return c.fallback_of is not None and fits.get(c.fallback_of, True)

    def too_big(c: Candidate) -> bool:
        """Its model state cannot fit however it is split."""
        return bool(c.state_shards) and state / c.state_shards > knobs["capacity"]

    def upcoming():
        """What the search will likely evaluate next, for the lookahead: the queue from
        here, less what it will prune or skip, at counts whose graphs are traced (an
        SPMD plan's first only: it tries more only where that does not fit)."""
        for _, i, c, counts in queue[at:]:
            if unneeded(c) or too_big(c):
                continue
            for m in counts[:1] if _retries(c) else counts:
                if (m, c.recompute) in least and bound(c, m) < best:  # graph traced
                    yield (i, m)

    def make(key):
        i, m = key
        return _evaluate(cands[i], m, graph_of(m), n, knobs, schedules)

    from tqdm import tqdm

    bar = tqdm(queue, desc="auto", unit="cand", disable=not progress, leave=False)
    with _lookahead(make, upcoming, lookahead) as ahead:
        for k, (low, i, c, counts) in enumerate(bar):
            at = k  # for upcoming()
            bar.set_postfix_str(c.name[:40])
            if unneeded(c):
                continue
            if too_big(c):
                rows.append(Row(c.name, counts[0], note=_pruned_state(state, c.state_shards)))
                fits[c.name] = False
                continue
            if low >= best:
                rows.append(Row(c.name, counts[0], note=f"pruned: bound {low * 1e3:.3f} ms"))
                continue
            for m in counts:
                if time_limit is not None and time.perf_counter() - start > time_limit:
                    stopped = f"the time limit of {time_limit:.0f} s"
                    break
                if bound(c, m) >= best:
                    rows.append(Row(c.name, m, note=f"pruned: bound {bound(c, m) * 1e3:.3f} ms"))
                    continue
                made = ahead.get((i, m))
                rows.extend(r for r, _, _ in made)
                for r, plan_s, est in made:
                    if r.fits:
                        best = min(best, r.step_time)
                        if kept is None or _rank(r) < _rank(kept[0]):
                            kept = (r, plan_s, est)
                made = [r for r, _, _ in made]
                fits[c.name] = fits.get(c.name, False) or any(r.fits for r in made)
                if _retries(c) and (fits[c.name] or not any(_sized(r) for r in made)):
                    break  # an SPMD plan tries more micro-batches only to fit
            if stopped:
                break
    return rows, stopped, kept, ahead.made_ahead


def _retries(c: Candidate) -> bool:
    """An SPMD candidate of no fixed micro-batch count: it tries the next count offered
    only where one does not fit."""
    return c.stages == 1 and not c.microbatches


class _Inline:
    """No lookahead: every evaluation made when asked for."""

    made_ahead = 0

    def __init__(self, make):
        self.get = make

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return None


def _lookahead(make, upcoming, on: bool):
    return Lookahead(make, upcoming) if on else _Inline(make)


def _sized(r: Row) -> bool:
    """Whether the row was too big (predicted over the capacity, or its space found nothing
    fits): a smaller micro-batch may fit."""
    return r.predicted or r.note.startswith(NO_FIT)


def _pruned_state(state: float, shards: int) -> str:
    return f"pruned: model state {state / shards / 2**30:.1f} GiB per device at the least"


def _evaluate(c: Candidate, m, graph, n, knobs, schedules) -> list[tuple]:
    """(row, plan, estimate) per schedule (plan and estimate None where not predicted)."""
    t0 = time.perf_counter()
    try:
        plan = tuned(c.space, microbatches=m, **knobs)(graph, n)
    except PlanError as e:  # a space that finds nothing fits (the ILP): more micro-batches may
        said = NO_FIT if isinstance(e, OutOfMemoryError) else "cannot apply: "
        note = said + str(e).split(";")[0][:80]
        return [(Row(c.name, m, note=note, seconds=time.perf_counter() - t0), None, None)]
    planned = time.perf_counter() - t0
    solver = plan.solved
    note = ""
    if solver is not None and solver[1].cut == "wall clock":
        note = "ILP wall-clock backstop: its best so far (another machine may differ)"
    elif solver is not None and solver[1].status != "OPTIMAL":
        note = "ILP work limit: its best so far"
    out = []
    for k, (sched, plan_s) in enumerate(_schedules_for(plan, schedules)):
        t1 = time.perf_counter() - (planned if k == 0 else 0.0)
        try:
            est = _predict(plan_s, m, knobs)
        except JscalerError as e:  # a schedule this plan or count does not allow
            reason = str(e).split(";")[0][:80]
            row = Row(c.name, m, sched, plan_s.name, note=f"cannot apply: {reason}")
            out.append((row, None, None))
            continue
        row = Row(
            c.name, m, sched, plan_s.name, est.step_time, est.memory["total"],
            est.comm_bytes, est.compute, est.exposed_comm, est.bubble,
            est.memory["total"] <= knobs["capacity"], time.perf_counter() - t1, note,
        )  # fmt: skip
        out.append((row, plan_s, est))
    return out


def _schedules_for(plan, schedules):
    """(schedule name, plan) pairs to predict: SPMD plans once; pipelines under their own
    schedule (1F1B when none) and every registered one (not for a plan that brings its
    own: the interlaced and 3F1B pipelines' schedules are part of the plan)."""
    if not plan.is_pipeline:
        return [("", plan)]
    if plan.schedule is not None:
        return [(getattr(plan.schedule, "__name__", "own"), plan)]
    out = [(ONE_F_ONE_B, plan)]
    if not plan.whole:
        out += [(name, dataclasses.replace(plan, schedule=s)) for name, s in schedules.items()]
    return out


def _predict(plan, m: int, knobs) -> Estimate:
    kw = dict(
        dtype=knobs["dtype"], optimizer_slots=knobs["optimizer_slots"],
        expert_skew=knobs["expert_skew"],
    )  # fmt: skip
    if plan.is_pipeline:
        return estimate_pipeline(plan, knobs["cluster"], microbatches=m, **kw)
    return estimate(plan, knobs["cluster"], microbatches=m, **kw)


def _rebuild(rows, cands, graph_of, n, knobs, schedules):
    """The winner's plan and estimate (None, None when nothing fits)."""
    if not rows or not rows[0].fits:
        return None, None
    win = rows[0]
    c = next(c for c in cands if c.name == win.name)
    plan = tuned(c.space, microbatches=win.microbatches, **knobs)(graph_of(win.microbatches), n)
    for sched, plan_s in _schedules_for(plan, schedules):
        if sched == win.schedule:
            return plan_s, _predict(plan_s, win.microbatches, knobs)
    raise KeyError(win.schedule)


def _key(graphs, n, cl, capacity, dtype, slots, offered, names, schedules, limit, ilp, skew):
    from jscaler.plan.plan import PLAN_FORMAT, graph_fingerprint

    parts = [
        [graph_fingerprint(g) for g in graphs], n, dataclasses.asdict(cl), capacity, dtype,
        slots, offered, names, schedules, limit, ilp, SEARCH_VERSION, PLAN_FORMAT,
    ]  # fmt: skip
    if skew != 1:  # balanced searches keep the keys (and cached tables) they had
        parts.append(["expert_skew", skew])
    return hashlib.sha256(json.dumps(parts, default=str).encode()).hexdigest()[:24]


def _cache_path(key: str):
    from jscaler.setup import cache_dir

    return cache_dir() / "plans" / f"auto-{key}.json"


@dataclass(frozen=True)
class Auto:
    """``plan="auto"`` as a space: :func:`search` on the graph it is given (one
    micro-batch of ``microbatches``), returning the winner's plan."""

    cluster: str | Cluster = "cpu"
    capacity: float | None = None
    dtype: str = "fp32"
    optimizer_slots: int = 0
    microbatches: int = 1
    time_limit: float | None = None
    ilp_time_limit: float = 10.0
    ilp_meshes: str = "one"
    cache: bool = True
    progress: bool = False
    expert_skew: float = 1.0

    def __post_init__(self):
        check_expert_skew(self.expert_skew)

    def __call__(self, graph: Graph, n_devices: int) -> AnyPlan:
        result = self.search(graph, n_devices)
        if result.plan is None:
            raise PlanError(
                f"plan='auto': no candidate fits {result.capacity / 2**30:.1f} GiB per device "
                f"on {n_devices} devices; the smallest needs "
                f"{min((r.memory for r in result.rows if r.predicted), default=0) / 2**30:.1f}"
                f" GiB. Use more devices, a smaller batch or more micro-batches"
            )
        plan = result.plan  # carrying the search, for --explain
        if plan.is_pipeline:
            return dataclasses.replace(plan, searched=result)
        return plan.evolve(searched=result)

    def search(self, graph: Graph, n_devices: int) -> SearchResult:
        return search(
            graph, n_devices, cluster=self.cluster, capacity=self.capacity, dtype=self.dtype,
            optimizer_slots=self.optimizer_slots, microbatches=(self.microbatches,),
            time_limit=self.time_limit, ilp_time_limit=self.ilp_time_limit,
            ilp_meshes=self.ilp_meshes, cache=self.cache, progress=self.progress,
            expert_skew=self.expert_skew,
        )  # fmt: skip


def auto(
    cluster: str | Cluster = "cpu",
    capacity: float | None = None,
    dtype: str = "fp32",
    optimizer_slots: int = 0,
    microbatches: int = 1,
    time_limit: float | None = None,
    ilp_time_limit: float = 10.0,
    ilp_meshes: str = "one",
    cache: bool = True,
    progress: bool = False,
    expert_skew: float = 1.0,
) -> Auto:
    """The joint search as a space (see the module doc): for ``cluster`` under
    ``capacity`` bytes per device (default the cluster's memory), costed in ``dtype``
    with ``optimizer_slots`` fp32 values per parameter, the graph being one of
    ``microbatches`` micro-batches; ``time_limit``, ``ilp_time_limit``, ``ilp_meshes``,
    ``expert_skew`` (a mixture-of-experts router's load imbalance, >= 1): as
    :func:`search` takes them.

    Example: ``jscaler.parallelize(..., plan=auto("h100_sxm", expert_skew=2.0))``."""
    return Auto(
        cluster, capacity, dtype, optimizer_slots, microbatches, time_limit, ilp_time_limit,
        ilp_meshes, cache, progress, expert_skew,
    )  # fmt: skip
