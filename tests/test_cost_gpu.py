"""The cost model's fusing-backend rules (``Cluster.fuses_elementwise``), held to what
XLA's GPU backend measured on an H200 (``jscaler bench gpu``, 2026-11-27): CI has no GPU,
so the measured figures are pinned here and the estimate is checked against them."""

import jax
import jax.numpy as jnp
import pytest
from flax import nnx

import jscaler
import models
from jscaler.cost.fusion import fused_kept, materialised
from jscaler.cost.memory import saved_for_backward
from jscaler.runtime.precision import with_compute_dtype
from models import gpt
from spaces import dp

# XLA's memory_analysis peak in MB of an SGD step on one H200: gpt-350m (24 layers of width
# 1024, sequence 1024, vocabulary 32000) at batch 8, and the dropless MoE at batch 16, whose
# ragged_dots XLA runs as dense dots over the experts (Cluster.native_ragged_dot)
MEASURED_MB = {
    ("gpt-350m", 8, "fp32"): 42688,
    ("gpt-350m", 8, "bf16"): 23229,
    # each block recomputed: XLA keeps each block's input (24 of bf16[8, 1024, 1024]), not
    # the chain of residual adds behind it; +25% while the fusion rule walked back through
    # that chain to every block's projections and the rerun block kept its softmax
    ("gpt-350m", 8, "bf16+recompute"): 4254,
    ("moe-small-dropless", 16, "bf16"): 1616,
}
# SGD step times on one H200 in ms (median of 10, bench gpu's fourth run), with the
# tolerance each is held to: batch 1 of gpt-small is one of the two sweeps kernel_seconds
# was measured from (a fifth run, on another machine, measured it at 3.48 ms: the launch
# cost varies by host); the others were not used to set it
MEASURED_MS = {
    ("gpt-small", 1, "fp32"): (2.93, 0.20),
    ("gpt-small", 16, "fp32"): (6.94, 0.30),
    ("gpt-350m", 8, "bf16"): (70.80, 0.10),
    # predicted 39% short while a ragged_dot counted no FLOPs and ran grouped
    ("moe-small-dropless", 16, "bf16"): (9.17, 0.10),
    # Hugging Face GPT-2 small, whose LM head (vocabulary 50257) is an unaligned product:
    # 18% short while it was charged an aligned one's speed
    ("hf-gpt2-small", 8, "fp32"): (61.42, 0.10),
}


def test_an_elementwise_chain_is_one_kernel():
    spec = models.get("gpt-tiny")
    g = jscaler.trace(spec.loss, spec.init(0), spec.batch(8, 0))
    done = materialised(g)
    by_prim = lambda p: [t for o in g.ops if o.primitive == p for t in o.outputs]  # noqa: E731
    assert by_prim("dot_general") and set(by_prim("dot_general")) <= done
    exps = by_prim("exp")  # inside the softmaxes: read by reductions and elementwise ops
    assert exps and not set(exps) & done
    saved = saved_for_backward(g)
    kept = fused_kept(g, saved)
    assert not set(exps) & kept and set(exps) & saved  # recomputed from the chain's inputs
    assert kept <= done | {t for t in kept if g.producer(t) is None}


def _plan(name: str, batch: int, precision: str):
    """The one-device plan of a GPT or the dropless MoE (shapes only: nothing is
    initialised)."""
    precision, _, recompute = precision.partition("+")
    if name.startswith("hf-"):
        from bench import gpu

        model, loss, data = gpu.load(name, batch)
        return dp()(jscaler.trace(loss, model, data), 1)
    if name == "moe-small-dropless":
        from models import moe

        cfg = moe.small_dropless()
        model = nnx.eval_shape(lambda: moe.MoEDecoder(cfg, rngs=nnx.Rngs(0)))
        data = jax.eval_shape(lambda: moe.synthetic_batch(cfg, batch, 0))
        model, data = with_compute_dtype(model, data, jnp.bfloat16)
        return dp()(jscaler.trace(moe.loss, model, data), 1)
    if name == "gpt-350m":
        cfg = gpt.GPTConfig(
            vocab_size=32000, d_model=1024, n_layers=24, n_heads=16, d_ff=2816, seq_len=1024
        )
    else:
        cfg = gpt.small()
    model = nnx.eval_shape(lambda: gpt.GPT(cfg, rngs=nnx.Rngs(0)))
    data = jax.eval_shape(lambda: gpt.synthetic_batch(cfg, batch, 0))
    model, data = with_compute_dtype(model, data, jnp.bfloat16 if precision == "bf16" else None)
    return dp(recompute=int(bool(recompute)))(jscaler.trace(gpt.loss, model, data), 1)


# measured before a traced softmax was differentiated by its own rule
# (jscaler.compile.softmax): the fp32 step then kept each layer's scores as well as its
# probabilities, and the estimate now counts the probabilities alone (31.4 GB predicted);
# no GPU was at hand to measure the step again (jscaler bench gpu on an H200)
STALE = {("gpt-350m", 8, "fp32")}


@pytest.mark.parametrize(
    "name, batch, precision",
    [
        pytest.param(*k, marks=pytest.mark.xfail(strict=True, reason="measured before the "
                     "softmax rule; re-measure with jscaler bench gpu on an H200"))
        if k in STALE else k
        for k in sorted(MEASURED_MB)
    ],
)  # fmt: skip
def test_memory_on_an_h200(name, batch, precision):
    plan = _plan(name, batch, precision)
    total = jscaler.estimate(plan, "h200", dtype=precision.split("+")[0]).memory["total"] / 1e6
    assert abs(total / MEASURED_MB[name, batch, precision] - 1) < 0.10, total


@pytest.mark.parametrize("name, batch, precision", sorted(MEASURED_MS))
def test_step_time_on_an_h200(name, batch, precision):
    """A step's time is its kernels' roofline time and their per-kernel cost: without the
    latter gpt-small's steps were predicted 91% (batch 1) and 66% (batch 16) short."""
    measured, tolerance = MEASURED_MS[name, batch, precision]
    step = jscaler.estimate(_plan(name, batch, precision), "h200", dtype=precision).step_time
    assert abs(step * 1e3 / measured - 1) < tolerance, step


def test_an_unaligned_matrix_product_runs_slower():
    """A product whose n is not a multiple of 16 bytes runs at ``unaligned_matmul`` of
    the roof on the GPU presets (measured: [768, 50257] at 29% of the TF32 peak, [768,
    50304] at 71%), and at the roof on the others."""

    def loss(p, batch):
        return (batch["x"] @ p["w"]).sum()

    def compute(vocab, cluster):
        params = {"w": jax.ShapeDtypeStruct((768, vocab), jnp.float32)}
        batch = {"x": jax.ShapeDtypeStruct((8192, 768), jnp.float32)}
        plan = dp()(jscaler.trace(loss, params, batch), 1)
        return jscaler.estimate(plan, cluster).compute

    from jscaler.cost import get_cluster

    share = get_cluster("h200").unaligned_matmul
    assert share < 1
    ratio = compute(50257, "h200") / compute(50304, "h200")
    # the products' share of the step (its update and launches are aligned work)
    assert 0.9 / share < ratio < 1 / share
    ratio = compute(50257, "dgx2_v100") / compute(50304, "dgx2_v100")
    assert ratio == pytest.approx(50257 / 50304, rel=0.02)
