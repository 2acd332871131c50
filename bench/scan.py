"""``jscaler bench scan``: a model with its layers in a list and the same model scanned.

:mod:`bench.scan_models`' plain-JAX Llama (GQA, SwiGLU, RoPE; d 512, 4 layers, seq 256,
batch 16, vocab 8192; ``--small``: d 64, 2 layers), written twice: ``llama-list`` loops
over a list of per-layer dicts, ``llama-scan`` runs ``jax.lax.scan`` over the same
parameters stacked. Per plan, on 8 simulated devices with AdamW: per-device memory (XLA
``memory_analysis``) and collective bytes executed per step (compiled HLO; a collective
inside the loop counts once per iteration) of both, their ratio, the plain-JAX layout a
user would write for the scanned model (its name rules with a leading ``None`` for the
stacked leaves), and the cost model's errors on the scanned row. The targets: on the scan,
memory <= 1.10x and bytes <= 1.05x the list twin's under every plan; megatron(tp=8) <=
1.05x the plain rules' memory; predicted memory within 10% and bytes within 5% of XLA.
"""

from __future__ import annotations

import gc
import json
from dataclasses import asdict, dataclass

import jax
import optax

from bench.plain import Side, jscaler_side, plain_side
from bench.plain_baselines import label
from bench.plain_models import BUILDERS
from bench.table import columns, mb, percent, times

# (plan expression, the plain-JAX baseline beside it or None)
PLANS = [
    ("dp()", "dp"),
    ("zero(stage=1)", None),
    ("zero(stage=3)", "fsdp"),
    ("megatron(tp=8)", "tp"),
    ("megatron(tp=8, sp=True)", None),
    ("megatron(tp=4, dp=2, zero=3)", "fsdp_tp"),
    ("dp(recompute=1.0)", None),
]
BOUNDS = {"memory": 1.10, "comm": 1.05, "rules": 1.05, "pred_memory": 0.10, "pred_comm": 0.05}


@dataclass
class Row:
    plan: str
    listed: Side
    scanned: Side
    plain: Side | None

    def ratio(self, what: str) -> float | None:
        get = (lambda s: s.memory) if what == "memory" else (lambda s: s.comm_bytes)
        if self.listed.error or self.scanned.error:
            return None
        return get(self.scanned) / get(self.listed) if get(self.listed) else None

    def rules(self) -> float | None:
        if self.plain is None or self.plain.error or self.scanned.error:
            return None
        return self.scanned.memory / self.plain.memory

    def error(self, what: str) -> float | None:
        s = self.scanned
        pred, got = (s.pred_memory, s.memory) if what == "memory" else (s.pred_comm, s.comm_bytes)
        if s.error or pred is None or not got:
            return None
        return pred / got - 1


def run(small: bool = False, n: int = 8, plans=None, log=None) -> list[Row]:
    from spaces.parse import parse_plan

    listed, scanned = BUILDERS["llama-list"](small), BUILDERS["llama-scan"](small)
    opt = optax.adamw(1e-3)
    rows = []
    for expr, kind in plans or PLANS:
        sides = []
        for bm in (listed, scanned):
            side = Side(f"{bm.name} {expr}")
            jscaler_side(side, bm, parse_plan(expr), opt, n)
            sides.append(side)
        plain = None
        if kind is not None:
            plain = Side(label(kind, n))
            plain_side(plain, scanned, kind, opt, n)
        rows.append(Row(expr, *sides, plain))
        jax.clear_caches()
        gc.collect()
        if log:
            log(f"  {expr}: done")
    return rows


def table(rows: list[Row], small: bool, n: int) -> list[str]:
    bm = BUILDERS["llama-scan"](small)
    head = [
        f"bench scan: {bm.description}; {n} simulated devices, AdamW; per device: memory "
        "(MB, XLA), collective bytes per step (MB, compiled HLO, a loop's collectives once "
        "per iteration); plain: the plain-JAX layout on the scanned model; err: the cost "
        "model's prediction on the scanned row / XLA - 1",
        "",
    ]
    cols = [
        "plan", "list MB", "scan MB", "scan/list", "list comm", "scan comm", "comm x",
        "plain MB", "scan/plain", "mem err", "comm err",
    ]  # fmt: skip
    data = []
    for r in rows:
        p = r.plain
        data.append(
            [
                r.plan,
                mb(r.listed.memory),
                mb(r.scanned.memory),
                times(r.ratio("memory")),
                mb(None if r.listed.error else r.listed.comm_bytes),
                mb(None if r.scanned.error else r.scanned.comm_bytes),
                times(r.ratio("comm")),
                "-" if p is None else f"{mb(p.memory)} ({p.name})",
                times(r.rules()),
                percent(r.error("memory")),
                percent(r.error("comm")),
            ]
        )
    errors = [
        f"  {side.name}: {side.error}" for r in rows for side in (r.listed, r.scanned, r.plain)
        if side is not None and side.error
    ]  # fmt: skip
    return head + columns(cols, data) + (["", "errors:", *errors] if errors else [])


def targets(rows: list[Row]) -> list[tuple[str, float | None, float, bool | None]]:
    """(what, measured, bound, met) per target and row."""
    out = []
    for r in rows:
        for what, value, bound in (
            ("scan/list memory", r.ratio("memory"), BOUNDS["memory"]),
            ("scan/list bytes", r.ratio("comm"), BOUNDS["comm"]),
        ):
            out.append(
                (f"{r.plan} {what}", value, bound, None if value is None else value <= bound)
            )
        for what, key in (("memory", "pred_memory"), ("bytes", "pred_comm")):
            err = r.error("memory" if what == "memory" else "comm")
            met = None if err is None else abs(err) <= BOUNDS[key]
            out.append((f"{r.plan} predicted {what} error", err, BOUNDS[key], met))
        if r.plan == "megatron(tp=8)":
            value = r.rules()
            out.append(
                (f"{r.plan} scan / plain rules memory", value, BOUNDS["rules"],
                 None if value is None else value <= BOUNDS["rules"])
            )  # fmt: skip
    return out


def target_lines(rows: list[Row]) -> list[str]:
    lines = []
    for what, value, bound, met in targets(rows):
        state = "n/a" if met is None else "met" if met else "MISSED"
        shown = "-" if value is None else f"{value:+.1%}" if "error" in what else f"{value:.2f}x"
        limit = f"|err| <= {bound:.0%}" if "error" in what else f"<= {bound:.2f}x"
        lines.append(f"  {what}: {shown} ({limit}) {state}")
    return lines


def main(args) -> int:
    from spaces.parse import parse_plan

    n = args.devices or 8
    known = dict(PLANS)  # a standard plan keeps its plain-JAX counterpart
    plans = [(expr, known.get(expr)) for expr in args.plan] if args.plan else None
    for expr, _ in plans or ():
        parse_plan(expr)  # a bad --plan fails before anything runs
    log = None if args.json else (lambda s: print(s, flush=True))
    rows = run(args.small, n, plans, log)
    if args.json:
        print(json.dumps([asdict(r) for r in rows], indent=1))
        return 0
    print()
    print("\n".join(table(rows, args.small, n)))
    print("\ntargets:")
    print("\n".join(target_lines(rows)))
    return 0
