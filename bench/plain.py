"""``jscaler bench plain``: jscaler's plans against plain JAX as users write it.

For models nobody here wrote for jscaler (:mod:`bench.plain_models`), each jscaler plan
is paired with the plain-JAX step a user would write for the same layout
(:mod:`bench.plain_baselines`):

==========================================  ============================================
jscaler                                     plain JAX
==========================================  ============================================
``dp()``                                    ``plain dp`` (params replicated)
``zero(stage=3)``                           ``plain fsdp`` (largest axis over 8 devices)
``megatron(tp=8)``                          Megatron name rules, tp=8
``megatron(tp=4, dp=2, zero=3)``            fsdp x tp rules, dp=2 x tp=4
``plan="auto"``                             the fastest plain row of the model
==========================================  ============================================

Per row, per device: memory (XLA ``memory_analysis()``: arguments + outputs +
temporaries - aliased), collective bytes of the compiled HLO by kind, the median step
time with the plain and jscaler steps interleaved (one plain step, one jscaler step), the
loss after 3 AdamW updates (both sides start from the same parameters and see the same
batch: they must agree), and for jscaler the cost model's predicted memory and bytes.
Ratios compare each jscaler row with its plain counterpart. A plan that fails prints as
a row holding the error. Step times of simulated CPU devices sharing a few cores say
little about GPUs; memory and collective bytes are what the plans change.
"""

from __future__ import annotations

import gc
import json
import math
import statistics
import time
from dataclasses import asdict, dataclass, field

import jax
import optax

from bench.plain_baselines import BASELINES, label
from bench.plain_models import BUILDERS, BenchModel
from bench.table import columns, mb, times

WARM = 3  # untimed steps (the first compiles); the loss compared is the one after them
LOSS_RTOL = 1e-4
KINDS = ["all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute"]
# the targets: (pair, measure, bound): jscaler / plain counterpart <= bound
TARGETS = [
    ("dp", "memory", 1.0), ("dp", "comm", 1.0),
    ("zero3", "memory", 0.85), ("zero3", "comm", 1.6),
    ("tp", "memory", 1.0), ("tp", "comm", 0.8),
    ("fsdp_tp", "memory", 1.0), ("fsdp_tp", "comm", 0.8),
    *[(k, "time", 1.05) for k in ("dp", "zero3", "tp", "fsdp_tp", "auto")],
]  # fmt: skip


@dataclass
class Side:
    """One measured row: a plain step or a jscaler trainer."""

    name: str
    memory: int | None = None
    comm: dict[str, tuple[int, int]] = field(default_factory=dict)
    step_s: float | None = None
    loss: float | None = None  # after WARM updates
    loss1: float | None = None  # after one update
    pred_memory: int | None = None
    pred_comm: int | None = None
    error: str | None = None

    @property
    def comm_bytes(self) -> int:
        return sum(b for _, b in self.comm.values())


@dataclass
class Pair:
    model: str
    key: str  # "dp", "zero3", "tp", "fsdp_tp", "auto"
    plain: Side
    jscaler: Side
    plain_kind: str = ""  # the baseline's key in BASELINES

    def ratio(self, what: str) -> float | None:
        """jscaler / plain for ``"memory"``, ``"comm"`` or ``"time"`` (None: a side failed)."""
        if self.plain.error or self.jscaler.error:
            return None
        get = {
            "memory": lambda s: s.memory,
            "comm": lambda s: s.comm_bytes,
            "time": lambda s: s.step_s,
        }[what]
        a, b = get(self.jscaler), get(self.plain)
        if a is None or b is None:
            return None
        return a / b if b else (1.0 if a == 0 else math.inf)

    @property
    def loss_rel(self) -> float | None:
        if self.plain.loss is None or self.jscaler.loss is None:
            return None
        return abs(self.jscaler.loss - self.plain.loss) / max(abs(self.plain.loss), 1e-30)


