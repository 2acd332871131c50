"""The ``jscaler`` command.

The only engine module that may import ``models/`` (and later ``spaces/``,
``schedules/``): it turns names on the command line into objects.
"""

from __future__ import annotations

import argparse
import ast
import json
import sys

__all__ = ["main"]


def _add_devices(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--devices",
        type=int,
        default=None,
        help="number of devices (default: all; without an accelerator, that many simulated "
        "CPU devices, 8 if not given)",
    )


def _add_plan(p: argparse.ArgumentParser, default: str | None) -> None:
    p.add_argument(
        "--plan",
        default=default,
        required=default is None,
        help='a space call with literal arguments, e.g. "megatron(tp=2, dp=4)" or '
        '"zero(stage=3)"; a bare name means its defaults; or the path of a plan JSON'
        + (f" (default: {default})" if default else ""),
    )


def _add_pipeline(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--microbatches",
        type=int,
        default=None,
        help="micro-batches per step: gradient accumulation, or the pipeline's micro-batches "
        "(default: 1; 2*pp for a plan with pp > 1)",
    )
    p.add_argument(
        "--schedule",
        default=None,
        help="pipeline schedule for a plan with pp > 1: gpipe, one_f_one_b, "
        "interleaved_1f1b, zero_bubble, three_f_one_b, interlaced, interlaced_head, "
        "table4_1f1b, table7_3f1b; arguments as in "
        '"interleaved_1f1b(chunks=2)" (default: the plan\'s own, else one_f_one_b)',
    )


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="jscaler",
        description="Parallelise single-device Flax training with searched plans.",
    )
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    ins = sub.add_parser(
        "inspect",
        help="trace a model's loss and print its graph: module paths, annotations, FLOPs",
        description="Trace a reference model's loss into jscaler's Graph IR and print every "
        "op with its Flax module path, primitive, dim annotation (''=splittable, "
        "'+'=partial sums, '^'=not splittable), shapes and FLOPs, then the coverage.",
    )
    ins.add_argument("--model", required=True, help="a reference model, e.g. gpt-tiny")
    ins.add_argument("--batch-size", type=int, default=None, help="batch size to trace with")
    ins.add_argument(
        "--select", default=None, help="only ops under matching module paths, e.g. 'blocks/0/*'"
    )
    ins.add_argument("--summary", action="store_true", help="print only the summary lines")
    ins.add_argument("--json", action="store_true", help="print the graph as JSON")
    _add_devices(ins)
    ins.set_defaults(run=_inspect)

    tr = sub.add_parser(
        "train",
        help="train a reference model under a plan, with a progress bar and the loss",
        description="Train a reference model on its synthetic data under a plan (Adam).",
    )
    tr.add_argument("--model", required=True, help="a reference model, e.g. gpt-tiny")
    _add_plan(tr, "dp")
    _add_devices(tr)
    tr.add_argument("--steps", type=int, default=20, help="training steps (default 20)")
    tr.add_argument(
        "--batch-size",
        type=int,
        default=None,
        help="global batch size (default: the model's; times the micro-batches for pp > 1)",
    )
    _add_pipeline(tr)
    tr.add_argument("--lr", type=float, default=1e-2, help="Adam learning rate (default 1e-2)")
    tr.add_argument("--explain", action="store_true", help="print the plan's table first")
    tr.set_defaults(run=_train)

    ve = sub.add_parser(
        "verify",
        help="check a plan against single-device training (exit 0 match, 1 mismatch, 2 error)",
        description="Run a plan and the single-device reference (the model's own loss under "
        "jax.value_and_grad, SGD) for a few steps and compare loss, gradients and updated "
        "parameters leaf by leaf. Exit status: 0 match, 1 mismatch, 2 error.",
    )
    ve.add_argument("--model", required=True, help="a reference model, e.g. gpt-tiny")
    _add_plan(ve, None)
    _add_devices(ve)
    ve.add_argument("--steps", type=int, default=3, help="steps to compare (default 3)")
    ve.add_argument(
        "--batch-size",
        type=int,
        default=None,
        help="global batch size (default: the model's; times the micro-batches for pp > 1)",
    )
    _add_pipeline(ve)
    ve.add_argument("--lr", type=float, default=0.1, help="SGD learning rate (default 0.1)")
    ve.add_argument(
        "--tol-scale",
        type=float,
        default=1.0,
        help="multiply the tolerances (fp32: rtol 1e-5; atol 1e-5*max|g| for gradients, "
        "1e-6*max|p| for parameters; bf16: rtol 2^-6, atol 2^-5*max) by this; 0 asks for "
        "bit-identical results",
    )
    ve.set_defaults(run=_verify)

    pl = sub.add_parser(
        "plan",
        help="predict plans' step time and memory on a cluster, or search for the best",
        description="Trace a reference model (no weights are made) and, for each --plan, "
        "print the cost model's prediction on --devices devices of --cluster: step time, "
        "MFU, memory per device (and whether it fits), collective bytes. --plan auto (the "
        "default) runs the op-trans/op-assign ILP (CP-SAT) and prints the plan it picks. "
        "Every figure is SIMULATED from the cost model, not measured.",
    )
    pl.add_argument("--model", required=True, help="a reference model, e.g. gpt-small")
    pl.add_argument(
        "--plan",
        action="append",
        default=None,
        help='a space call (repeatable), e.g. --plan dp --plan "megatron(tp=8)"; "auto" '
        "searches (default: auto)",
    )
    pl.add_argument(
        "--devices", type=int, default=8, help="devices to plan for (default 8; none are used)"
    )
    pl.add_argument(
        "--cluster",
        default="dgx2_v100",
        help="dgx2_v100 (default), dgx1_v100, a100_80g, h100_sxm or cpu",
    )
    pl.add_argument(
        "--space",
        action="append",
        default=None,
        help="rank a space's settings on these devices (repeatable), e.g. --space megatron: "
        "every tp x pp it allows, predicted and sorted, the best that fits first",
    )
    pl.add_argument("--mesh", default=None, help='the searched mesh, e.g. "dp=2,tp=4"')
    pl.add_argument(
        "--capacity", type=float, default=None, help="GiB per device (default: the cluster's)"
    )
    pl.add_argument("--dtype", default="fp32", help="compute dtype for the peak (default fp32)")
    pl.add_argument(
        "--optimizer-slots",
        type=int,
        default=0,
        help="fp32 optimizer values per parameter: 0 SGD (default), 2 Adam",
    )
    pl.add_argument(
        "--microbatches",
        type=int,
        default=None,
        help="micro-batches of a pipeline plan (default 2 x its stage groups); the model's "
        "batch size is one micro-batch",
    )
    pl.add_argument("--explain", action="store_true", help="print the searched plan's splits")
    pl.add_argument("--json", action="store_true", help="print the predictions as JSON")
    pl.set_defaults(run=_plan_cmd)

    la = sub.add_parser(
        "launch",
        help="run a jscaler command as N local processes of one JAX program",
        description="Start N processes of a command on this machine, each with its own "
        "simulated CPU devices, joined by jax.distributed.initialize on 127.0.0.1; e.g. "
        "jscaler launch --nprocs 2 --devices-per-proc 4 -- jscaler train --model gpt-tiny "
        '--plan "megatron(pp=2, dp=4)". On a cluster, start the command with srun/mpirun '
        "instead: jscaler joins the run from the SLURM / Open MPI environment.",
    )
    la.add_argument("--nprocs", type=int, default=2, help="processes (default 2)")
    la.add_argument(
        "--devices-per-proc", type=int, default=4, help="CPU devices per process (default 4)"
    )
    la.add_argument("cmd", nargs=argparse.REMAINDER, help="-- the command to run")
    la.set_defaults(run=None, devices=None)

    be = sub.add_parser(
        "bench",
        help="benchmarks: 'spmd' compares plans with plain JAX (memory, collectives, time); "
        "'pipeline' compares pipeline schedules (simulated bubbles, MPMD vs SPMD step times); "
        "'coshard' compares coshard's activation memory with plain tensor parallelism; "
        "'cost' holds the cost model's memory and collective predictions to XLA's; "
        "'order' times the op-order search with and without order rules; 'calibrate' "
        "holds the simulated Megatron-LM baseline to published throughput; 'paper' "
        "reproduces nnScaler's end-to-end table (SIMULATED)",
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
        "it; 2 worker processes).",
    )
    be.add_argument(
        "which",
        choices=["spmd", "pipeline", "coshard", "cost", "order", "calibrate", "paper"],
        help="the benchmark",
    )
    be.add_argument(
        "--model",
        default=None,
        help="model (default gpt-small, 21M; pipeline: gpt-tiny; coshard: swin-bench)",
    )
    be.add_argument("--steps", type=int, default=3, help="timed steps per plan (default 3)")
    be.add_argument("--pp", type=int, default=4, help="pipeline: stages (default 4)")
    be.add_argument(
        "--microbatches", type=int, default=None, help="pipeline: micro-batches (default pp)"
    )
    be.add_argument(
        "--plan",
        action="append",
        default=None,
        help="a plan expression to bench (repeatable; default: a standard set)",
    )
    be.add_argument("--json", action="store_true", help="print the rows as JSON")
    _add_devices(be)
    be.set_defaults(run=_bench)

    vz = sub.add_parser(
        "viz",
        help="draw a pipeline schedule's timeline to a PNG and print its bubble",
        description="Build a pipeline schedule for P device groups and M micro-batches, "
        "simulate it in unit time (F = 1, B = 2; B = W = 1 when the backward is split) and "
        "draw one row per group, one box per block coloured by micro-batch. Prints the "
        "bubble (beside (p-1)/(m+p-1) for GPipe/1F1B-shaped schedules) and the "
        "activations each stage holds at once.",
    )
    vz.add_argument(
        "--schedule",
        required=True,
        metavar="NAME",
        help="gpipe, one_f_one_b, interleaved_1f1b, zero_bubble, three_f_one_b, interlaced, "
        'interlaced_head, table4_1f1b, table7_3f1b; arguments as in "interleaved_1f1b(chunks=2)"',
    )
    vz.add_argument(
        "--stages",
        type=int,
        required=True,
        metavar="P",
        help="device groups, one per pipeline stage (interleaved schedules put several "
        "virtual stages on each)",
    )
    vz.add_argument(
        "--microbatches", type=int, required=True, metavar="M", help="micro-batches per step"
    )
    vz.add_argument(
        "--out", default="schedule.png", metavar="PATH", help="PNG to write (default schedule.png)"
    )
    vz.set_defaults(run=_viz, devices=None)
    return p


