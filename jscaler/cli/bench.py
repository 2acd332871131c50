"""``jscaler bench``: the benchmarks in ``bench/``."""

from __future__ import annotations

import json

from jscaler.cli.common import add_devices
from jscaler.cli.numbers import positive_int


def register(sub) -> None:
    be = sub.add_parser(
        "bench",
        help="benchmarks: 'spmd' compares plans with plain JAX (memory, collectives, time); "
        "'plain' pairs dp, zero3, megatron and auto with the plain-JAX step a user would "
        "write for each, on Hugging Face and plain-JAX models; "
        "'pipeline' compares pipeline schedules (simulated bubbles, MPMD vs SPMD step times); "
        "'coshard' compares coshard's activation memory with plain tensor parallelism; "
        "'cost' holds the cost model's memory and collective predictions to XLA's; "
        "'order' times the op-order search with and without order rules; 'calibrate' "
        "holds the simulated Megatron-LM baseline to published throughput; 'paper' "
        "reproduces nnScaler's end-to-end table (SIMULATED); 'gpu' holds the cost model's "
        "step time and memory to one local accelerator; 'scan' puts a Llama with its "
        "layers stacked under jax.lax.scan beside its list twin and plain JAX under every "
        "plan; 'variants' holds every plan to plain JAX on generated transformer variants",
        description="Run a benchmark and print its table. 'spmd': for one model on N "
        "simulated devices, per plan: per-device memory (XLA memory_analysis), collective "
        "bytes per step by kind (compiled HLO) and step time, beside plain JAX with "
        "Megatron name rules and plain jax.jit data parallelism, with ratios. 'pipeline': "
        "each schedule's simulated bubble beside (p-1)/(m+p-1), then SGD step times of the "
        "MPMD pipeline runtime per schedule against the SPMD fast path (spmd_pipeline), "
        "with the first-step loss of each. 'coshard': per plan (megatron and coshard at tp "
        "2 and 4), XLA's temporaries and per-device memory, collective bytes and step "
        "time, against plain Megatron at the same tp, and which coshard plans fit in the "
        "memory of megatron at a higher tp. 'cost': per (model, plan), the cost model's "
        "predicted per-device memory and collective bytes against XLA's memory_analysis() "
        "and the compiled HLO, with the errors (--model/--plan narrow the cases). 'order': "
        "the CP-SAT block scheduler under 1F1B's memory bound, free and with the paper's "
        "order rules (tables 4, 7), for 3F1B and 1F1B at --pp stages. 'calibrate': "
        "Megatron-LM's published GPT runs on A100s (Narayanan et al. 2021, table 1) "
        "beside the cost model's prediction for the same shape, plan and GPU count. 'paper': "
        "nnScaler's section 8.3 on the cost model: Swin, T5 and AlphaFold2 at 4-32 V100s of "
        "DGX-2 and DGX-1, each system's best setting of a grid (--model and --devices narrow "
        "it; 2 worker processes). 'plain': on models nobody here wrote (a plain-JAX GPT "
        "with fused q/k/v, Hugging Face Flax GPT-2 and Llama, gpt-small, swin-tiny; "
        "--model narrows, --small shrinks them), each jscaler plan beside its plain-JAX "
        "counterpart (dp() / plain dp, zero(stage=3) / plain fsdp, megatron(tp=8) / "
        "Megatron name rules, megatron(tp=4, dp=2, zero=3) / fsdp x tp rules, auto / the "
        "fastest plain row): per-device memory, collective bytes by kind, interleaved step "
        "times, the loss after 3 AdamW steps on both, the cost model's predictions, the "
        "ratios and the issue's targets met or missed. 'moe': the same measurement for "
        "moe-small (--small: moe-tiny; --model moe-small-dropless: ragged_dot dispatch): "
        "dp() against plain dp, expert(ep=4), expert(ep=2) "
        "and expert(ep=4, tp=2) against plain JAX with the experts split by name rules over "
        "an expert axis (dp=2 x ep=4), and the target: the best expert plan's collective "
        "bytes <= 0.8x the plain rules' at no more memory. 'scan': a plain-JAX Llama (GQA, "
        "SwiGLU, RoPE) written with its layers in a list and stacked under jax.lax.scan "
        "(--small shrinks it), per plan: both per-device memories and collective bytes "
        "(a loop's collectives once per iteration), the plain-JAX layout on the scanned "
        "model, the cost model's errors, and the targets. 'variants': --n transformer "
        "variants drawn from --seed (MHA/GQA/MQA, fused or separate projections, einsum or "
        "dot_product_attention, masks, positions, GELU/SwiGLU/MoE, tied, norms, losses, "
        "list or scan, params/nnx/linen), each jscaler plan beside the plain-JAX layout a "
        "user writes for that variant, and the median and worst ratio per column with the "
        "misses and the choices they share.",
    )
    be.add_argument(
        "which",
        choices=[
            "spmd",
            "plain",
            "pipeline",
            "coshard",
            "cost",
            "order",
            "calibrate",
            "paper",
            "moe",
            "gpu",
            "scan",
            "variants",
        ],
        help="the benchmark",
    )
    be.add_argument(
        "--model",
        default=None,
        help="model (default gpt-small, 21M; pipeline: gpt-tiny; coshard: swin-bench; plain: "
        "all of gpt-fused, hf-gpt2, hf-llama, gpt-small, swin; moe: moe-small or "
        "moe-small-dropless)",
    )
    be.add_argument(
        "--steps",
        type=positive_int,
        default=None,
        help="timed steps per plan (default 3; plain: 5)",
    )
    be.add_argument(
        "--small",
        action="store_true",
        help="plain, moe, scan: tiny configs of the models (a quick run)",
    )
    be.add_argument("--pp", type=positive_int, default=4, help="pipeline: stages (default 4)")
    be.add_argument(
        "--microbatches",
        type=positive_int,
        default=None,
        help="pipeline: micro-batches (default pp)",
    )
    be.add_argument(
        "--plan",
        action="append",
        default=None,
        help="a plan expression to bench (repeatable; default: a standard set)",
    )
    be.add_argument(
        "--n", type=positive_int, default=50, help="variants: how many to draw (default 50)"
    )
    be.add_argument(
        "--seed", type=int, default=0, help="variants: the seed they are drawn from (default 0)"
    )
    be.add_argument("--json", action="store_true", help="print the rows as JSON")
    be.add_argument(
        "--cluster",
        default=None,
        help="gpu: the cluster preset to predict on (default: the local device's)",
    )
    add_devices(be)
    be.set_defaults(run=_bench)


