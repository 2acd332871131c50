"""``jscaler bench variants`` on transformer variants drawn anew every run.

Three variants (:mod:`bench.variant_models`) are drawn from the run's
``JSCALER_RANDOM_SEED`` (pytest's header prints it; set it to replay a run). On each:
jscaler's memory against the plain-JAX layout a user writes for the same variant, under
every plan the bench pairs except auto, within :data:`HELD`; every row's loss equal to
plain dp's; and one of those plans trained with SGD equal to one device.
"""

import jax
import numpy as np
import pytest
from randomised import SEED

from bench.variant_models import VOCAB, build, draw
from bench.variants import LOSS_RTOL, measure
from spaces import dp, megatron, zero

from parity import assert_matches_reference

# (pair, measure, bound) held on every draw. The bounds (bench.variants.BOUNDS:
# dp 1.02, zero3 1.0, tp 1.05, fsdp x tp 1.0) are not met on the whole family yet
# (docs/variants.md lists the misses and their causes); these are above the worst cases
# of `jscaler bench variants --n 50 --seed 20261207` and `--n 12 --seed 7` (dp 1.11x,
# zero3 1.22x, tp 1.93x, fsdp x tp 1.28x) with room for new draws, so that what this
# issue fixed stays fixed (a replicated attention or fused kernel, or a softmax keeping
# its exp, reads 1.3-5x) and a draw as bad as one already seen does not fail the run
HELD = [
    ("dp", "memory", 1.20),
    ("zero3", "memory", 1.30),
    ("tp", "memory", 2.50),
    ("fsdp_tp", "memory", 1.60),
]
# a key projection's bias has a gradient of exactly zero (softmax ignores a shift shared
# by a query's scores): what either side computes for it is rounding of the other
# gradients, ~1e-9 against gradients of ~0.1 here, which the default floor (1e-8 of the
# largest) does not always cover. Gradients here: |diff| <= 1e-5 |ref| + 1e-4 max(max|leaf|,
# 1e-3 max|largest leaf|) (the reference's 1e-5 is 1e-5 of the same); losses and
# parameters at the reference tolerance
ATOL = {"grad": 1e-4}
PLANS = [megatron(tp=8), megatron(tp=4, dp=2, zero=3), zero(stage=3), dp()]
REPLAY = f"replay: JSCALER_RANDOM_SEED={SEED} pytest tests/test_variants.py"


def _variant(k: int):
    return draw(SEED, k)


@pytest.mark.parametrize("k", range(3))
def test_memory_at_or_below_the_plain_layouts_and_losses_equal(k):
    v = _variant(k)
    # memory is static and the loss compared is the one after the first update: two
    # steps per runner (no timing here)
    res = measure(build(v), steps=1, keys={"dp", "zero3", "tp", "fsdp_tp"}, warm=1)
    where = f"{v.name} [{v.describe()}] ({REPLAY})"
    for row in res.rows:
        assert not row.jscaler.error, f"{where}: {row.jscaler.name}: {row.jscaler.error}"
        assert row.plain is not None and not row.plain.error, f"{where}: {row.plain}"
    for key, what, bound in HELD:
        ratio = res.row(key).ratio(what)
        assert ratio is not None and ratio <= bound, (
            f"{where}: {res.row(key).jscaler.name} {what} {ratio:.3f}x its plain layout's "
            f"(bound {bound}x)"
        )
    assert not res.loss_misses(), f"{where}: losses differ (rtol {LOSS_RTOL}): {res.loss_misses()}"


@pytest.mark.parametrize("k", range(3))
def test_a_variant_trains_equal_to_one_device(k):
    """SGD, 3 steps on 3 batches, under one of the bench's plans drawn with the variant:
    losses, gradients and parameters equal to one device within the reference
    tolerance (tests/parity.py)."""
    v = _variant(k)
    plan = PLANS[np.random.default_rng([SEED, k]).integers(len(PLANS))]
    vm = build(v)
    model, loss = vm.make()
    batches = [
        {"ids": jax.random.randint(jax.random.key(s), vm.batch["ids"].shape, 0, VOCAB)}
        for s in range(3)
    ]
    print(f"{v.name} [{v.describe()}] under {plan!r} ({REPLAY})")
    assert_matches_reference(model, loss, batches, plan, lr=0.05, atol=ATOL)
    jax.clear_caches()