def _parse_call(expr: str, flag: str, table: dict, error, expected: str):
    """``(name, args, kwargs)`` of ``"name"`` or ``"name(literal, key=literal)"`` with
    ``name`` in ``table``; args and kwargs are None for a bare name."""
    try:
        node = ast.parse(expr.strip(), mode="eval").body
    except SyntaxError as e:
        raise error(f"{flag} {expr!r} is not an expression: {e.msg}") from None
    name = node.id if isinstance(node, ast.Name) else getattr(getattr(node, "func", None), "id", "")
    if not isinstance(node, ast.Name | ast.Call) or name not in table:
        raise error(f"{flag} {expr!r}: expected {expected}")
    if isinstance(node, ast.Name):
        return name, None, None
    try:
        args = [ast.literal_eval(a) for a in node.args]
        kwargs = {k.arg: ast.literal_eval(k.value) for k in node.keywords}
    except ValueError:
        raise error(f"{flag} {expr!r}: arguments must be literals") from None
    return name, args, kwargs


def parse_plan(expr: str):
    """A space from ``"megatron(tp=2, dp=4)"`` (literal arguments only), a bare space
    name, or a plan JSON path (returned as the path)."""
    import os

    from jscaler.errors import PlanError
    from jscaler.search import intra_op
    from spaces import SPACES

    if os.path.isfile(expr):
        return expr
    table = SPACES | {"intra_op": intra_op, "auto": intra_op}
    expected = (
        f'a call of one of {sorted(table)} such as "megatron(tp=2)", "auto" (searched), or '
        f"a plan JSON path"
    )
    name, args, kwargs = _parse_call(expr, "--plan", table, PlanError, expected)
    if args is None:
        return table[name]()
    try:
        return table[name](*args, **kwargs)
    except TypeError as e:
        raise PlanError(f"--plan {expr!r}: {e}") from None