def _bench(args) -> int:
    if args.steps is None:
        args.steps = 5 if args.which in ("plain", "moe") else 3
    if args.which == "pipeline":
        return _bench_pipeline(args)
    if args.which == "coshard":
        return _bench_coshard(args)
    if args.which == "cost":
        return _bench_cost(args)
    if args.which in ("calibrate", "order", "paper", "plain", "moe", "gpu", "scan", "variants"):
        import importlib

        return importlib.import_module(f"bench.{args.which}").main(args)
    from bench import spmd
    from spaces.parse import parse_plan

    n = args.devices or 8
    args.model = args.model or "gpt-small"
    plans = {expr: parse_plan(expr) for expr in args.plan} if args.plan else None
    spec, rows = spmd.run(args.model, n, steps=args.steps, plans=plans)
    if args.json:
        print(
            json.dumps(
                [
                    {
                        "plan": r.name,
                        "memory_bytes": r.memory,
                        "step_s": r.step_s,
                        "predicted_bytes": r.predicted,
                        "collectives": {
                            k: {"count": c, "bytes": b} for k, (c, b) in r.comm.items()
                        },
                    }
                    for r in rows
                ],
                indent=1,
            )
        )
    else:
        print(spmd.table(spec, rows, n))
    return 0


def _bench_cost(args) -> int:
    import dataclasses

    from bench import cost

    cases = cost.default_cases()
    if args.model:
        cases = [c for c in cases if c[0] == args.model] or [(args.model, "dp")]
    if args.plan:
        models_ = sorted({m for m, _ in cases}, key=[m for m, _ in cases].index)
        cases = [(m, expr) for m in models_ for expr in args.plan]
    rows = cost.run(cases, args.devices or 8)
    if args.json:
        print(json.dumps([dataclasses.asdict(r) for r in rows], indent=1))
        return 0
    print(
        f"cost model vs XLA on {args.devices or 8} simulated devices (AdamW; pipelines "
        f"{cost.PIPELINE_MICROBATCHES} micro-batches): memory per device (MB) and collective "
        "bytes per step (MB); err = predicted / measured - 1"
    )
    print("\n".join(cost.table(rows)))
    return 0


def _bench_coshard(args) -> int:
    from bench import coshard
    from spaces.parse import parse_plan

    n = args.devices or 8
    plans = None
    if args.plan:  # each plan runs on its own tp devices
        from jscaler.errors import PlanError

        plans = {}
        for expr in args.plan:
            space = parse_plan(expr)
            if not isinstance(getattr(space, "tp", None), int):
                raise PlanError(f"--plan {expr!r}: bench coshard compares plans with a tp degree")
            plans[expr] = (space.tp, space)
    spec, rows, skipped = coshard.run(args.model or "swin-bench", n, steps=args.steps, plans=plans)
    if args.json:
        print(json.dumps([r.__dict__ for r in rows], indent=1))
    else:
        print(coshard.table(spec, rows, skipped))
    return 0


def _bench_pipeline(args) -> int:
    from dataclasses import asdict

    from bench import pipeline

    n = args.devices or 8
    spec, bubbles, rows, skipped = pipeline.run(
        args.model or "gpt-tiny", n, args.pp, args.microbatches, args.steps
    )
    if args.json:
        print(
            json.dumps(
                {
                    "bubbles": [asdict(b) | {"formula": b.formula} for b in bubbles],
                    "steps": [asdict(r) for r in rows],
                    "skipped": skipped,
                },
                indent=1,
            )
        )
    else:
        print(pipeline.table(spec, bubbles, rows, n, args.pp, skipped))
    return 0
