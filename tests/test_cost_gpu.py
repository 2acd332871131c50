"""The cost model's fusing-backend rules (``Cluster.fuses_elementwise``), held to what
XLA's GPU backend measured on an H200 (``jscaler bench gpu``, 2026-11-27): CI has no GPU,
so the measured figures are pinned here and the estimate is checked against them."""

import jax
import jax.numpy as jnp
import pytest
from flax import nnx

import jscaler
import models
from jscaler.cost.estimate import saved_for_backward
from jscaler.cost.fusion import fused_kept, materialised
from jscaler.runtime.precision import with_compute_dtype
from models import gpt
from spaces import dp

# gpt-350m (24 layers of width 1024, sequence 1024, vocabulary 32000), batch 8, SGD, one
# H200: XLA's memory_analysis peak in MB
MEASURED_MB = {"fp32": 42688, "bf16": 23229}


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


@pytest.mark.parametrize("precision", sorted(MEASURED_MB))
def test_gpt_350m_memory_on_an_h200(precision):
    cfg = gpt.GPTConfig(
        vocab_size=32000, d_model=1024, n_layers=24, n_heads=16, d_ff=2816, seq_len=1024
    )
    model = nnx.eval_shape(lambda: gpt.GPT(cfg, rngs=nnx.Rngs(0)))
    batch = jax.eval_shape(lambda: gpt.synthetic_batch(cfg, 8, 0))
    dtype = jnp.bfloat16 if precision == "bf16" else None
    model, batch = with_compute_dtype(model, batch, dtype)
    plan = dp()(jscaler.trace(gpt.loss, model, batch), 1)
    total = jscaler.estimate(plan, "h200", dtype=precision).memory["total"] / 1e6
    assert abs(total / MEASURED_MB[precision] - 1) < 0.10, total