def parse_schedule(expr: str | None):
    """A schedule function ``(groups, microbatches) -> Schedule`` from ``"gpipe"`` or
    ``"interleaved_1f1b(chunks=2)"`` (literal keyword arguments); None for the default."""
    import functools

    from jscaler.errors import ScheduleError
    from schedules import SCHEDULES

    if expr is None:
        return None
    expected = f"one of {sorted(SCHEDULES)}"
    name, args, kwargs = _parse_call(expr, "--schedule", SCHEDULES, ScheduleError, expected)
    if args is None:
        return SCHEDULES[name]
    if args:
        raise ScheduleError(f"--schedule {expr!r}: pass arguments by keyword, e.g. chunks=2")
    return functools.partial(SCHEDULES[name], **kwargs)


def describe(trainer) -> str:
    """``plan NAME on N devices (MESH)``, or for a pipeline its groups and schedule."""
    plan = trainer.plan
    if hasattr(plan, "mesh"):
        return f"plan {plan.name} on {plan.mesh.size} devices ({plan.mesh})"
    sched = trainer.schedule
    groups = ", ".join(
        f"{list(g.devices)[0]}-{list(g.devices)[-1]} ({g.plan.mesh})" for g in plan.groups
    )
    return (
        f"plan {plan.name} on {len(plan.devices)} devices: {sched.stages} stages on groups "
        f"{groups}; schedule {sched.name}, {sched.microbatches} micro-batches"
    )


