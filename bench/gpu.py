"""``jscaler bench gpu``: the cost model's step time and memory against one accelerator.

``bench cost`` holds the memory and collective predictions to XLA on simulated CPU
devices; CPU step times say nothing about a GPU. This benchmark runs where an accelerator
is: on the first local device, each case's training step (SGD) is compiled and timed
(median of ``--steps`` steps after the compiling one; each step waits for its loss), and
held beside the cost model's prediction on the cluster preset of that device
(``h100_sxm``, ``h200``, ``a100_80g``; ``--cluster`` names another). Per row: measured
and predicted step time, MFU (the model's FLOPs over the step time and the preset's
peak), and memory per device, XLA's ``memory_analysis()`` peak against the estimate's
total; each error is ``predicted / measured - 1``.

Two matrix products first measure the device's own roof for each compute dtype against
the preset's peak: JAX runs float32 matrix products at its default precision, which on
NVIDIA GPUs from Ampere on is TF32 unless ``jax_default_matmul_precision`` says otherwise.

One device, so no collectives: data parallelism at one device (``dp``), with and without
bf16 compute (``precision="bf16"``) and recomputation, on GPTs from 21M to 1.3B
parameters, the dropless mixture of experts, whose ``ragged_dot`` XLA runs as a dense
product over the experts (``Cluster.native_ragged_dot``), and three Hugging Face Flax models
nobody here wrote (GPT-2 small, a 12-layer Llama of width 1024, BERT-base; float32).
Two cases repeat a step at batch 1: what a step costs beyond its per-sample work. Each
row also counts the kernels the compiled step launches (:func:`launches`). ``--small``:
test-sized models (a check of the benchmark itself on any machine).
"""

from __future__ import annotations

import re
import statistics
import time
from dataclasses import asdict, dataclass

import optax

from bench.plain_models import SMALL, Size

# name, model, global batch, plan
CASES = [
    ("gpt-small", "gpt-small", 16, "dp"),
    ("gpt-350m", "gpt-350m", 8, "dp"),
    ("gpt-350m", "gpt-350m", 8, 'dp(precision="bf16")'),
    ("gpt-350m", "gpt-350m", 8, 'dp(recompute=1, precision="bf16")'),
    ("moe-small-dropless", "moe-small-dropless", 16, 'dp(precision="bf16")'),
    ("gpt-1.3b", "gpt-1.3b", 4, 'dp(precision="bf16")'),
    # Hugging Face Flax models (transformers 4.x) at their base sizes, float32 compute
    ("hf-gpt2", "hf-gpt2-small", 8, "dp"),
    ("hf-llama", "hf-llama-350m", 8, "dp"),
    ("hf-bert", "hf-bert-base", 16, "dp"),
    # the same step at a smaller batch: what a step costs that is not per sample
    ("gpt-small", "gpt-small", 1, "dp"),
    ("hf-gpt2", "hf-gpt2-small", 1, "dp"),
]
SMALL_CASES = [
    ("gpt-tiny", "gpt-tiny", 8, "dp"),
    ("gpt-tiny", "gpt-tiny", 8, "dp(recompute=1)"),
    ("moe-tiny-dropless", "moe-tiny-dropless", 8, "dp"),
    ("hf-gpt2", "hf-gpt2-tiny", 8, "dp"),
]


# the Hugging Face cases' shapes (the batch is the case's)
HF_SIZES = {
    "small": Size(d=768, layers=12, heads=12, seq=1024, vocab=50257),  # GPT-2 small
    "350m": Size(d=1024, layers=12, heads=16, seq=1024, vocab=32000),
    "base": Size(d=768, layers=12, heads=12, seq=512, vocab=30522),  # BERT-base
    "tiny": SMALL,
}


def launches(hlo: str) -> int:
    """Kernels a compiled program launches: the instructions of its HLO module's entry
    computation that run on the device (fusions, library calls, copies), not the ones that
    only name buffers (parameters, tuples, their elements, constants, bitcasts)."""
    entry = hlo[hlo.index("\nENTRY ") :]
    entry = entry[: entry.index("\n}")]
    ops = re.findall(r"=\s*\S+\s+([a-z][a-z0-9-]*)\(", entry)
    return sum(op not in _NAMES_ONLY for op in ops)


_NAMES_ONLY = {
    "parameter", "get-tuple-element", "tuple", "constant", "bitcast", "opt-barrier",
    "after-all", "partition-id", "replica-id",
}  # fmt: skip


@dataclass
class Row:
    model: str
    plan: str
    batch: int
    compile_s: float
    step_ms: float
    predicted_ms: float
    mfu: float
    predicted_mfu: float
    memory_mb: float
    predicted_mb: float
    launches: int  # kernels the compiled step launches (its HLO entry's instructions)

    @property
    def time_error(self) -> float:
        return self.predicted_ms / self.step_ms - 1

    @property
    def memory_error(self) -> float:
        return self.predicted_mb / self.memory_mb - 1


def cluster_of(device) -> str:
    """The cluster preset of a device (``cpu`` for a CPU); a PlanError for a GPU no
    preset describes."""
    from jscaler.cost.cluster import preset_of
    from jscaler.errors import PlanError

    preset = preset_of(device)
    if preset is None:
        raise PlanError(
            f"no cluster preset for {device.device_kind!r}; name one with --cluster "
            f"(presets: h200, h100_sxm, a100_80g, dgx2_v100, or your own jscaler.Cluster)"
        )
    return preset


