"""``jscaler plan``: predict plans on a cluster, or search for the best."""

from __future__ import annotations

import json

from jscaler.cli.common import abstract_model, add_expert_skew
from jscaler.cli.numbers import count, non_negative_float, positive_int


def register(sub) -> None:
    pl = sub.add_parser(
        "plan",
        help="predict plans' step time and memory on a cluster, or search for the best",
        description="Trace a reference model (no weights are made) and, for each --plan, "
        "print the cost model's prediction on --devices devices of --cluster: step time, "
        "MFU, memory per device (and whether it fits), collective bytes. --plan auto (the "
        "default; also --auto) searches jointly: mesh shapes with the op-trans/op-assign ILP "
        "(HiGHS), pipelines with Alpa's stage DP, every space's settings, schedules, ZeRO, "
        "recompute and micro-batch counts, and prints the fastest plan that fits (with "
        "--mesh: the ILP alone on that mesh). "
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
        "--devices",
        type=positive_int,
        default=8,
        help="devices to plan for (default 8; none are used)",
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
    pl.add_argument("--auto", action="store_true", help="search jointly (the same as --plan auto)")
    pl.add_argument(
        "--mesh", default=None, help='--plan auto: only the ILP on this mesh, e.g. "dp=2,tp=4"'
    )
    pl.add_argument(
        "--capacity",
        type=non_negative_float,
        default=None,
        help="GiB per device (default: the cluster's)",
    )
    pl.add_argument("--dtype", default="fp32", help="compute dtype for the peak (default fp32)")
    pl.add_argument(
        "--optimizer-slots",
        type=count,
        default=0,
        help="fp32 optimizer values per parameter: 0 SGD (default), 2 Adam",
    )
    pl.add_argument(
        "--microbatches",
        type=positive_int,
        default=None,
        help="micro-batches of a pipeline plan (default 2 x its stage groups); the model's "
        "batch size is one micro-batch",
    )
    pl.add_argument(
        "--explain",
        action="store_true",
        help="auto: why the winner beat the runner-up (time, memory, bytes) and the best "
        "candidates; with --mesh: the searched plan's splits",
    )
    add_expert_skew(pl, 1.0)
    pl.add_argument("--json", action="store_true", help="print the predictions as JSON")
    pl.set_defaults(run=_plan_cmd)


def _plan_cmd(args) -> int:
    import time

    import jax

    import models
    from jscaler import PipelinePlan, Plan, PlanError, trace
    from jscaler.cost import estimate, estimate_pipeline, get_cluster
    from jscaler.search import explain, intra_op
    from spaces.parse import parse_plan

    spec = models.get(args.model)
    batch = spec.batch(spec.batch_size, 0)
    batch = jax.tree_util.tree_map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), batch)
    graph = trace(spec.loss, abstract_model(spec), batch, strict=False)
    cluster = get_cluster(args.cluster)
    capacity = args.capacity * 2**30 if args.capacity else cluster.memory
    rows = []
    exprs = (args.plan or []) + (["auto"] if args.auto else [])
    todo = [(expr, None) for expr in exprs or ([] if args.space else ["auto"])]
    for name in args.space or ():
        from spaces.grid import settings

        todo += settings(name, args.devices, graph)
    from tqdm import tqdm

    bar = tqdm(todo, desc="plan", unit="plan", disable=args.json or len(todo) < 2, leave=False)
    for expr, made in bar:
        bar.set_postfix_str(expr)
        start = time.perf_counter()
        if made is not None:
            space = _for_cluster(made, expr, cluster, args.capacity and capacity)
        elif expr.strip() == "auto" and not args.mesh:
            rows.append(_auto_row(args, spec, cluster, capacity))
            continue
        elif expr.strip() == "auto":  # the ILP alone on the mesh given
            space = intra_op(
                dict(_mesh_arg(args.mesh)), cluster, capacity, args.dtype,
                optimizer_slots=args.optimizer_slots,
                cache=not args.explain,  # --explain shows the solve, so solve
            )  # fmt: skip
        else:
            space = _for_cluster(parse_plan(expr), expr, cluster, args.capacity and capacity)
        try:
            if isinstance(space, str):  # a plan JSON file
                with open(space) as f:
                    plan = Plan.from_json(f.read(), graph, f"plan file {space}")
            else:
                plan = space(graph, args.devices)
        except PlanError as e:
            if made is None:
                raise
            rows.append({"plan": expr, "error": str(e).split(";")[0]})
            continue
        took = time.perf_counter() - start
        kw = {
            "dtype": args.dtype,
            "optimizer_slots": args.optimizer_slots,
            "expert_skew": args.expert_skew,
        }
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
        if args.explain and plan.solved is not None:
            print(explain(*plan.solved))
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


def _auto_row(args, spec, cluster, capacity) -> dict:
    """The joint search (``jscaler.search.search``) over the model's batch as the global
    batch, cut into every micro-batch count up to 16 that divides it."""
    import jax

    import schedules  # noqa: F401  (registers the schedules the search tries)
    from jscaler import trace
    from jscaler.search import search

    size = spec.batch_size
    counts = tuple(m for m in (1, 2, 4, 8, 16) if size % m == 0)

    def graph_of(m: int):
        batch = spec.batch(size, 0)
        micro = jax.tree_util.tree_map(
            lambda x: jax.ShapeDtypeStruct((x.shape[0] // m, *x.shape[1:]), x.dtype), batch
        )
        return trace(spec.loss, abstract_model(spec), micro, strict=False)

    result = search(
        graph_of, args.devices, cluster=cluster, capacity=capacity, dtype=args.dtype,
        optimizer_slots=args.optimizer_slots, expert_skew=args.expert_skew,
        microbatches=counts, cache=not args.explain, progress=not args.json,
    )  # fmt: skip
    if args.explain:
        print(result.explain())
        print("\n".join(result.table(top=15)))
    best = result.best
    if best is None:
        return {"plan": "auto", "error": result.explain().splitlines()[-1]}
    est = result.estimate
    return {
        "plan": f"auto: {result.plan.name} [m={best.microbatches}"
        + (f", {best.schedule}]" if best.schedule else "]"),
        "batch": size,
        "step_ms": est.step_time * 1e3,
        "mfu": est.mfu,
        "memory_gib": est.memory["total"] / 2**30,
        "fits": True,
        "comm_mb": est.comm_bytes / 1e6,
        "bubble": est.bubble,
        "plan_s": result.seconds,
        "tries": len(result.rows),
    }


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