def _inspect(args) -> int:
    import jax

    import models
    from jscaler import trace
    from jscaler.ir.report import graph_summary, graph_table, op_record

    spec = models.get(args.model)
    model = _abstract_model(spec)
    batch = spec.batch(args.batch_size or spec.batch_size, 0)
    batch = jax.tree_util.tree_map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), batch)
    graph = trace(spec.loss, model, batch, strict=False)
    shown = graph.select(args.select) if args.select else graph
    if args.json:
        cov = graph.coverage()
        out = {
            "model": spec.name,
            "coverage": {"ops": cov.ops, "flops": cov.flops},
            "ops": [op_record(graph, o) for o in shown.ops],
        }
        print(json.dumps(out, indent=1))
        return 0
    print(f"{spec.name}: {spec.description}")
    if not args.summary:
        print(graph_table(shown))
        print()
    print(graph_summary(graph))
    return 0


def _abstract_model(spec):
    """The model with shapes only, so inspecting a 7B config allocates nothing."""
    import jax

    if spec.kind == "nnx":
        from flax import nnx

        return nnx.eval_shape(lambda: spec.init(0))
    return jax.eval_shape(lambda: spec.init(0))


def _setup_trainer(args, optimizer):
    import jscaler
    import models

    spec = models.get(args.model)
    model = spec.init(0)
    plan = parse_plan(args.plan)
    pp = getattr(plan, "pp", 1)
    microbatches = args.microbatches or (2 * pp if pp > 1 else 1)
    # a pipeline's micro-batches each get the model's default batch size unless told
    default = spec.batch_size * (microbatches if pp > 1 else 1)
    batch_size = getattr(args, "batch_size", None) or default
    trainer = jscaler.parallelize(
        model,
        spec.loss,
        optimizer,
        spec.batch(batch_size, 0),
        devices=args.devices,
        plan=plan,
        microbatches=microbatches,
        schedule=parse_schedule(args.schedule),
    )
    return spec, model, trainer, batch_size


def _plans(trainer) -> list:
    plan = trainer.plan
    if hasattr(plan, "groups"):
        return list({id(g.plan): g.plan for g in plan.groups}.values())
    return [plan]


def _train(args) -> int:
    import time

    import optax
    from tqdm import tqdm

    spec, _, trainer, batch_size = _setup_trainer(args, optax.adam(args.lr))
    print(f"{spec.name}: {spec.description}")
    print(describe(trainer))
    if args.explain:
        for plan in _plans(trainer):
            print(plan.explain())
    first = last = None
    start = time.perf_counter()
    with tqdm(range(args.steps), desc="train", unit="step", dynamic_ncols=True) as bar:
        for step in bar:
            metrics = trainer.step(spec.batch(batch_size, step))
            first = metrics["loss"] if first is None else first
            last = metrics["loss"]
            bar.set_postfix(loss=f"{last:.4f}", grad_norm=f"{metrics['grad_norm']:.3f}")
    took = time.perf_counter() - start
    print(
        f"loss {first:.4f} -> {last:.4f} in {args.steps} steps ({took:.1f} s, "
        f"including compilation)"
    )
    return 0


