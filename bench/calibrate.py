"""``jscaler bench calibrate``: the simulated Megatron-LM baseline against published figures.

Narayanan et al. (SC'21, "Efficient Large-Scale Language Model Training on GPU Clusters
Using Megatron-LM"), table 1, trained GPT models on DGX A100 (80 GB) nodes at sequence
2048 and vocabulary 51,200, with full activation recomputation and fp16, and reported the
achieved teraFLOP/s per GPU (counting the recomputation, as hardware FLOPs). Each row here
builds the same shape with ``models.gpt`` (a SwiGLU MLP of width 8h/3, so its FLOPs equal
GPT-3's 4h GELU MLP), plans it with ``megatron(tp, pp, recompute=1)`` on the same GPU
count, and predicts the step on the ``a100_80g`` cluster with the cost model; the error
is predicted / published - 1. The published figures are as printed in that paper's table 1.
"""

from __future__ import annotations

# name, heads, hidden, layers, tp, pp, GPUs, global batch, published TFLOP/s per GPU
PUBLISHED = [
    ("1.7B", 24, 2304, 24, 1, 1, 32, 512, 137),
    ("3.6B", 32, 3072, 30, 2, 1, 64, 512, 138),
    ("7.5B", 32, 4096, 36, 4, 1, 128, 512, 142),
    ("18.4B", 48, 6144, 40, 8, 1, 256, 1024, 135),
    ("39.1B", 64, 8192, 48, 8, 2, 512, 1536, 138),
]


def run(rows=None, cluster: str = "a100_80g") -> list[list[str]]:
    import time

    import jax
    from flax import nnx

    import jscaler
    from jscaler.cost import estimate, estimate_pipeline
    from models import gpt
    from spaces import megatron

    out = []
    for name, heads, h, layers, tp, pp, n, batch, published in rows or PUBLISHED:
        start = time.perf_counter()
        d_ff = round(8 * h / 3 / (64 * tp)) * 64 * tp
        cfg = gpt.GPTConfig(
            vocab_size=51200, d_model=h, n_layers=layers, n_heads=heads, d_ff=d_ff,
            seq_len=2048,
        )  # fmt: skip
        dp = n // (tp * pp)
        # one step of the global batch; a pipeline's micro-batches are one sample per replica
        size = dp if pp > 1 else batch
        model = nnx.eval_shape(lambda cfg=cfg: gpt.GPT(cfg, rngs=nnx.Rngs(0)))
        shapes = jax.eval_shape(lambda cfg=cfg, size=size: gpt.synthetic_batch(cfg, size, 0))
        graph = jscaler.trace(gpt.loss, model, shapes, strict=False)
        plan = megatron(tp=tp, pp=pp, recompute=1)(graph, n)
        if pp > 1:
            est = estimate_pipeline(plan, cluster, microbatches=batch // dp, dtype="fp16")
        else:
            est = estimate(plan, cluster, dtype="fp16")
        per_gpu = est.hardware_flops / est.step_time / n / 1e12
        out.append(
            [
                name, str(tp), str(pp), str(n), str(batch), f"{published}",
                f"{per_gpu:.0f}", f"{per_gpu / published - 1:+.0%}", f"{est.mfu:.1%}",
                f"{est.step_time:.2f}", f"{time.perf_counter() - start:.0f}",
            ]
        )  # fmt: skip
    return out


def table(rows) -> list[str]:
    from bench.table import columns

    cols = [
        "GPT", "tp", "pp", "GPUs", "batch", "published TF/GPU", "SIMULATED TF/GPU", "error",
        "MFU", "step s", "took s",
    ]  # fmt: skip
    return columns(cols, rows, left=1)


def main(args) -> int:
    print(
        "Megatron-LM GPT on DGX A100 (published) vs the cost model on a100_80g, fp16, "
        "full recomputation; TF/GPU counts the recomputation (hardware FLOPs)"
    )
    print("\n".join(table(run())))
    return 0
