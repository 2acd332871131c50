"""``jscaler bench moe``: expert parallelism on ``moe-small`` against plain JAX.

The registered ``moe-small`` (capacity dispatch, 8 experts, top-2; ``--small``:
``moe-tiny``; ``--model moe-small-dropless``: the same model dispatching with
``ragged_dot``) trained under jscaler's ``expert`` plans beside the plain-JAX steps a user
would write (:mod:`bench.plain_baselines`): experts split by name rules over an expert
axis with GSPMD propagating the rest, and plain data parallelism. Per row, per device:
memory, collective bytes by kind, step time, the loss after 3 AdamW steps (both sides
must agree), the cost model's predictions, and ratios against the plain row of the pair
(:func:`bench.plain.measure_pair`, the same measurement as ``bench plain``).

Target (issue 23): the best expert plan's collective bytes <= 0.8x the plain expert
rules' at no more memory.
"""

from __future__ import annotations

import optax
from jax.sharding import PartitionSpec as P

from bench.plain import measure_pair, table
from bench.plain_models import BenchModel, registered
from bench.table import columns

EXPERT_RULES = [(r"moe/w_(gate|up|down)$", P("tp"))]  # the plain mesh's second axis: ep
COMM_BOUND, MEMORY_BOUND = 0.8, 1.0


def moe_model(small: bool, name: str | None = None) -> BenchModel:
    """The registered MoE model ``name`` (default ``moe-small``; ``small``: its tiny
    config, ``moe-tiny`` or ``moe-tiny-dropless``)."""
    name = name or "moe-small"
    if small:
        name = name.replace("-small", "-tiny")
    return registered(name, name, EXPERT_RULES)


def pairs(n: int):
    """``[(key, baseline kind, jscaler label, plan)]``: dp against plain dp; expert plans
    against the plain expert rules at ep=4."""
    from spaces import dp, expert

    return [
        ("dp", "dp", "jscaler dp()", dp()),
        ("ep", "ep", f"jscaler expert(ep=4, dp={n // 4})", expert(ep=4, dp=n // 4)),
        ("ep", "ep", f"jscaler expert(ep=2, dp={n // 2})", expert(ep=2, dp=n // 2)),
        ("ep", "ep", f"jscaler expert(ep=4, dp={n // 8}, tp=2)", expert(ep=4, tp=2)),
    ]


def run(small: bool = False, n: int = 8, steps: int = 5, log=None, model: str | None = None):
    bm = moe_model(small, model)
    opt = optax.adamw(1e-3)
    out = []
    for key, kind, name, plan in pairs(n):
        out.append(measure_pair(bm, key, kind, name, plan, opt, n, steps))
        if log:
            log(f"  {bm.name} {name}: done")
    return bm, out


def target_lines(measured) -> list[str]:
    """The best expert plan (least collective bytes among those within the memory bound)
    against the plain expert rules."""
    ok = [
        p
        for p in measured
        if p.key == "ep" and p.ratio("comm") is not None and p.ratio("memory") is not None
    ]
    if not ok:
        return ["target: n/a (no expert pair ran on both sides)"]
    best = min(ok, key=lambda p: (p.ratio("memory") > MEMORY_BOUND, p.ratio("comm")))
    comm, mem = best.ratio("comm"), best.ratio("memory")
    met = comm <= COMM_BOUND and mem <= MEMORY_BOUND
    data = [
        [
            best.jscaler.name.removeprefix("jscaler "),
            f"{comm:.2f}x <= {COMM_BOUND}x",
            f"{mem:.2f}x <= {MEMORY_BOUND}x",
            "met" if met else "MISSED",
        ]
    ]
    return columns(["best expert plan", "comm vs plain rules", "memory vs plain rules", ""], data)


def main(args) -> int:
    n = args.devices or 8
    log = None if args.json else (lambda s: print(s, flush=True))
    bm, measured = run(small=args.small, n=n, steps=args.steps, log=log, model=args.model)
    if args.json:
        import json
        from dataclasses import asdict

        print(json.dumps([asdict(p) for p in measured], indent=1))
        return 0
    print()
    print("\n".join(table(bm, measured, n)))
    print("\ntarget (issue 23):")
    print("\n".join(target_lines(measured)))
    return 0