def default_pairs(n: int):
    """``[(key, baseline kind or None for the fastest, jscaler label, plan)]``."""
    from spaces import dp, megatron, zero

    return [
        ("dp", "dp", "jscaler dp()", dp()),
        ("zero3", "fsdp", "jscaler zero(stage=3)", zero(stage=3)),
        ("tp", "tp", f"jscaler megatron(tp={n})", megatron(tp=n)),
        ("fsdp_tp", "fsdp_tp", f"jscaler megatron(tp={n // 2}, dp=2, zero=3)",
         megatron(tp=n // 2, dp=2, zero=3)),
        ("auto", None, 'jscaler plan="auto"', "auto"),
    ]  # fmt: skip


def _error(e: BaseException) -> str:
    msg = " ".join(str(e).split())
    return f"{type(e).__name__}: {msg[:300]}{'...' if len(msg) > 300 else ''}"


def _static(side: Side, runner, batch, mesh_axes) -> None:
    """Memory and collectives of the compiled step."""
    from jscaler.compile.hlo import collectives, summarize

    compiled = runner.compiled(batch)
    mem = compiled.memory_analysis()
    side.memory = (
        mem.argument_size_in_bytes
        + mem.output_size_in_bytes
        + mem.temp_size_in_bytes
        - mem.alias_size_in_bytes
    )
    side.comm = summarize(collectives(compiled.as_text(), mesh_axes))


def plain_side(side: Side, bm: BenchModel, kind: str, opt, n: int):
    try:
        params, loss = bm.plain()
        runner = BASELINES[kind](params, loss, opt, bm.batch, n, bm.rules)
        _static(side, runner, bm.batch, tuple(runner.mesh.shape.items()))
        return runner
    except Exception as e:  # noqa: BLE001  a failing baseline is a row, not a crash
        side.error = _error(e)
        return None


def jscaler_side(side: Side, bm: BenchModel, plan, opt, n: int):
    import jscaler

    try:
        trainer = jscaler.parallelize(bm.make(), bm.loss, opt, bm.batch, devices=n, plan=plan)
        _static(side, trainer, bm.batch, trainer.plan.mesh.axes)
    except Exception as e:  # noqa: BLE001  a failing plan is a row, not a crash
        side.error = _error(e)
        return None
    try:
        side.pred_memory = trainer.estimate("cpu").memory["total"]
        side.pred_comm = trainer.comm_table().total_bytes
    except Exception:  # noqa: BLE001  no prediction for this program: the cells show "-"
        pass
    return trainer


def _interleave(sides: list[tuple[Side, object]], batch, steps: int, warm: int = WARM) -> None:
    """``warm`` untimed steps then ``steps`` timed ones, one step of each runner in turn."""
    times: dict[int, list[float]] = {id(s): [] for s, _ in sides}
    for i in range(warm + steps):
        for side, runner in sides:
            if side.error:
                continue
            try:
                start = time.perf_counter()
                loss = runner.step(batch)["loss"]
                elapsed = time.perf_counter() - start
            except Exception as e:  # noqa: BLE001
                side.error = _error(e)
                continue
            if i == 1:
                side.loss1 = loss
            if i == warm:
                side.loss = loss
            if i >= warm:
                times[id(side)].append(elapsed)
    for side, _ in sides:
        if times[id(side)] and not side.error:
            side.step_s = statistics.median(times[id(side)])


def measure_pair(bm: BenchModel, key, kind, name, plan, opt, n: int, steps: int) -> Pair:
    plain = Side(label(kind, n))
    p_runner = plain_side(plain, bm, kind, opt, n)
    js = Side(name)
    j_runner = jscaler_side(js, bm, plan, opt, n)
    _interleave([(s, r) for s, r in ((plain, p_runner), (js, j_runner)) if r], bm.batch, steps)
    del p_runner, j_runner
    jax.clear_caches()
    gc.collect()
    return Pair(bm.name, key, plain, js, kind)


def run_model(bm: BenchModel, n: int = 8, steps: int = 5, pairs=None, log=None) -> list[Pair]:
    """Every pair of ``pairs`` (default :func:`default_pairs`) on one model; the auto
    pair's plain side is the model's fastest plain baseline, run again."""
    opt = optax.adamw(1e-3)
    out = []
    for key, kind, name, plan in pairs or default_pairs(n):
        if kind is None:
            done = [p for p in out if p.plain.step_s is not None and p.key != "auto"]
            if not done:
                none = Side("best plain", error="no plain row ran")
                out.append(Pair(bm.name, key, none, Side(name, error="not run: no plain row")))
                continue
            kind = min(done, key=lambda p: p.plain.step_s).plain_kind
        pair = measure_pair(bm, key, kind, name, plan, opt, n, steps)
        if key == "auto":
            pair.plain.name = f"best plain: {pair.plain.name}"
        out.append(pair)
        if log:
            log(f"  {bm.name} {key}: done")
    return out


def run(names=None, small: bool = False, n: int = 8, steps: int = 5, pairs=None, log=None):
    """``{model name: (BenchModel, [Pair])}`` for the models ``names`` (default all)."""
    results = {}
    for name in names or BUILDERS:
        bm = BUILDERS[name](small)
        results[name] = (bm, run_model(bm, n, steps, pairs, log))
    return results


# ---- output ----------------------------------------------------------------------------------


def _row(side: Side, pair: Pair | None) -> tuple[list[str], str]:
    if side.error:
        return [side.name, *["-"] * 14], f"ERROR {side.error}"
    cells = [
        side.name,
        mb(side.memory),
        mb(side.comm_bytes),
        *[mb(side.comm.get(k, (0, 0))[1]) for k in KINDS],
        "-" if side.step_s is None else f"{side.step_s * 1e3:.0f}",
        "-" if side.loss is None else f"{side.loss:.6f}",
        mb(side.pred_memory),
        mb(side.pred_comm),
    ]
    if pair is None:
        return [*cells, "", "", ""], ""
    rel = pair.loss_rel
    note = "" if rel is None else ("loss ok" if rel <= LOSS_RTOL else "LOSS MISMATCH")
    note += "" if rel is None else f" (rel diff {rel:.1e})"
    return [*cells, *(times(pair.ratio(w)) for w in ("memory", "comm", "time"))], note


def table(bm: BenchModel, pairs: list[Pair], n: int) -> list[str]:
    cols = [
        "row", "mem MB", "comm MB", "AR", "AG", "RS", "A2A", "perm", "step ms",
        "loss@3", "pred mem", "pred comm", "mem x", "comm x", "time x",
    ]  # fmt: skip
    data, notes = [], []
    for pair in pairs:
        for side, p in ((pair.plain, None), (pair.jscaler, pair)):
            cells, note = _row(side, p)
            data.append(cells)
            notes.append(note)
    lines = columns(cols, data)
    head = [f"{bm.name}: {bm.description}; {n} simulated CPU devices; per device, per step", ""]
    return head + [lines[0], lines[1]] + [f"{a}  {b}".rstrip() for a, b in zip(lines[2:], notes)]


def targets(pairs: list[Pair]) -> list[tuple[str, str, str, float | None, float, bool | None]]:
    """``[(model, jscaler row, measure, ratio, bound, met)]`` for the issue's targets."""
    by_key = {p.key: p for p in pairs}
    out = []
    for key, what, bound in TARGETS:
        if key in by_key:
            p = by_key[key]
            r = p.ratio(what)
            out.append((p.model, p.jscaler.name, what, r, bound, None if r is None else r <= bound))
    return out


def target_lines(results) -> list[str]:
    data = []
    for _, pairs in results.values():
        for model, name, what, r, bound, met in targets(pairs):
            verdict = "n/a (a side failed)" if met is None else ("met" if met else "MISSED")
            data.append(
                [model, name.removeprefix("jscaler "), what, times(r), f"<= {bound}x", verdict]
            )
    return columns(["model", "jscaler", "measure", "ratio", "target", ""], data, left=3)


def main(args) -> int:
    n = args.devices or 8
    names = [args.model] if args.model else None
    if args.model and args.model not in BUILDERS:
        raise SystemExit(f"bench plain: unknown --model {args.model!r}; one of {list(BUILDERS)}")
    log = None if args.json else (lambda s: print(s, flush=True))
    results = run(names, small=args.small, n=n, steps=args.steps, log=log)
    if args.json:
        rows = [asdict(p) for _, pairs in results.values() for p in pairs]
        print(json.dumps(rows, indent=1))
        return 0
    for bm, pairs in results.values():
        print()
        print("\n".join(table(bm, pairs, n)))
    print("\ntargets (jscaler / plain counterpart):")
    print("\n".join(target_lines(results)))
    return 0
