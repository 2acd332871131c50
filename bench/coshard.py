"""``jscaler bench coshard``: coshard's activation memory against plain tensor parallelism.

nnScaler's claim for coshard: splitting a device's share of attention and MLP into
``colocate`` pieces run one after another (each recomputed) keeps one piece's
activations alive at a time, so the per-device peak drops below plain Megatron TP of the
same degree, and a lower TP degree (less communication) fits in the memory a higher one
needs. Every plan runs the whole batch without data parallelism on ``tp`` devices (the
model-parallel group a big model needs), so the rows differ only in how the model is
split. Per plan, from XLA's ``memory_analysis()`` of the compiled step: temporaries (the
activations and workspace of the step), the whole per-device footprint, collective bytes
from the HLO, and the median step time; ratios against plain Megatron at the same tp.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import optax

from bench.spmd import measure
from bench.table import columns


@dataclass
class Row:
    name: str
    tp: int
    temp: int
    memory: int
    comm: int
    step_s: float


def default_plans(n_devices: int) -> dict:
    from spaces import coshard, megatron

    plans = {}
    for tp in (2, 4, 8):
        if tp > n_devices:
            continue
        plans[f"megatron(tp={tp})"] = (tp, megatron(tp=tp, dp=1))
        for c in (2, 4):
            plans[f"coshard(tp={tp}, colocate={c})"] = (tp, coshard(tp=tp, colocate=c, dp=1))
    return plans


def run(model_name: str = "swin-bench", n_devices: int = 8, steps: int = 2, plans=None):
    """Each plan on its own tp devices (of at most ``n_devices``); returns the rows."""
    import jscaler
    import models

    spec = models.get(model_name)
    batch = spec.batch(spec.batch_size, 0)
    opt = optax.sgd(1e-3)
    rows, skipped = [], []
    for name, (tp, plan) in (plans or default_plans(n_devices)).items():
        try:
            trainer = jscaler.parallelize(
                spec.init(0), spec.loss, opt, batch, devices=tp, plan=plan
            )
        except jscaler.PlanError as e:  # e.g. more pieces than heads: not this model's plan
            skipped.append(f"{name}: skipped ({e})")
            continue
        temp = trainer.compiled(batch).memory_analysis().temp_size_in_bytes
        r = measure(name, trainer, batch, steps)
        rows.append(Row(name, tp, temp, r.memory, r.comm_bytes, r.step_s))
        jax.clear_caches()
    return spec, rows, skipped


def table(spec, rows: list[Row], skipped=()) -> str:
    plain = {r.tp: r for r in rows if r.name.startswith("megatron")}
    head = (
        f"{spec.name} ({spec.description}); batch {spec.batch_size}, no data parallelism: "
        f"each plan on tp simulated CPU devices; per device, per step"
    )
    cols = ["plan", "temp MB", "memory MB", "comm MB", "step ms", "temp/megatron", "mem/megatron"]
    data = [
        [
            r.name,
            f"{r.temp / 1e6:.2f}",
            f"{r.memory / 1e6:.2f}",
            f"{r.comm / 1e6:.2f}",
            f"{r.step_s * 1e3:.0f}",
            f"{r.temp / plain[r.tp].temp:.2f}",
            f"{r.memory / plain[r.tp].memory:.2f}",
        ]
        for r in rows
    ]
    lines = [head, "", *columns(cols, data)]
    lines.append("")
    lines += _fits(rows, plain)
    lines += list(skipped)
    return "\n".join(lines)


def _fits(rows, plain) -> list[str]:
    """Which coshard plans at a lower tp fit in the memory of plain Megatron at a higher."""
    out = []
    for r in rows:
        if not r.name.startswith("coshard"):
            continue
        for tp, p in sorted(plain.items()):
            if tp > r.tp:
                verdict = "fits in" if r.memory <= p.memory else "does not fit in"
                ratio = r.comm / max(p.comm, 1)
                out.append(
                    f"{r.name}: {r.memory / 1e6:.2f} MB per device {verdict} megatron(tp={tp})'s "
                    f"{p.memory / 1e6:.2f} MB, with {ratio:.2f}x its collective bytes"
                )
    return out
