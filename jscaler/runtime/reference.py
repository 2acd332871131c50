"""The single-device reference a plan is checked against, and the parity check.

The reference is the user's own loss under ``jax.value_and_grad`` on one device (never
the re-emitted graph), with the same optax optimizer: loss, gradients and updated
parameters per step. ``jscaler verify`` and the tests compare a Trainer to it leaf by
leaf: ``|a - b| <= RTOL*|b| + ATOL[kind]*max|b|`` in fp32.

The absolute term is set by fp32 summation order, which any split of a reduction changes:
a gradient sums B*S rows, and plain data parallelism on gpt-tiny (which only regroups the
batch sum) already moves gradient entries near zero by up to 1.9e-6*max|g|. So gradients
get 1e-5*max|g|, updated parameters 1e-6*max|p|, the loss RTOL alone. A wrong layout or a
missing reduction moves values by orders of magnitude more.

A leaf whose exact value is zero (the gradient of an attention key's bias, which softmax
cancels) holds only rounding noise, so a leaf's scale is at least ``ZERO_FLOOR`` times the
largest leaf's of its kind.

A parameter is no more exact than the updates it has taken: one initialised to zero (a
bias, a BatchNorm shift) is, after SGD's first step, ``-lr`` times its gradient, with the
gradient's relative error (Hugging Face ResNet's stem BatchNorm shift under ``dp``: 1.9e-6,
over the parameters' 1e-6, inside the gradients' 1e-5). Given the parameters before the
first step, :func:`compare` lets each parameter also carry ``ATOL["grad"]`` times the sum
of its reference updates' largest entries so far.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from jscaler.runtime.precision import map_floats

__all__ = [
    "TOLERANCES",
    "Mismatch",
    "compare",
    "parameters",
    "reference_steps",
    "trainer_steps",
]

RTOL = 1e-5
ATOL = {"loss": 0.0, "grad": 1e-5, "param": 1e-6}  # times max|b| of the leaf
ZERO_FLOOR = 1e-3  # a leaf's max|b| counts as at least this times the tree's

# bf16 keeps 8 significant bits (eps 2^-7): a plan regroups partial sums that each get
# rounded to bf16, so after 3 SGD steps the plans differ from the bf16 reference by up
# to 2^-3.8 max|b| per gradient leaf on gpt-tiny, whose matmuls and attention
# probabilities are bf16 (2^-5.4 on mlp-tiny; both nearer the fp32 reference, 2^-4.5, than
# the bf16 one is), and 2^-5.4 per parameter. A wrong scale (2x) or a missing reduction
# is still far outside.
TOLERANCES = {
    "fp32": (RTOL, ATOL),
    "bf16": (2**-6, {"loss": 0.0, "grad": 2**-3, "param": 2**-5}),
}


def reference_steps(model_or_params, loss_fn, optimizer, batches, device=None, compute_dtype=None):
    """Per step on one device: (loss, grads, params after the update).

    An nnx model is differentiated with ``nnx.value_and_grad`` (the gradient of its
    Params), so its other variables (batch statistics, RNG counters) update in place as
    its code says; a params pytree with ``jax.value_and_grad``. The caller's model is
    not touched: a clone is trained. With ``compute_dtype`` (mixed precision), the loss
    sees parameters and floating batch leaves cast to it; gradients stay fp32.
    """
    if compute_dtype is not None:
        user_loss = loss_fn

        def loss_fn(model_or_params, batch):
            cast = map_floats(model_or_params, batch, lambda x: x.astype(compute_dtype))
            return user_loss(*cast).astype(jnp.float32)

    device = device or jax.local_devices()[0]
    out = []
    with jax.default_device(device):
        if isinstance(model_or_params, nnx.Module):
            model = nnx.clone(model_or_params)
            # committed to the device from the start: the arrays the first step sees are
            # then placed as those of the later ones, and the step compiles once, not twice
            nnx.update(model, jax.device_put(nnx.state(model), device))
            vg = nnx.jit(nnx.value_and_grad(loss_fn))
            params = nnx.state(model, nnx.Param)
            opt_state = optimizer.init(params)
            for batch in batches:
                loss, grads = vg(model, jax.device_put(batch, device))
                params = nnx.state(model, nnx.Param)
                updates, opt_state = optimizer.update(grads, opt_state, params)
                params = optax.apply_updates(params, updates)
                nnx.update(model, params)
                out.append((float(loss), jax.device_get(grads), jax.device_get(params)))
            return out
        params = jax.device_put(model_or_params, device)
        vg = jax.jit(jax.value_and_grad(loss_fn))
        opt_state = optimizer.init(params)
        for batch in batches:
            loss, grads = vg(params, jax.device_put(batch, device))
            updates, opt_state = optimizer.update(grads, opt_state, params)
            params = optax.apply_updates(params, updates)
            out.append((float(loss), jax.device_get(grads), jax.device_get(params)))
    return out


def parameters(model_or_params):
    """What :func:`reference_steps` trains of a model: an nnx model's Params, else the
    pytree itself (``initial=`` of :func:`compare`)."""
    if isinstance(model_or_params, nnx.Module):
        return nnx.state(model_or_params, nnx.Param)
    return model_or_params


def trainer_steps(trainer, batches):
    """The same per-step triple from a Trainer: the loss and the gradients each step
    applied (:meth:`~jscaler.runtime.trainer.Trainer.step_and_grads`), the parameters
    after it."""
    out = []
    for batch in batches:
        metrics, grads = trainer.step_and_grads(batch)
        out.append((metrics["loss"], grads, trainer.params))
    return out


@dataclass
class Mismatch:
    """The worst disagreements found, per kind (loss / grad / param)."""

    lines: list[str] = field(default_factory=list)
    max_err: dict[str, float] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return not self.lines


def _biggest(x) -> float:
    return float(np.max(np.abs(np.asarray(x, np.float64)), initial=0.0))


def _leaf_err(a, b, rtol, atol, floor=0.0, carried=0.0):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    scale = max(_biggest(b), floor)
    excess = np.abs(a - b) - (rtol * np.abs(b) + atol * scale + carried)
    return _biggest(a - b), bool(np.all(excess <= 0))


def compare(got, want, *, rtol: float = RTOL, atol: dict | None = None, initial=None) -> Mismatch:
    """Compares trainer_steps output with reference_steps output.

    ``initial``: the parameters before the first step (the reference's pytree). With
    them, a parameter's tolerance also carries ``atol["grad"]`` times the sum of its
    reference updates' largest entries (a zero-initialised bias is its updates, and they
    are as exact as the gradients); without them, the parameter tolerance alone.
    """
    atol = {**ATOL, **(atol or {})}
    mm = Mismatch()
    before = None if initial is None else jax.tree_util.tree_leaves(initial)
    moved = None if before is None else [0.0] * len(before)
    for step, (g, w) in enumerate(zip(got, want)):
        loss, grads, params = g
        wl, wg, wp = w
        err, ok = _leaf_err(loss, wl, rtol, atol["loss"])
        mm.max_err["loss"] = max(mm.max_err.get("loss", 0.0), err)
        if not ok:
            mm.lines.append(f"step {step}: loss {loss!r} != {wl!r}")
        for what, a, b in (("grad", grads, wg), ("param", params, wp)):
            la = jax.tree_util.tree_flatten_with_path(a)[0]
            lb = jax.tree_util.tree_leaves(b)
            top = max((_biggest(y) for y in lb), default=0)
            if what == "param" and before is not None:
                steps = zip(moved, lb, before, strict=True)
                moved = [m + _biggest(np.asarray(y) - np.asarray(x0)) for m, y, x0 in steps]
                before = lb
            for i, ((path, x), y) in enumerate(zip(la, lb, strict=True)):
                carried = atol["grad"] * moved[i] if what == "param" and moved else 0.0
                err, ok = _leaf_err(x, y, rtol, atol[what], ZERO_FLOOR * top, carried)
                mm.max_err[what] = max(mm.max_err.get(what, 0.0), err)
                if not ok:
                    mm.lines.append(
                        f"step {step}: {what} {jax.tree_util.keystr(path)} max |diff| {err:.3g}"
                    )
    return mm