def _plan_cmd(args) -> int:
    import time

    import jax

    import models
    from jscaler import PipelinePlan, Plan, PlanError, trace
    from jscaler.cost import estimate, estimate_pipeline, get_cluster
    from jscaler.search import explain, intra_op

    spec = models.get(args.model)
    batch = spec.batch(spec.batch_size, 0)
    batch = jax.tree_util.tree_map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), batch)
    graph = trace(spec.loss, _abstract_model(spec), batch, strict=False)
    cluster = get_cluster(args.cluster)
    capacity = args.capacity * 2**30 if args.capacity else cluster.memory
    rows = []
    todo = [(expr, None) for expr in args.plan or ([] if args.space else ["auto"])]
    for name in args.space or ():
        from spaces.grid import settings

        todo += settings(name, args.devices)
    for expr, made in todo:
        start = time.perf_counter()
        if made is not None:
            space = _for_cluster(made, expr, cluster, args.capacity and capacity)
        elif expr.strip() == "auto":
            mesh = dict(_mesh_arg(args.mesh)) if args.mesh else None
            space = intra_op(
                mesh, cluster, capacity, args.dtype, optimizer_slots=args.optimizer_slots,
                cache=not args.explain,  # --explain shows the solve, so solve
            )  # fmt: skip
        else:
            space = _for_cluster(parse_plan(expr), expr, cluster, args.capacity and capacity)
        try:
            if isinstance(space, str):  # a plan JSON file
                with open(space) as f:
                    plan = Plan.from_json(f.read(), graph)
            else:
                plan = space(graph, args.devices)
        except PlanError as e:
            if made is None:
                raise
            rows.append({"plan": expr, "error": str(e).split(";")[0]})
            continue
        took = time.perf_counter() - start
        kw = {"dtype": args.dtype, "optimizer_slots": args.optimizer_slots}
        m = 1
        if isinstance(plan, PipelinePlan):
            m = args.microbatches or 2 * plan.pipeline_groups
            est = estimate_pipeline(plan, cluster, microbatches=m, **kw)
        else:
            est = estimate(plan, cluster, **kw)
        rows.append(
            {
                "plan": plan.name,
                "batch": spec.batch_size * m,
                "step_ms": est.step_time * 1e3,
                "mfu": est.mfu,
                "memory_gib": est.memory["total"] / 2**30,
                "fits": est.memory["total"] <= capacity,
                "comm_mb": est.comm_bytes / 1e6,
                "bubble": est.bubble,
                "plan_s": took,
            }
        )
        if args.explain and "search" in plan.__dict__:
            problem, sol = plan.__dict__["search"]
            print(explain(problem, sol))
    if args.json:
        print(json.dumps({"model": spec.name, "cluster": cluster.name, "plans": rows}, indent=1))
        return 0
    print(
        f"{spec.name} on {args.devices} x {cluster.name} ({args.dtype}), SIMULATED by the "
        f"cost model; capacity {capacity / 2**30:.1f} GiB per device; batch: samples per "
        f"step (a pipeline's micro-batches each take the model's batch size)"
    )
    cols = (
        ("batch", 6), ("step ms", 9), ("MFU", 6), ("bubble", 7), ("GiB/dev", 8), ("fits", 5),
        ("comm MB", 9), ("plan s", 7),
    )  # fmt: skip
    head = f"{'plan':<34} " + " ".join(f"{c:>{w}}" for c, w in cols)
    print(head)
    print("-" * len(head))
    if args.space:  # ranked: fitting plans by MFU, best first; failures last
        rows.sort(key=lambda r: ("error" in r, not r.get("fits"), -r.get("mfu", 0)))
    for r in rows:
        if "error" in r:
            print(f"{r['plan']:<34} cannot apply: {r['error']}")
            continue
        print(
            f"{r['plan']:<34} {r['batch']:>6} {r['step_ms']:>9.2f} {r['mfu']:>6.1%} "
            f"{r['bubble']:>7.1%} "
            f"{r['memory_gib']:>8.2f} "
            f"{'yes' if r['fits'] else 'NO':>5} {r['comm_mb']:>9.1f} {r['plan_s']:>7.1f}"
        )
    return 0


