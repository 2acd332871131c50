"""``jscaler bench pipeline``: pipeline schedules, simulated and measured, in one run.

(a) Simulated bubbles: for each schedule (GPipe, 1F1B, interleaved 1F1B with 2 chunks,
ZB-H1) and a few (p stages, m micro-batches), the idle fraction that
:func:`jscaler.simulate` finds with unit costs (F = 1, B = 2, or B = W = 1 for a split
backward) beside GPipe's formula ``(p - 1) / (m + p - 1)`` and their ratio. No
compilation.

(b) Measured steps: one GPT trained with SGD on N simulated CPU devices, pipelined over
``pp`` stages (data parallelism over the remaining N / pp devices), by

* the MPMD runtime, ``jscaler.parallelize(..., plan=megatron(pp=pp), schedule=...)``:
  one program per stage and block kind, a Python driver walking the schedule; and
* the SPMD fast path, :func:`jscaler.spmd_pipeline`: one jitted step (embed ->
  ``spmd_pipeline`` over the blocks, stacked -> final norm -> LM head -> loss,
  ``value_and_grad``, SGD update) on a (data, stage) mesh; GPipe's order only.

Each row: the first step's loss and gradient norm (the same for every row, up to float
rounding: a check that they train the same model), the warm-up step's time (compiles)
and the median time of the timed steps, with its ratio to the SPMD fast path measured
in the same run. Simulated devices share the machine's cores, so the times compare the
runtimes' overheads more than they predict accelerator times.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from bench.table import columns

BUBBLE_CASES = ((4, 4), (4, 8), (4, 16))
MPMD_SCHEDULES = ("gpipe", "one_f_one_b", "interleaved_1f1b", "zero_bubble")


@dataclass
class BubbleRow:
    schedule: str
    p: int
    m: int
    bubble: float  # simulated idle fraction

    @property
    def formula(self) -> float:
        return (self.p - 1) / (self.m + self.p - 1)


@dataclass
class StepRow:
    runtime: str  # "mpmd" or "spmd"
    schedule: str
    microbatches: int
    loss: float  # first step's loss (before its update)
    grad_norm: float  # first step's gradient norm
    warmup_s: float
    step_s: float  # median of the timed steps


def _schedules():
    from schedules import gpipe, interleaved_1f1b, one_f_one_b, zero_bubble

    return {
        "gpipe": gpipe,
        "one_f_one_b": one_f_one_b,
        "interleaved_1f1b": interleaved_1f1b,  # chunks=2 by default
        "zero_bubble": zero_bubble,
    }


def simulated(cases=BUBBLE_CASES) -> list[BubbleRow]:
    """Part (a): every schedule at every (p, m), played by :func:`jscaler.simulate`."""
    import jscaler

    rows = []
    for name, make in _schedules().items():
        for p, m in cases:
            rows.append(BubbleRow(name, p, m, jscaler.simulate(make(p, m)).bubble()))
    return rows


def _timed(step, batch, steps: int) -> tuple[dict, float, float]:
    start = time.perf_counter()
    first = step(batch)
    warmup = time.perf_counter() - start
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        step(batch)
        times.append(time.perf_counter() - start)
    return first, warmup, statistics.median(times)


class SpmdGPTStep:
    """A GPT's SGD step with its blocks run by :func:`jscaler.spmd_pipeline`.

    The blocks' parameters are stacked along a leading layer axis (split over the mesh's
    ``stage`` axis); the embedding, final norm and LM head are replicated. The batch is
    split over ``data``; the embedding runs before the pipeline on each data shard, the
    final norm, LM head and loss after it with the batch split over every device.
    """

    def __init__(self, model, optimizer, batch, mesh: Mesh, microbatches: int, v: int = 1):
        import jscaler

        if not all(hasattr(model, a) for a in ("embed", "blocks", "norm_f", "lm_head")):
            raise TypeError("SpmdGPTStep needs a models.gpt.GPT (embed, blocks, norm_f, lm_head)")
        block_def, _ = nnx.split(model.blocks[0])
        stacked = jax.tree.map(lambda *a: jnp.stack(a), *[nnx.split(b)[1] for b in model.blocks])
        defs, params = {}, {"blocks": stacked}
        for name in ("embed", "norm_f", "lm_head"):
            defs[name], params[name] = nnx.split(getattr(model, name))

        def layer(lp, h):
            return nnx.merge(block_def, lp)(h)

        def loss_fn(params, batch):
            embed, norm_f, lm_head = (nnx.merge(defs[n], params[n]) for n in defs)
            h = embed(batch["tokens"])
            h = jscaler.spmd_pipeline(
                layer,
                params["blocks"],
                h,
                mesh=mesh,
                axis="stage",
                microbatches=microbatches,
                virtual_stages=v,
            )
            # after the pipeline, the head runs data parallel over every device
            h = jax.lax.with_sharding_constraint(h, NamedSharding(mesh, P(("data", "stage"))))
            logits = lm_head(norm_f(h)).astype(jnp.float32)
            return optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"]).mean()

        def step(params, opt_state, batch):
            loss, grads = jax.value_and_grad(loss_fn)(params, batch)
            updates, opt_state = optimizer.update(grads, opt_state, params)
            return optax.apply_updates(params, updates), opt_state, loss, optax.tree.norm(grads)

        shard = lambda spec: NamedSharding(mesh, spec)  # noqa: E731
        p_shard = {n: jax.tree.map(lambda _: shard(P()), params[n]) for n in defs}
        p_shard["blocks"] = jax.tree.map(lambda _: shard(P("stage")), stacked)
        self._b_shard = jax.tree.map(lambda _: shard(P("data")), batch)
        self.params = jax.device_put(params, p_shard)
        self.opt_state = jax.jit(optimizer.init)(self.params)
        self._fn = jax.jit(step, donate_argnums=(0, 1))

    def step(self, batch) -> dict[str, float]:
        b = jax.device_put(batch, self._b_shard)
        self.params, self.opt_state, loss, gnorm = self._fn(self.params, self.opt_state, b)
        return {"loss": float(loss), "grad_norm": float(gnorm)}


def measured(
    model_name: str = "gpt-tiny",
    n_devices: int = 8,
    pp: int = 4,
    microbatches: int | None = None,
    steps: int = 3,
    schedules=MPMD_SCHEDULES,
    lr: float = 1e-3,
):
    """Part (b): the SPMD fast path first (GPipe; circular with 2 virtual stages too when
    the layer count allows), then the MPMD runtime per schedule. Returns ``(spec, rows,
    skipped)``, ``skipped`` naming the schedules that do not fit ``(pp, m)`` and why."""
    import jscaler
    import models
    from spaces import megatron

    spec = models.get(model_name)
    m = microbatches or pp
    batch = spec.batch(spec.batch_size, 0)
    opt = optax.sgd(lr)
    if n_devices % pp:
        raise ValueError(f"{n_devices} devices do not split into {pp} pipeline stages")
    devs = np.array(jax.devices()[:n_devices]).reshape(n_devices // pp, pp)
    mesh = Mesh(devs, ("data", "stage"), axis_types=(AxisType.Auto,) * 2)
    rows = []
    n_layers = len(spec.init(0).blocks)
    spmd_variants = [(1, "gpipe")]
    if n_layers % (2 * pp) == 0 and m >= pp:
        spmd_variants.append((2, "gpipe circular (v=2)"))
    for v, label in spmd_variants:
        runner = SpmdGPTStep(spec.init(0), opt, batch, mesh, m, v)
        first, warm, med = _timed(runner.step, batch, steps)
        rows.append(StepRow("spmd", label, m, first["loss"], first["grad_norm"], warm, med))
        jax.clear_caches()
    all_schedules = _schedules()
    skipped = []
    for name in schedules:
        try:
            all_schedules[name](pp, m)
        except jscaler.ScheduleError as e:
            skipped.append(f"{name}: {e}")
            continue
        trainer = jscaler.parallelize(
            spec.init(0),
            spec.loss,
            opt,
            batch,
            devices=n_devices,
            plan=megatron(pp=pp),
            microbatches=m,
            schedule=all_schedules[name],
        )
        first, warm, med = _timed(trainer.step, batch, steps)
        rows.append(StepRow("mpmd", name, m, first["loss"], first["grad_norm"], warm, med))
        jax.clear_caches()
    return spec, rows, skipped


def run(
    model_name: str = "gpt-tiny",
    n_devices: int = 8,
    pp: int = 4,
    microbatches: int | None = None,
    steps: int = 3,
    schedules=MPMD_SCHEDULES,
):
    """Both parts; returns ``(spec, bubble_rows, step_rows, skipped)``."""
    bubbles = simulated()
    spec, rows, skipped = measured(model_name, n_devices, pp, microbatches, steps, schedules)
    return spec, bubbles, rows, skipped


def bubble_table(rows: list[BubbleRow]) -> str:
    lines = ["simulated bubble (unit costs F=1, B=2; B=W=1 when split) vs (p-1)/(m+p-1)", ""]
    data = [
        [
            r.schedule,
            str(r.p),
            str(r.m),
            f"{r.bubble:.3f}",
            f"{r.formula:.3f}",
            f"{r.bubble / r.formula:.2f}",
        ]
        for r in rows
    ]
    lines += columns(["schedule", "p", "m", "simulated", "formula", "ratio"], data)
    return "\n".join(lines)


def step_table(spec, rows: list[StepRow], n_devices: int, pp: int, skipped=()) -> str:
    base = rows[0]  # the SPMD fast path (GPipe)
    head = (
        f"{spec.name} ({spec.description}); batch {spec.batch_size}; {n_devices} simulated "
        f"CPU devices: pp={pp} x dp={n_devices // pp}; SGD"
    )
    data = [
        [
            r.runtime,
            r.schedule,
            str(r.microbatches),
            f"{r.loss:.6f}",
            f"{r.grad_norm:.6f}",
            f"{r.warmup_s:.1f}",
            f"{r.step_s * 1e3:.0f}",
            f"{r.step_s / base.step_s:.2f}",
        ]
        for r in rows
    ]
    cols = ["runtime", "schedule", "m", "first loss", "grad norm", "warm-up s", "step ms"]
    lines = [head, ""] + columns([*cols, "step/spmd"], data, left=2)
    losses = [r.loss for r in rows]
    spread = max(losses) - min(losses)
    same = np.allclose(losses, base.loss, rtol=1e-5, atol=0)
    lines += [
        "",
        f"first-step loss: spmd {base.loss:.6f}, spread over rows {spread:.2e} "
        f"({'same' if same else 'DIFFERENT'} within rtol 1e-5)",
    ]
    lines += [f"skipped {s}" for s in skipped]
    return "\n".join(lines)


def table(spec, bubbles, rows, n_devices: int, pp: int, skipped=()) -> str:
    return bubble_table(bubbles) + "\n\n" + step_table(spec, rows, n_devices, pp, skipped)
