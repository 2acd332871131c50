"""``jscaler bench spmd``: SPMD plans side by side with plain JAX, measured in one run.

For one model on N simulated devices, each row is a training step compiled from a plan
(or a baseline): per-device memory from XLA's ``memory_analysis()`` (arguments + outputs
+ temporaries - aliased), collective bytes per step read from the compiled HLO (per
device, by kind), and the median step time. Ratios compare against plain JAX with
Megatron name rules (the bar to clear) and plain ``jax.jit`` data parallelism.

On simulated CPU devices that share two cores, step times say little about GPUs; memory
and collective bytes are what the plans change.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

import jax
import optax

from bench.plain_jax import plain_dp, plain_rules
from bench.table import columns
from jscaler.compile.hlo import collectives, summarize


@dataclass
class Row:
    name: str
    memory: int
    comm: dict[str, tuple[int, int]]
    step_s: float
    predicted: int | None = None  # the plan's comm table, bytes per device per step

    @property
    def comm_bytes(self) -> int:
        return sum(b for _, b in self.comm.values())


def measure(name, runner, batch, steps: int) -> Row:
    compiled = runner.compiled(batch)
    mem = compiled.memory_analysis()
    memory = (
        mem.argument_size_in_bytes
        + mem.output_size_in_bytes
        + mem.temp_size_in_bytes
        - mem.alias_size_in_bytes
    )
    mesh = runner.plan.mesh.axes if hasattr(runner, "plan") else None
    comm = summarize(collectives(compiled.as_text(), mesh))
    runner.step(batch)  # warm-up (compiles the executable proper)
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        runner.step(batch)
        times.append(time.perf_counter() - start)
    predicted = runner.comm_table().total_bytes if hasattr(runner, "comm_table") else None
    return Row(name, memory, comm, statistics.median(times), predicted)


def default_plans():
    from spaces import coshard, dp, megatron, ring, ulysses, usp, zero

    return {
        "jscaler dp": dp(),
        "jscaler zero(3)": zero(3),
        "jscaler megatron(tp=8)": megatron(tp=8),
        "jscaler megatron(tp=8, sp)": megatron(tp=8, sp=True),
        "jscaler megatron(tp=8, regions)": megatron(tp=8, regions=True),
        "jscaler megatron(tp=4, dp=2)": megatron(tp=4, dp=2),
        "jscaler megatron(tp=4, dp=2, sp)": megatron(tp=4, dp=2, sp=True),
        "jscaler coshard(tp=4, colocate=2, dp=2)": coshard(tp=4, colocate=2, dp=2),
        "jscaler ulysses(sp=8)": ulysses(sp=8),
        "jscaler ring(sp=8)": ring(sp=8),
        "jscaler usp(ulysses=2, ring=4)": usp(ulysses=2, ring=4),
        "jscaler megatron(tp=8, bf16)": megatron(tp=8, precision="bf16"),
    }


def run(model_name: str = "gpt-small", n_devices: int = 8, steps: int = 3, plans=None):
    """Measures baselines and plans; returns the rows (baselines first)."""
    import jscaler
    import models

    spec = models.get(model_name)
    batch = spec.batch(spec.batch_size, 0)
    opt = optax.sgd(1e-3)
    rows = [
        measure(
            "plain jit dp", plain_dp(spec.init(0), spec.loss, opt, batch, n_devices), batch, steps
        ),
        measure(
            f"plain rules tp={n_devices}",
            plain_rules(spec.init(0), spec.loss, opt, batch, 1, n_devices),
            batch,
            steps,
        ),
        measure(
            f"plain rules tp={n_devices // 2}, dp=2",
            plain_rules(spec.init(0), spec.loss, opt, batch, 2, n_devices // 2),
            batch,
            steps,
        ),
    ]
    for name, plan in (plans or default_plans()).items():
        trainer = jscaler.parallelize(
            spec.init(0), spec.loss, opt, batch, devices=n_devices, plan=plan
        )
        rows.append(measure(name, trainer, batch, steps))
        jax.clear_caches()
    return spec, rows


def table(spec, rows: list[Row], n_devices: int) -> str:
    base_rules = rows[1]
    base_dp = rows[0]
    kinds = ["all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute"]
    head = (
        f"{spec.name} ({spec.description}); batch {spec.batch_size}; {n_devices} simulated "
        f"CPU devices; per device, per step"
    )
    cols = [
        "plan",
        "memory MB",
        "comm MB",
        "predicted",
        *[k.replace("collective-", "") for k in kinds],
        "step ms",
        "comm/rules",
        "mem/rules",
        "mem/dp",
    ]
    lines = [head, ""]
    data = []
    for r in rows:
        data.append(
            [
                r.name,
                f"{r.memory / 1e6:.1f}",
                f"{r.comm_bytes / 1e6:.1f}",
                "-" if r.predicted is None else f"{r.predicted / 1e6:.1f}",
                *[f"{r.comm.get(k, (0, 0))[1] / 1e6:.1f}" for k in kinds],
                f"{r.step_s * 1e3:.0f}",
                f"{r.comm_bytes / max(base_rules.comm_bytes, 1):.2f}",
                f"{r.memory / base_rules.memory:.2f}",
                f"{r.memory / base_dp.memory:.2f}",
            ]
        )
    lines.extend(columns(cols, data))
    return "\n".join(lines)