def matmul_roof(dtype: str, n: int = 8192, reps: int = 10) -> float:
    """Measured FLOP/s of an ``n``-cubed matrix product in ``dtype`` on the default device."""
    import jax
    import jax.numpy as jnp

    dt = {"fp32": jnp.float32, "bf16": jnp.bfloat16}[dtype]
    a = jax.random.normal(jax.random.key(0), (n, n), dt)
    b = jax.random.normal(jax.random.key(1), (n, n), dt)
    f = jax.jit(lambda a, b: a @ b)
    f(a, b).block_until_ready()
    start = time.perf_counter()
    for _ in range(reps):
        out = f(a, b)
    out.block_until_ready()
    return 2 * n**3 * reps / (time.perf_counter() - start)


def load(name: str, batch: int):
    """``(model, loss, batch)`` of a case's model: a registered one, ``gpt-350m`` (24
    layers of width 1024, sequence 1024, GPT-2 medium's shape with Llama's blocks), or a
    Hugging Face one of :data:`HF_SIZES` (random init, a params pytree)."""
    import models

    if name.startswith("hf-"):
        from dataclasses import replace

        from bench import plain_models as pm

        family, size = name.rsplit("-", 1)
        bm = pm.HF_MODELS[family](replace(HF_SIZES[size], batch=batch))
        return bm.make(), bm.loss, bm.batch

    if name == "gpt-350m":
        from flax import nnx

        from models import gpt

        cfg = gpt.GPTConfig(
            vocab_size=32000, d_model=1024, n_layers=24, n_heads=16, d_ff=2816, seq_len=1024
        )
        return gpt.GPT(cfg, rngs=nnx.Rngs(0)), gpt.loss, gpt.synthetic_batch(cfg, batch, 0)
    spec = models.get(name)
    return spec.init(0), spec.loss, spec.batch(batch, 0)


def measure(model: str, batch: int, expr: str, cluster: str, steps: int) -> Row:
    import jax

    import jscaler
    from spaces.parse import parse_plan

    module, loss, data = load(model, batch)
    trainer = jscaler.parallelize(
        module, loss, optax.sgd(1e-4), data, devices=1, plan=parse_plan(expr)
    )
    start = time.perf_counter()
    compiled = trainer.compiled(data)
    compile_s = time.perf_counter() - start
    mem = compiled.memory_analysis()
    kernels = launches(compiled.as_text())
    peak = (
        mem.argument_size_in_bytes + mem.output_size_in_bytes - mem.alias_size_in_bytes
        + mem.temp_size_in_bytes
    )  # fmt: skip
    trainer.step(data)
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        trainer.step(data)  # waits for the loss (the non-finite check reads it)
        times.append(time.perf_counter() - t0)
    step_s = statistics.median(times)
    est = trainer.estimate(cluster)
    del trainer, module, data
    jax.clear_caches()
    return Row(
        model, expr, batch, compile_s, step_s * 1e3, est.step_time * 1e3,
        est.model_flops / (step_s * est.peak), est.mfu, peak / 1e6,
        est.memory["total"] / 1e6, kernels,
    )  # fmt: skip


def table(rows: list[Row]) -> list[str]:
    from bench.table import columns

    cols = [
        "model", "plan", "batch", "compile s", "step ms", "predicted", "error", "MFU",
        "predicted MFU", "memory MB", "predicted", "error", "kernels",
    ]  # fmt: skip
    data = [
        [
            r.model, r.plan, str(r.batch), f"{r.compile_s:.1f}", f"{r.step_ms:.2f}",
            f"{r.predicted_ms:.2f}", f"{r.time_error:+.0%}", f"{r.mfu:.1%}",
            f"{r.predicted_mfu:.1%}", f"{r.memory_mb:.0f}", f"{r.predicted_mb:.0f}",
            f"{r.memory_error:+.0%}", str(r.launches),
        ]
        for r in rows
    ]  # fmt: skip
    return columns(cols, data, left=2)


def main(args) -> int:
    import json

    import jax

    from jscaler.cost import get_cluster

    device = jax.devices()[0]
    cluster = args.cluster or cluster_of(device)
    cl = get_cluster(cluster)
    print(f"{device.device_kind} ({device.platform}), cost model preset {cluster}")
    roofs = []
    for dtype in ("fp32", "bf16"):
        got = matmul_roof(dtype, 1024 if args.small else 8192)
        roofs.append(
            [
                dtype,
                f"{got / 1e12:.1f}",
                f"{cl.peak(dtype) / 1e12:.1f}",
                f"{got / cl.peak(dtype):.0%}",
            ]
        )
    from bench.table import columns

    print("\n".join(columns(["matmul", "TFLOP/s", f"{cluster} peak", "of peak"], roofs)))
    rows = []
    for model, name, batch, expr in SMALL_CASES if args.small else CASES:
        if args.model and args.model != model:
            continue
        try:
            rows.append(measure(name, batch, expr, cluster, args.steps))
        except Exception as e:  # one case's failure (out of memory, say) is a line, not the end
            print(f"{model} {expr}: {type(e).__name__}: {str(e).splitlines()[0][:200]}")
            continue
        print(f"  {model} {expr}: {json.dumps(asdict(rows[-1]))}", flush=True)
    print(f"SGD step on one {device.device_kind}; errors are predicted / measured - 1")
    print("\n".join(table(rows)))
    if args.json:
        print(json.dumps([asdict(r) for r in rows], indent=1))
    return 0
