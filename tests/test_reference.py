"""The parity check's tolerances (jscaler.runtime.reference.compare) on hand-made steps."""

import numpy as np

from jscaler.runtime.reference import compare

LR = 0.1
INITIAL = {"bias": np.zeros(4), "kernel": np.array([1.0, 0.0, 0.0, 0.0])}
GRADS = [{"bias": np.array([0.03, 0.0, 0.0, 0.0]), "kernel": np.array([0.4, 0.0, 0.0, 0.0])}] * 3


def _steps(error=0.0):
    """SGD from INITIAL over GRADS: per step (loss, grads, params). ``error``: what the
    plan's bias gradient has in its second entry (exactly 0), relative to its largest."""
    out, params = [], INITIAL
    for g in GRADS:
        g = {**g, "bias": g["bias"] + np.array([0.0, error * 0.03, 0.0, 0.0])}
        params = {k: params[k] - LR * g[k] for k in params}
        out.append((1.0, g, params))
    return out


def _failing(mm):
    return [line.split(" max")[0] for line in mm.lines]


def test_a_zero_initialised_parameter_is_as_exact_as_its_updates():
    """Hugging Face ResNet's stem BatchNorm shift under dp: its gradient off by 1.9e-6 of
    its largest (inside the gradients' 1e-5), the shift, -lr times the gradient after step
    0, by as much (over the parameters' 1e-6). Counted from the parameters before the first
    step, it passes."""
    want, got = _steps(), _steps(error=1.9e-6)
    assert _failing(compare(got, want)) == [f"step {s}: param ['bias']" for s in range(3)]
    assert compare(got, want, initial=INITIAL).ok


def test_updates_off_by_more_than_the_gradients_tolerance_still_fail():
    want = _steps()
    mm = compare(_steps(error=2e-5), want, initial=INITIAL)  # 2x the gradient tolerance
    assert _failing(mm) == [f"step {s}: {k} ['bias']" for s in range(3) for k in ("grad", "param")]
    doubled = [(loss, g, {**p, "bias": 2 * p["bias"]}) for loss, g, p in want]
    assert _failing(compare(doubled, want, initial=INITIAL)) == [
        f"step {s}: param ['bias']" for s in range(3)
    ]


def test_a_large_parameter_keeps_the_parameter_tolerance():
    """The kernel (largest entry 1, updates of 0.04) gets 1e-6 of itself and 1e-5 of its
    updates: 4e-6 off where it is 0 fails, with or without the initial parameters."""
    want = _steps()
    off = np.array([0.0, 4e-6, 0.0, 0.0])
    got = [(loss, g, {**p, "kernel": p["kernel"] + off}) for loss, g, p in want]
    for initial in (None, INITIAL):
        mm = compare(got, want, initial=initial)
        assert _failing(mm) == [f"step {s}: param ['kernel']" for s in range(3)]
