"""The op-trans + op-assign problem as a mixed-integer linear program, solved by HiGHS.

Alpa's model: a binary ``x[c, s]`` per cluster and strategy (exactly one per cluster); per
edge a ``e[a, b, i, j] >= 0`` per strategy pair, tied to the ``x`` by ``sum_j e[a, b, i, j]
= x[a, i]`` and ``sum_i e[a, b, i, j] = x[b, j]`` (integral ``x`` make it their product,
so it need not be declared integral). Strategies whose rows (columns) of an edge's costs
are equal, such as an op's strategy and its ZeRO twin, which make and read the same
layouts, share one ``e`` row (column), tied to the sum of their ``x``: the same optimum and
LP bound (split a shared ``e`` in proportion to the ``x``) with fewer variables (a fifth
fewer on paper-scale AlphaFold2). Minimise ``sum node * x + sum edge * e`` (in
microseconds) plus ``z >= sum (hidden - backward) * x``, ``z >= 0`` (the gradient
reductions the backward does not hide), under ``sum memory * x + w <= capacity`` with ``w``
at least the ``sum peak * x`` of each phase some choice could overfill (a recomputed
layer's backward, an op's cotangents, the gradient reduction:
:attr:`~jscaler.search.problem.Problem.peaks`; :meth:`Milp.binding_phases`),
memory terms rounded to :func:`~jscaler.search.problem.memory_unit` as
:func:`~jscaler.search.problem.fits_at_all` counts them. A tied parameter read in different
layouts adds ``d[t, s] >= x[first, s] - sum x[reader, agreeing]`` and its
:class:`~jscaler.search.problem.Tied` costs. An activation a reader may keep gathered
(:class:`~jscaler.search.problem.Regather`) adds a ``g[v, layout]`` per layout, at least
the ``e`` of each reader's edge that gather it into that layout, its bytes in the memory
row: one copy per layout, however many readers share it. The LP relaxation of this model is tight on
most graphs, which is why an LP-based branch and bound solves paper-scale problems (tens
of thousands of variables) in seconds where a SAT search does not. So tight that the
relaxation alone often settles it: :meth:`Milp.solve` solves it first (dual simplex, no
presolve, in a second on the largest), and where its choice (each cluster's largest ``x``)
fits and costs within :data:`GAP` of its bound, that choice is returned as optimal, by the
same test HiGHS's branch and bound would stop at; the branch and bound runs only where it
does not (AlphaFold2 at 8 GPUs on DGX-1 in ``bench paper``: its five ILPs, 4.9-11.2 s each
on the 2-core machine, now 1.3-2.7 s; Swin's and T5's relaxations are 0.006-8% below
their optimum and pay 0.02-0.2 s for trying).

HiGHS stops at a work limit, not at a time: a wall-clock limit ends where the machine's
speed and load say, so one problem could get different answers on two hosts or two runs.
Its MIP solver checks its limits at fixed points of its (single-threaded, seeded) search,
and at each check :class:`_Work` adds the problem's size to the power 1.25 (its matrix's
nonzeros), a tenth of that once branching has begun (a node's checks come far closer
together than the root's cut rounds'): :data:`WORK` converts that to seconds, calibrated
on the 13 paper-scale problems of ``bench paper`` whose last limit check comes after half
a second on the 2-core machine CI runs on (its seconds over the work's: 0.59-2.35,
docs/cost-model.md). The same problem stops at the same check everywhere, so it gets the
same answer. A wall-clock limit of :data:`BACKSTOP` times the work limit stays behind it,
for a machine so slow or so loaded that the work would take far longer; an answer cut by
it says so (:attr:`Result.cut`), since another machine may end elsewhere.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass

import numpy as np

from jscaler.search.lookahead import solving
from jscaler.search.problem import Problem, memory_unit, objective, phase_totals

__all__ = ["Milp", "Result"]

US = 1e6  # objective unit: microseconds
GAP = 1e-4  # "optimal": within 0.01% of the LP bound (HiGHS's default)
WORK = 1.5e-7  # seconds per unit of work (nonzeros ** 1.25 per limit check at the root)
TREE = 0.1  # a limit check's share of that once branching has begun
BACKSTOP = 3.0  # the wall-clock limit, in work limits
RELAX_ITERATIONS = 4  # the relaxation's simplex iterations, per row of the model


@dataclass(frozen=True)
class Result:
    """One HiGHS run: the choice it found (None: none), whether it is proven optimal, and
    what cut it short: ``""`` (nothing), ``"work"`` (the work limit: the same on every
    machine) or ``"wall clock"`` (the backstop: another machine may end elsewhere);
    ``relaxed``: found by the LP relaxation alone (:meth:`Milp.solve`)."""

    choice: tuple[int, ...] | None
    optimal: bool
    infeasible: bool
    cut: str = ""
    relaxed: bool = False  # the LP relaxation's choice, within GAP of its bound (no branching)


class Milp:
    """The model of a problem, every constraint but the phases' built once; :meth:`solve`
    adds the phases it is given (:meth:`binding_phases`)."""

    def __init__(self, p: Problem):
        self.p = p
        self.offset, n = [], 0
        for st in p.strategies:
            self.offset.append(n)
            n += len(st)
        self.nx = n
        self.unit = memory_unit(p.capacity) if p.capacity is not None else 1
        cost = [p.node[c][s] * US for c, st in enumerate(p.strategies) for s in range(len(st))]
        rows: list[list[tuple[int, float]]] = []
        lo: list[float] = []
        hi: list[float] = []

        def row(entries, low, high):
            rows.append(entries)
            lo.append(low)
            hi.append(high)

        x = self.x
        for c, st in enumerate(p.strategies):
            row([(x(c, s), 1.0) for s in range(len(st))], 1.0, 1.0)
        # regathered values: per edge (producer, reader), (value, layout, producer
        # strategies making it smaller than that layout, reader strategies reading it so)
        wants = [_gather_sets(r) for r in p.regathers]  # per value: (layout, I, [(b, J)])
        gathers: dict[tuple[int, int], list] = {}
        for k, (r, sets) in enumerate(zip(p.regathers, wants)):
            for spec, smaller, reads in sets:
                for c, js in reads:
                    if js and smaller:
                        gathers.setdefault((r.cluster, c), []).append((k, spec, smaller, js))
        pairs: dict[tuple, set[int]] = {}  # (value, layout, reader) -> e variables covered
        for (a, b), mat in sorted(p.edges.items()):
            marks = gathers.get((a, b), ())
            ia = _alike([(*r, *(i in m[2] for m in marks)) for i, r in enumerate(mat)])
            cols = list(zip(*mat))
            ib = _alike([(*c, *(j in m[3] for m in marks)) for j, c in enumerate(cols)])
            first, na, nb = n, len(ia), len(ib)
            n += na * nb
            cost += [mat[i[0]][j[0]] * US for i in ia for j in ib]
            for k, i in enumerate(ia):
                out = [(first + k * nb + c, 1.0) for c in range(nb)]
                row(out + [(x(a, s), -1.0) for s in i], 0, 0)
            for c, j in enumerate(ib):
                into = [(first + k * nb + c, 1.0) for k in range(na)]
                row(into + [(x(b, s), -1.0) for s in j], 0, 0)
            for v, spec, smaller, reads in marks:
                pairs.setdefault((v, spec, b), set()).update(
                    first + k * nb + c
                    for k, i in enumerate(ia)
                    if i[0] in smaller
                    for c, j in enumerate(ib)
                    if j[0] in reads
                )
        self.apart = []  # per tied parameter: its d variables per strategy
        for tie in p.tied:
            d = list(range(n, n + len(tie.seconds)))
            n += len(d)
            cost += [v * US for v in tie.seconds]
            for s, v in enumerate(d):
                for c, same in tie.agree:
                    row([(v, 1.0), (x(tie.cluster, s), -1.0)] + [(x(c, j), 1.0) for j in same[s]],
                        0.0, np.inf)  # fmt: skip
            self.apart.append(d)
        # per regathered value, {layout: its g variable}: g >= the e variables of each
        # reader's edge where the reader reads it in that layout and its producer makes it
        # smaller (the pair products: as tight as the edges' own rows); without an edge,
        # g >= x[reader, J] + x[producer, I] - 1
        self.gathered = []
        for k, (r, sets) in enumerate(zip(p.regathers, wants)):
            gs = {}
            for spec, smaller, reads in sets:
                gs[spec] = n
                n += 1
                cost.append(0.0)
                for c, js in reads:
                    if not js or not smaller:
                        continue
                    if (r.cluster, c) in p.edges:
                        es = sorted(pairs.get((k, spec, c), ()))
                        row([(gs[spec], 1.0)] + [(e, -1.0) for e in es], 0.0, np.inf)
                    else:
                        both = [(x(c, j), -1.0) for j in sorted(js)]
                        both += [(x(r.cluster, i), -1.0) for i in sorted(smaller)]
                        row([(gs[spec], 1.0), *both], -1.0, np.inf)
            self.gathered.append(gs)
        self.z, self.w = n, n + 1
        n += 2
        cost += [1.0, 0.0]
        gap = [(x(c, s), -(p.hidden[c][s] - p.backward[c][s]) * US) for c, s in self._pairs()]
        row([(self.z, 1.0), *gap], 0.0, np.inf)
        if p.capacity is not None:
            kept = [(x(c, s), self._units(p.memory[c][s])) for c, s in self._pairs()]
            kept += self._ties("kept")
            kept += [
                (gs[spec], self._units(b))
                for r, gs in zip(p.regathers, self.gathered)
                for spec, b in r.options().items()
            ]
            row([*kept, (self.w, 1.0)], -np.inf, float(p.capacity // self.unit))
        self.n, self.cost, self.rows, self.lo, self.hi = n, np.array(cost), rows, lo, hi

    def x(self, c: int, s: int) -> int:
        return self.offset[c] + s

    def _pairs(self):
        return ((c, s) for c, st in enumerate(self.p.strategies) for s in range(len(st)))

    def _units(self, b: float) -> float:
        return float(round(b / self.unit))

    def _ties(self, what: str) -> list[tuple[int, float]]:
        return [
            (v, self._units(b))
            for tie, d in zip(self.p.tied, self.apart)
            for v, b in zip(d, getattr(tie, what))
        ]

    def binding_phases(self) -> list[int]:
        """The phases some choice could overfill: those whose fullest choice per cluster,
        kept and phase bytes together, exceeds the capacity (the rest never bind)."""
        p = self.p
        if p.capacity is None:
            return []
        cap = p.capacity // self.unit
        _, totals = phase_totals(p.memory, p.peaks, self._units, max)
        ties = sum(max([0.0, *(self._units(b) for b in t.kept)]) for t in p.tied)
        ties += sum(self._units(b) for r in p.regathers for b in r.options().values())
        grads = sum(max([0.0, *(self._units(b) for b in t.held)]) for t in p.tied)
        last = len(totals) - 1
        return [k for k, t in enumerate(totals) if t + ties + (grads if k == last else 0.0) > cap]

    def phase(self, k: int) -> list[tuple[int, float]]:
        """``w - sum peak * x >= 0`` of phase ``k`` (the last: the gradient reduction,
        with the tied parameters' gradients)."""
        p = self.p
        held = [
            (self.x(c, s), self._units(b)) for c, r in p.peaks[k].items() for s, b in enumerate(r)
        ]
        if k == len(p.peaks) - 1:
            held += self._ties("held")
        return [(self.w, 1.0)] + [(i, -v) for i, v in held]

    def solve(self, phases: list[int], work_limit: float) -> Result:
        """HiGHS on the model with ``phases`` (indices into the problem's peaks): its LP
        relaxation, and where that does not settle it (:meth:`_relaxation`), its branch and
        bound for at most ``work_limit`` seconds of work (:class:`_Work`)."""
        lp = self._lp(phases)
        relaxed = self._relaxation(lp, phases)
        if relaxed is not None:
            return relaxed
        return self._branch_and_bound(lp, work_limit)

    def _lp(self, phases: list[int]):
        """The model with ``phases`` as HiGHS's column-wise ``HighsLp``."""
        import highspy

        rows = self.rows + [self.phase(k) for k in phases]
        r = np.array([i for i, entries in enumerate(rows) for _ in entries], dtype=np.int32)
        cols = np.array([j for entries in rows for j, _ in entries], dtype=np.int32)
        vals = np.array([v for entries in rows for _, v in entries])
        order = np.argsort(cols, kind="stable")  # column-wise
        start = np.searchsorted(cols[order], np.arange(self.n + 1)).astype(np.int32)
        upper = np.ones(self.n)
        upper[self.z] = np.inf
        upper[self.w] = float(self.p.capacity // self.unit) if self.p.capacity else 0.0
        lp = highspy.HighsLp()
        lp.num_col_, lp.num_row_ = self.n, len(rows)
        lp.col_cost_, lp.col_lower_, lp.col_upper_ = self.cost, np.zeros(self.n), upper
        lp.row_lower_ = np.array(self.lo + [0.0] * len(phases))
        lp.row_upper_ = np.array(self.hi + [np.inf] * len(phases))
        lp.a_matrix_.format_ = highspy.MatrixFormat.kColwise
        lp.a_matrix_.start_, lp.a_matrix_.index_ = start, r[order]
        lp.a_matrix_.value_ = vals[order]
        kinds = [highspy.HighsVarType.kContinuous] * self.n
        kinds[: self.nx] = [highspy.HighsVarType.kInteger] * self.nx
        lp.integrality_ = kinds
        return lp

    def _relaxation(self, lp, phases: list[int]) -> Result | None:
        """The LP relaxation first (dual simplex, no presolve, an iteration limit: as
        deterministic as the MIP's work limit): where each cluster's largest ``x``, the
        relaxation's choice, fits and costs within :data:`GAP` of the relaxation's bound,
        it is as optimal as HiGHS's branch and bound would prove (the same gap), found in
        a fraction of its time. ``None``: the branch and bound must decide."""
        import highspy

        h = _silent_highs()
        h.setOptionValue("solve_relaxation", True)
        h.setOptionValue("presolve", "off")
        h.setOptionValue("simplex_iteration_limit", RELAX_ITERATIONS * lp.num_row_)
        h.passModel(lp)
        with solving():
            h.run()
        status = h.getModelStatus()
        if status == highspy.HighsModelStatus.kInfeasible:
            return Result(None, False, True)
        if status != highspy.HighsModelStatus.kOptimal:
            return None
        bound = h.getInfo().objective_function_value
        choice = self._choice(h)
        if not self.fits(choice, phases):
            return None
        cost = objective(self.p, list(choice))[0] * US
        return (
            Result(choice, True, False, relaxed=True) if cost - bound <= GAP * abs(cost) else None
        )

    def fits(self, choice: tuple[int, ...], phases: list[int]) -> bool:
        """Whether ``choice`` meets the model's memory rows (kept bytes and ``phases``, in
        the solver's units)."""
        p = self.p
        if p.capacity is None:
            return True
        kept = sum(self._units(p.memory[c][s]) for c, s in enumerate(choice))
        kept += sum(self._units(b) for r in p.regathers for b in r.layouts(choice).values())
        grads = 0.0  # tied parameters read apart: their gradients join the last phase
        for tie in (t for t in p.tied if t.apart(choice)):
            kept += self._units(tie.kept[choice[tie.cluster]])
            grads += self._units(tie.held[choice[tie.cluster]])
        last = len(p.peaks) - 1
        held = [
            sum(self._units(r[choice[c]]) for c, r in p.peaks[k].items())
            + (grads if k == last else 0.0)
            for k in phases
        ]
        return kept + max([0.0, *held]) <= p.capacity // self.unit

    def _branch_and_bound(self, lp, work_limit: float) -> Result:
        """HiGHS's MIP solver on ``lp`` for at most ``work_limit`` seconds of work."""
        import highspy

        h = _silent_highs()
        h.setOptionValue("time_limit", max(BACKSTOP * work_limit, 1.0))
        h.setOptionValue("mip_rel_gap", GAP)
        h.passModel(lp)
        work = _Work(len(lp.a_matrix_.value_), work_limit)
        h.setCallback(work, None)
        h.startCallback(highspy.cb.HighsCallbackType.kCallbackMipInterrupt)
        with solving():  # HiGHS releases the interpreter: a search's lookahead runs
            h.run()
        status = h.getModelStatus()
        cut = {
            highspy.HighsModelStatus.kInterrupt: "work",
            highspy.HighsModelStatus.kTimeLimit: "wall clock",
        }.get(status, "")
        if status == highspy.HighsModelStatus.kInfeasible:
            return Result(None, False, True)
        if h.getInfo().primal_solution_status != highspy.SolutionStatus.kSolutionStatusFeasible:
            return Result(None, False, False, cut)
        return Result(self._choice(h), status == highspy.HighsModelStatus.kOptimal, False, cut)

    def _choice(self, h) -> tuple[int, ...]:
        """Each cluster's strategy of largest ``x`` in HiGHS's solution."""
        x = np.asarray(h.getSolution().col_value)
        return tuple(
            int(np.argmax(x[o : o + len(st)])) for o, st in zip(self.offset, self.p.strategies)
        )


class _Work:
    """HiGHS's MIP callback at each of its limit checks: adds the check's work and asks it
    to stop once ``limit`` seconds of work are done. The checks fall at fixed points of
    its search, so where it stops depends on the problem alone."""

    def __init__(self, nonzeros: int, limit: float):
        self.root = WORK * float(nonzeros) ** 1.25
        self.limit, self.done = limit, 0.0

    def __call__(self, kind, message, out, into, user) -> None:
        self.done += self.root * (TREE if out.mip_node_count > 0 else 1.0)
        if self.done >= self.limit:
            into.user_interrupt = True


def _gather_sets(r) -> list[tuple]:
    """Per layout regather ``r`` may keep a copy in: ``(layout, the producer's strategies
    making the value smaller than it, [(reader cluster, its strategies reading it so)])``,
    in the order of :meth:`~jscaler.search.problem.Regather.options`."""
    out = []
    for spec, b in r.options().items():
        smaller = frozenset(i for i, m in enumerate(r.made) if b > r.count * m)
        reads = [
            (c, frozenset(j for j, (sp, _) in enumerate(per) if sp == spec)) for c, per in r.readers
        ]
        out.append((spec, smaller, reads))
    return out


def _alike(mat) -> list[list[int]]:
    """The indices of ``mat``'s rows grouped by equal rows, in order of first appearance."""
    groups: dict[tuple, list[int]] = {}
    for i, r in enumerate(mat):
        groups.setdefault(tuple(r), []).append(i)
    return list(groups.values())


def _silent_highs():
    """A HiGHS instance that prints nothing (its first construction in a process writes a
    banner to file descriptor 1, not through Python, which would corrupt ``--json``
    output; it is sent to /dev/null), single-threaded and seeded."""
    import highspy

    sys.stdout.flush()
    saved = os.dup(1)
    try:
        with open(os.devnull, "w") as null:
            os.dup2(null.fileno(), 1)
            h = highspy.Highs()
            h.setOptionValue("output_flag", False)
            h.setOptionValue("threads", 1)  # deterministic: one thread, a fixed seed
            h.setOptionValue("random_seed", 0)
    finally:
        os.dup2(saved, 1)
        os.close(saved)
    return h