def _for_cluster(space, expr: str, cluster, capacity):
    """A searched space (intra_op, alpa_like) searches for the cluster being planned for,
    unless its expression names one."""
    import dataclasses

    if not dataclasses.is_dataclass(space) or not hasattr(space, "cluster"):
        return space
    changes = {} if "cluster" in expr else {"cluster": cluster}
    if capacity and hasattr(space, "capacity") and "capacity" not in expr:
        changes["capacity"] = capacity
    return dataclasses.replace(space, **changes)


def _mesh_arg(text: str):
    from jscaler.errors import PlanError

    try:
        return [(k.strip(), int(v)) for k, v in (kv.split("=") for kv in text.split(","))]
    except ValueError:
        raise PlanError(f'--mesh {text!r}: expected axis=size pairs, e.g. "dp=2,tp=4"') from None


def _verify(args) -> int:
    import optax

    from jscaler.runtime.precision import compute_dtype
    from jscaler.runtime.reference import TOLERANCES, compare, reference_steps, trainer_steps

    spec, model, trainer, batch_size = _setup_trainer(args, optax.sgd(args.lr))
    batches = [spec.batch(batch_size, s) for s in range(args.steps)]
    print(
        f"verify {spec.name}: {describe(trainer)}; against one device: SGD(lr={args.lr}), "
        f"{args.steps} steps, {trainer.precision}"
    )
    dtype = compute_dtype(trainer.precision)
    want = reference_steps(model, spec.loss, optax.sgd(args.lr), batches, compute_dtype=dtype)
    got = trainer_steps(trainer, batches)
    k = args.tol_scale
    rtol, atol = TOLERANCES[trainer.precision]
    mm = compare(got, want, rtol=rtol * k, atol={kind: a * k for kind, a in atol.items()})
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


def _bench(args) -> int:
    if args.which == "pipeline":
        return _bench_pipeline(args)
    if args.which == "coshard":
        return _bench_coshard(args)
    if args.which == "cost":
        return _bench_cost(args)
    if args.which in ("calibrate", "order", "paper"):
        import importlib

        return importlib.import_module(f"bench.{args.which}").main(args)
    from bench import spmd

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
        f"cost model vs XLA on {args.devices or 8} simulated devices: memory per device (MB) "
        "and collective bytes per step (MB); err = predicted / measured - 1"
    )
    print("\n".join(cost.table(rows)))
    return 0


def _bench_coshard(args) -> int:
    from bench import coshard

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


def _viz(args) -> int:
    from jscaler.errors import ScheduleError
    from jscaler.plan.plot import plot

    try:
        schedule = parse_schedule(args.schedule)(args.stages, args.microbatches)
    except TypeError as e:
        raise ScheduleError(f"--schedule {args.schedule!r}: {e}") from None
    timeline = plot(schedule, args.out)
    p, m = len(schedule.groups), schedule.microbatches
    print(f"{schedule.name}: {schedule.stages} stages on {p} device groups, {m} micro-batches")
    line = f"bubble {timeline.bubble():.1%} (simulated, unit costs)"
    if _classic_shape(schedule):
        line += f"; (p-1)/(m+p-1) = {p - 1}/{m + p - 1} = {(p - 1) / (m + p - 1):.1%}"
    print(line)
    print(f"activations in flight per stage: {', '.join(map(str, schedule.in_flight()))}")
    print(f"wrote {args.out}")
    return 0


def _classic_shape(schedule) -> bool:
    """One stage per group, one forward pass, whole backwards, no recompute, no
    all-device group: the shape of GPipe and 1F1B, whose unit-cost bubble is
    (p-1)/(m+p-1)."""
    return (
        schedule.stages == len(schedule.groups)
        and not getattr(schedule, "whole", ())
        and schedule.passes == 1
        and not schedule.split_backward
        and not any(b.kind == "R" for g in schedule.groups for b in g)
    )


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


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    from jscaler._setup import enable_compilation_cache, init_distributed, use_cpu_devices

    if args.command == "launch":
        from jscaler.launch import launch

        command = args.cmd[1:] if args.cmd[:1] == ["--"] else args.cmd
        return launch(command, args.nprocs, args.devices_per_proc)
    if not init_distributed():
        use_cpu_devices(args.devices or 8)
    enable_compilation_cache()
    from jscaler.errors import JscalerError

    try:
        return args.run(args)
    except (JscalerError, KeyError) as e:
        print(f"jscaler {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
