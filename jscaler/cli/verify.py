"""``jscaler verify``: a plan against single-device training."""

from __future__ import annotations

import json

from jscaler.cli.common import add_devices, add_pipeline, add_plan, describe, setup_trainer
from jscaler.cli.numbers import non_negative_float, positive_int


def register(sub) -> None:
    ve = sub.add_parser(
        "verify",
        help="check a plan against single-device training (exit 0 match, 1 mismatch, 2 error)",
        description="Run a plan and the single-device reference (the model's own loss under "
        "jax.value_and_grad, SGD) for a few steps and compare loss, gradients and updated "
        "parameters leaf by leaf. Exit status: 0 match, 1 mismatch, 2 error.",
    )
    ve.add_argument("--model", required=True, help="a reference model, e.g. gpt-tiny")
    add_plan(ve, None)
    add_devices(ve)
    ve.add_argument("--steps", type=positive_int, default=3, help="steps to compare (default 3)")
    ve.add_argument(
        "--batch-size",
        type=positive_int,
        default=None,
        help="global batch size (default: the model's; times the micro-batches for pp > 1)",
    )
    add_pipeline(ve)
    ve.add_argument("--lr", type=float, default=0.1, help="SGD learning rate (default 0.1)")
    ve.add_argument(
        "--tol-scale",
        type=non_negative_float,
        default=1.0,
        help="multiply the tolerances (fp32: rtol 1e-5; atol 1e-5*max|g| for gradients, "
        "1e-6*max|p| for parameters; bf16: rtol 2^-6, atol 2^-5*max) by this; 0 asks for "
        "bit-identical results",
    )
    ve.add_argument("--json", action="store_true", help="print the comparison as JSON")
    ve.set_defaults(run=_verify)


def _verify(args) -> int:
    import optax

    from jscaler.runtime.precision import compute_dtype
    from jscaler.runtime.reference import (
        TOLERANCES,
        compare,
        parameters,
        reference_steps,
        trainer_steps,
    )

    spec, model, trainer, batch_size = setup_trainer(args, optax.sgd(args.lr))
    batches = [spec.batch(batch_size, s) for s in range(args.steps)]
    if not args.json:
        print(
            f"verify {spec.name}: {describe(trainer)}; against one device: SGD(lr={args.lr}), "
            f"{args.steps} steps, {trainer.precision}"
        )
    dtype = compute_dtype(trainer.precision)
    want = reference_steps(model, spec.loss, optax.sgd(args.lr), batches, compute_dtype=dtype)
    got = trainer_steps(trainer, batches)
    k = args.tol_scale
    rtol, atol = TOLERANCES[trainer.precision]
    scaled = {kind: a * k for kind, a in atol.items()}
    mm = compare(got, want, rtol=rtol * k, atol=scaled, initial=parameters(model))
    if args.json:
        out = {
            "model": spec.name,
            "plan": describe(trainer),
            "match": mm.ok,
            "steps": [{"loss": g[0], "reference": w[0]} for g, w in zip(got, want)],
            "max_abs_diff": mm.max_err,
            "tolerance": {"rtol": rtol * k, "atol": {kind: a * k for kind, a in atol.items()}},
            "mismatches": mm.lines[:20],
        }
        print(json.dumps(out, indent=1))
        return 0 if mm.ok else 1
    for step, (g, w) in enumerate(zip(got, want)):
        print(f"  step {step}: loss {g[0]:.7f}  reference {w[0]:.7f}")
    for kind, err in mm.max_err.items():
        print(f"  max |diff| {kind}: {err:.3g}")
    if mm.ok:
        print("MATCH: loss, gradients and updated parameters agree within tolerance")
        return 0
    print("MISMATCH:")
    for line in mm.lines[:20]:
        print("  " + line)
    return 1
