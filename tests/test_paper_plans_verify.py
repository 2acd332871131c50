"""Every paper plan run the way ``jscaler verify`` runs it by default (a fresh process,
8 devices, 3 SGD steps, fp32 tolerances): coshard, interlaced, 3F1B, Ulysses, ring and
USP. A jax release that breaks one of them (0.12.1 made ``jax.nn.softmax`` a
``custom_jvp_call``, which coshard's manual regions could not run on pieces) fails here."""

import pytest
from test_cli import run

PAPER_PLANS = [
    ("swin-tiny", "coshard"),  # bare names: the space's defaults for 8 devices
    ("t5-tiny", "interlaced"),
    ("alphafold2-tiny", "alphafold_3f1b"),
    ("gpt-tiny", "ulysses(sp=4)"),  # bare ulysses is sp=1 on gpt-tiny's 4 heads
    ("gpt-tiny", "ring(sp=4)"),
    ("gpt-tiny", "usp(ulysses=2, ring=2)"),
]


@pytest.mark.parametrize("model, plan", PAPER_PLANS, ids=[f"{m}-{p}" for m, p in PAPER_PLANS])
def test_jscaler_verify_matches_one_device(model, plan):
    proc = run("verify", "--model", model, "--plan", plan, check=False)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert "MATCH: loss, gradients and updated parameters agree" in proc.stdout
