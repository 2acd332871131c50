"""``jscaler bench paper``: nnScaler's end-to-end comparison (OSDI'24, section 8.3), SIMULATED.

Every figure here comes from the cost model (``jscaler.cost``) on a plan a space built from
the real traced graph of the paper's model; nothing runs on a GPU. For each model at 4, 8,
16 and 32 GPUs on the DGX-2 and DGX-1 V100 clusters, each system is a grid of its knobs
(the paper tuned the baselines by hand over tensor, pipeline and data parallelism; here
every setting is planned and predicted), and a system's figure is its best setting that
fits a V100's 32 GB. Throughput is the paper's metric, aggregate effective TFLOPS (model
FLOPs of the global batch / step time), fp16 compute, Adam (two fp32 slots), layer-wise
recomputation everywhere (the paper's section 8.3.1).

The systems, as in the paper:

- nnScaler: the model's new plan (Swin: ``coshard``; T5: ``interlaced``; AlphaFold2:
  ``alphafold_3f1b`` with tensor or DAP splits inside the stages) together with the plans
  nnScaler's space holds as special cases (Megatron's tp x pp x dp; plain data
  parallelism for AlphaFold2, the paper's pick at 4 and 8 GPUs);
- Megatron-LM: ``megatron(tp, pp)`` with the rest as data parallelism;
- DeepSpeed: ``deepspeed(tp)``, ZeRO-3 over the data-parallel replicas;
- Alpa: ``alpa_like(pp)``, even stages, each stage's ops placed by the op-trans / op-assign
  ILP for the cluster (the paper also ran Alpa's algorithm inside nnScaler);
- DAP+DP (AlphaFold2): ``dap(k)`` times data parallelism, ``k = 1`` being plain DP.

Batches: the paper's scripts use micro-batches of one sample and a global batch of 256
(Swin, T5); AlphaFold2 trains on 128 crops. A plan with ``dp`` replicas runs micro-batches
of ``dp`` samples, ``256 / dp`` of them (pipelines: through the schedule; SPMD plans:
gradient accumulation, gradients reduced once per step). AlphaFold2's sizes are not in the
paper's artifact: this uses its training shape (256 residues, 128 MSA rows, c_m 256, c_z
128, 3 passes) with 8 of the 48 Evoformer blocks, so its graph stays near 11k ops.

Settings whose model state alone (fp16 parameters and gradients plus Adam's fp32 slots,
spread over the devices that shard it) exceeds the capacity are skipped without planning,
and coshard's colocation, which trades time for memory, doubles (2, then 4 pieces) only
while the plan does not fit. AlphaFold2's tensor parallelism stops at 4 (its pair
attention has 4 heads); every ILP (Alpa's per stage mesh, the
engine's) gets 10 s of HiGHS.
"""

from __future__ import annotations

import functools
import math
import time

from spaces.grid import expression, state_shards

CLUSTERS = ("dgx2_v100", "dgx1_v100")
GPUS = (4, 8, 16, 32)
MODELS = ("swin", "t5", "alphafold2")
TP = (1, 2, 4, 8)  # within a DGX-1 node
PP = (1, 2, 4)
SLOTS = 2  # Adam
# the pruning's lower bound on model state per parameter: fp16 parameter and gradient and
# the fp32 optimizer slots (the estimate counts more: fp32 parameters and gradients)
ILP_LIMIT = 10.0  # the ILP: HiGHS work seconds per solve (jscaler.search.milp)
STATE_BYTES = 2 + 2 + 4 * SLOTS

# The paper's reported speedups of nnScaler (section 8.3): (model, cluster, GPUs) ->
# (speedup, over which system). Figures 7-10 are not in the text; these are its sentences.
PAPER = {
    ("swin", "dgx2_v100", 8): (1.2, "DeepSpeed"),
    ("swin", "dgx2_v100", 16): (1.5, "DeepSpeed"),
    ("swin", "dgx2_v100", 32): (1.5, "DeepSpeed"),
    ("t5", "dgx2_v100", 8): (1.5, "DeepSpeed"),
    ("t5", "dgx2_v100", 16): (1.6, "DeepSpeed"),
    ("t5", "dgx2_v100", 32): (2.5, "DeepSpeed"),
    ("alphafold2", "dgx2_v100", 16): (1.5, "DAP+DP"),
    ("alphafold2", "dgx2_v100", 32): (1.1, "DeepSpeed"),
    ("swin", "dgx1_v100", 16): (1.9, "DeepSpeed"),
    ("swin", "dgx1_v100", 32): (3.5, "DeepSpeed"),
    ("alphafold2", "dgx1_v100", 16): (1.1, "DeepSpeed"),
    ("alphafold2", "dgx1_v100", 32): (1.4, "DeepSpeed"),
}
# Throughput lost going from DGX-2 to DGX-1 at 32 GPUs (Swin, section 8.3.5).
PAPER_DGX1_DROP = {"nnScaler": -0.06, "DeepSpeed": -0.60, "Alpa": -0.82, "Megatron-LM": -0.82}


def _model(name: str, n: int):
    """(module, model class, config, global batch) of the paper's model at n GPUs."""
    from models import alphafold2, swin, t5

    if name == "swin":
        return swin, swin.Swin, swin.CONFIGS[f"paper_{n}gpu"](), 256
    if name == "t5":
        return t5, t5.T5, t5.CONFIGS[f"paper_{n}gpu"](), 256
    return alphafold2, alphafold2.AlphaFold2, alphafold2.paper().replace(n_blocks=8), 128


def _split(n: int, *ks: int) -> int | None:
    prod = math.prod(ks)
    return n // prod if n % prod == 0 else None


def grid(model: str, n: int) -> dict[str, list[tuple[str, str, dict, int]]]:
    """system -> [(expression, space name, knobs, samples per micro-batch)]."""
    megatron, deepspeed, alpa, new = [], [], [], []
    # AlphaFold2's pair attention has 4 heads: tensor parallelism beyond 4 splits nothing
    degrees = TP[:3] if model == "alphafold2" else TP
    for tp in degrees:
        for pp in PP:
            if (dp := _split(n, tp, pp)) is not None:
                megatron.append(("megatron", {"tp": tp, "pp": pp, "recompute": 1}, dp))
        if (dp := _split(n, tp)) is not None and dp > 1:
            deepspeed.append(("deepspeed", {"tp": tp, "recompute": 1}, dp))
    for pp in PP:
        alpa.append(("alpa_like", {"pp": pp, "recompute": 1}, n // pp))
    if model == "swin":
        for tp in TP[1:]:
            for pp in PP:
                if (dp := _split(n, tp, pp)) is not None:
                    for colocate in (2, 4):
                        kw = {"tp": tp, "colocate": colocate, "pp": pp, "recompute": 1}
                        new.append(("coshard", kw, dp))
    elif model == "t5":
        for tp in TP:
            for pp in (2, 4):
                if (dp := _split(n, tp, pp)) is not None:
                    new.append(("interlaced", {"pp": pp, "tp": tp, "recompute": 1}, dp))
    out = {"nnScaler": new + megatron, "Megatron-LM": megatron}
    if model == "alphafold2":
        dap = [("dp", {"recompute": 1}, n)]
        dap += [("dap", {"dap": k, "recompute": 1}, n // k) for k in TP[1:] if n % k == 0]
        for pp in (2, 4):
            for k in TP:
                if (dp := _split(n, k, pp)) is not None:
                    kw = {"pp": pp, "tp": k} if k == 1 else {"pp": pp, "dap": k}
                    new.append(("alphafold_3f1b", kw | {"recompute": 1}, dp))
        out = {"nnScaler": new + dap, "DAP+DP": dap}  # 3F1B's space holds DAP at pp = 1
    out |= {"DeepSpeed": deepspeed}
    if model != "alphafold2":
        out |= {"Alpa": alpa}
    return {
        system: [(expression(name, kw), name, kw, size) for name, kw, size in settings]
        for system, settings in out.items()
    }


def _less_colocated(name: str, kw: dict) -> str | None:
    """The same coshard setting with half the colocated pieces (None: not coshard)."""
    if name != "coshard" or kw["colocate"] <= 2:
        return None
    return expression(name, kw | {"colocate": kw["colocate"] // 2})


def _trace(module, model, cfg, size: int):
    import jax

    import jscaler

    one = jax.eval_shape(lambda: module.synthetic_batch(cfg, 1, 0))
    batch = jax.tree_util.tree_map(
        lambda x: jax.ShapeDtypeStruct((size, *x.shape[1:]), x.dtype), one
    )  # every leaf leads with the batch
    return jscaler.trace(module.loss, model, batch, strict=False)


def cell(model: str, n: int, clusters=CLUSTERS) -> dict:
    """Every setting of every system for one model at n GPUs: ``{"settings": {expr:
    {"plan_s", cluster: {tflops, samples_s, gib, fits, step_s}} or {"skipped": why}},
    "systems": grid, "trace_s"}``."""
    from flax import nnx

    import jscaler
    from jscaler.cost import estimate, estimate_pipeline, get_cluster
    from spaces import SPACES

    module, cls, cfg, batch = _model(model, n)
    systems = grid(model, n)
    graphs, results = {}, {}
    start = time.perf_counter()
    abstract = nnx.eval_shape(lambda: cls(cfg, rngs=nnx.Rngs(0)))
    trace_s = time.perf_counter() - start
    for settings in systems.values():
        for expr, name, kw, size in settings:
            if expr in results:
                continue
            if size not in graphs:
                start = time.perf_counter()
                graphs[size] = _trace(module, abstract, cfg, size)
                trace_s += time.perf_counter() - start
            graph = graphs[size]
            m = batch // size
            less = _less_colocated(name, kw)
            if less in results and all(results[less].get(cl, {}).get("fits") for cl in clusters):
                # colocation trades time for memory: more only if fewer pieces do not fit
                results[expr] = {"skipped": f"{less} fits"}
                continue
            state = sum(math.prod(t.shape) for t in graph.params()) * STATE_BYTES
            shards = state_shards(name, kw, n) or None
            capacity = get_cluster(clusters[0]).memory
            if shards is not None and state / shards > capacity:
                results[expr] = {"skipped": f"model state {state / shards / 2**30:.0f} GiB"}
                continue
            res: dict = {"plan_s": 0.0}
            plan = None
            for cl in clusters:
                start = time.perf_counter()
                if plan is None or name == "alpa_like":  # Alpa's ILP plans for the cluster
                    extra = {}
                    if name == "alpa_like":
                        extra = {"cluster": cl, "microbatches": m, "dtype": "fp16"}
                        extra |= {"optimizer_slots": SLOTS, "time_limit": ILP_LIMIT}
                    try:
                        plan = SPACES[name](**kw, **extra)(graph, n)
                    except jscaler.PlanError as e:
                        res.setdefault("skipped", str(e).split(";")[0][:60])
                        plan = None
                        continue
                kw_est = {"dtype": "fp16", "optimizer_slots": SLOTS}
                if isinstance(plan, jscaler.PipelinePlan):
                    est = estimate_pipeline(plan, cl, microbatches=m, **kw_est)
                else:
                    est = estimate(plan, cl, microbatches=m, **kw_est)
                res["plan_s"] += time.perf_counter() - start
                res[cl] = {
                    "plan": plan.name,
                    "step_s": est.step_time,
                    "tflops": est.model_flops / est.step_time / 1e12,
                    "samples_s": batch / est.step_time,
                    "gib": est.memory["total"] / 2**30,
                    "fits": est.memory["total"] <= get_cluster(cl).memory,
                }
            results[expr] = res
    graph_of = functools.partial(_graph_of, graphs, module, abstract, cfg, batch)
    auto = {cl: _auto(systems, graph_of, n, batch, cl) for cl in clusters}
    return {
        "model": model, "gpus": n, "systems": systems, "settings": results, "trace_s": trace_s,
        "auto": auto,
    }  # fmt: skip


def _graph_of(graphs: dict, module, abstract, cfg, batch: int, m: int):
    """The graph of one of ``m`` micro-batches (traced once per size)."""
    size = batch // m
    if size not in graphs:
        graphs[size] = _trace(module, abstract, cfg, size)
    return graphs[size]


def _auto(systems: dict, graph_of, n: int, batch: int, cluster: str) -> dict:
    """``jscaler auto`` on the cell: the joint search (``jscaler.search.search``) over every
    system's settings, each at its own micro-batch count, beside the engine's own
    candidates (the ILP on one axis, ILP pipelines cut by the stage DP) and the registered
    schedules; fp16, Adam, for the cluster's memory. Timed from scratch (no cache)."""
    import schedules  # noqa: F401  (registers the schedules the search tries)
    from jscaler.search import Candidate, search
    from spaces import SPACES

    cands, seen = [], set()
    for settings in systems.values():
        for expr, name, kw, size in settings:
            if expr in seen:
                continue
            seen.add(expr)
            extra = {"time_limit": ILP_LIMIT} if name == "alpa_like" else {}
            cands.append(
                Candidate(
                    expr, SPACES[name](**kw, **extra), state_shards(name, kw, n),
                    kw.get("pp", 1), batch // size, fallback_of=_less_colocated(name, kw),
                    recompute=kw.get("recompute", 0),
                )
            )  # fmt: skip
    counts = sorted({c.microbatches for c in cands})
    start = time.perf_counter()
    result = search(
        graph_of, n, cluster=cluster, dtype="fp16", optimizer_slots=SLOTS,
        microbatches=tuple(counts), candidates=tuple(cands), registered=False,
        ilp_time_limit=ILP_LIMIT, cache=False,
    )  # fmt: skip
    took = time.perf_counter() - start
    out = {"search_s": took, "tries": len(result.rows)}
    out["pruned"] = sum(r.note.startswith("pruned") for r in result.rows)
    if result.best is None:
        return out
    est = result.estimate
    tags = result.best.label().split("[")[1].rstrip("]")  # its micro-batches, schedule
    if _recomputes(result.plan):
        tags += ", recompute"
    return out | {
        "plan": f"{result.plan.name} [{tags}]",
        "step_s": est.step_time,
        "tflops": est.model_flops / est.step_time / 1e12,
        "samples_s": batch / est.step_time,
        "gib": est.memory["total"] / 2**30,
        "fits": True,
        "explain": result.explain(),
    }


def _recomputes(plan) -> bool:
    """Whether the plan (any of a pipeline's group plans) recomputes layers: auto may drop
    the grid's layer-wise recomputation where a plan fits without it."""
    return any(p.recompute for p in plan.spmd_plans)


def best(result: dict, system: str, cluster: str) -> tuple[str, dict] | None:
    """The system's fastest setting that fits on the cluster."""
    found = [
        (expr, r[cluster])
        for expr, *_ in result["systems"][system]
        if cluster in (r := result["settings"][expr]) and r[cluster]["fits"]
    ]
    return max(found, key=lambda x: x[1]["tflops"]) if found else None


def search_seconds(result: dict, system: str) -> float:
    """Wall time this machine spent planning and predicting the system's settings."""
    settings = result["settings"]
    return sum(settings[e].get("plan_s", 0.0) for e, *_ in result["systems"][system])


def run(models=MODELS, gpus=GPUS, clusters=CLUSTERS, workers: int = 2, progress=None) -> list:
    """One :func:`cell` per (model, GPU count), ``workers`` processes at a time."""
    import multiprocessing as mp

    # the largest cells first, so the two workers finish together
    jobs = [(m, n, tuple(clusters)) for n in sorted(gpus, reverse=True) for m in models]
    out = []
    if workers <= 1:
        for job in jobs:
            out.append(cell(*job))
            if progress:
                progress(out[-1])
    else:
        with mp.get_context("spawn").Pool(workers) as pool:
            for r in pool.imap_unordered(_cell, jobs):
                out.append(r)
                if progress:
                    progress(r)
    return sorted(out, key=lambda r: (list(models).index(r["model"]), r["gpus"]))


def _cell(job):
    return cell(*job)


def table(results: list, clusters=CLUSTERS) -> list[str]:
    from bench.table import columns

    rows = []
    for cl in clusters:
        for r in results:
            ours = best(r, "nnScaler", cl)
            baselines = {s: best(r, s, cl) for s in r["systems"] if s != "nnScaler"}
            fitting = [b for b in baselines.values() if b]
            top = max((b[1]["tflops"] for b in fitting), default=None)
            paper = PAPER.get((r["model"], cl, r["gpus"]))
            for system in r["systems"]:
                b = ours if system == "nnScaler" else baselines[system]
                if b is None:
                    cells = ["OOM", "-", "-", "-"]
                else:
                    x = b[1]
                    cells = [x["plan"], f"{x['tflops']:.1f}", f"{x['samples_s']:.2f}"]
                    cells.append(f"{x['gib']:.1f}")
                if system == "nnScaler":
                    vs = f"{ours[1]['tflops'] / top:.2f}x best" if ours and top else "-"
                    ref = f"{paper[0]}x {paper[1]}" if paper else ""
                else:
                    vs = f"{ours[1]['tflops'] / b[1]['tflops']:.2f}x" if ours and b else "-"
                    ref = ""
                rows.append(
                    [r["model"], str(r["gpus"]), cl, system, *cells, vs, ref]
                    + [f"{search_seconds(r, system):.0f}"]
                )
            if (auto := r.get("auto", {}).get(cl)) is not None:
                rows.append(_auto_row(r, cl, auto, ours, top))
    cols = [
        "model", "GPUs", "cluster", "system", "best setting (SIMULATED)", "TFLOPS",
        "samples/s", "GiB/GPU", "nnScaler", "paper", "search s",
    ]  # fmt: skip
    return columns(cols, rows, left=5)


def _auto_row(r: dict, cl: str, auto: dict, ours, top) -> list[str]:
    """The "jscaler auto" row: its best against the best of every other row."""
    best = max([b[1]["tflops"] for b in [ours] if b] + ([top] if top else []), default=None)
    if "plan" not in auto:
        cells, vs = ["OOM", "-", "-", "-"], "-"
    else:
        cells = [auto["plan"], f"{auto['tflops']:.1f}", f"{auto['samples_s']:.2f}"]
        cells.append(f"{auto['gib']:.1f}")
        vs = f"{auto['tflops'] / best:.2f}x all" if best else "-"
    tries = f"{auto['search_s']:.0f} ({auto['tries']} tries, {auto['pruned']} pruned)"
    return [r["model"], str(r["gpus"]), cl, "jscaler auto", *cells, vs, "", tries]


def dgx1_drop(results: list) -> list[str]:
    """Each system's throughput change from DGX-2 to DGX-1 at 32 GPUs, beside the paper's."""
    from bench.table import columns

    rows = []
    for r in results:
        if r["gpus"] != 32 or not set(CLUSTERS) <= set(_clusters(r)):
            continue
        for system in r["systems"]:
            a, b = best(r, system, "dgx2_v100"), best(r, system, "dgx1_v100")
            change = f"{b[1]['tflops'] / a[1]['tflops'] - 1:+.0%}" if a and b else "-"
            paper = PAPER_DGX1_DROP.get(system) if r["model"] == "swin" else None
            rows.append([r["model"], system, change, f"{paper:+.0%}" if paper else ""])
    cols = ["model", "system", "DGX-1 vs DGX-2 (SIMULATED)", "paper"]
    return columns(cols, rows, left=2)


def _clusters(result: dict) -> set[str]:
    return {k for r in result["settings"].values() for k in r if k.endswith("_v100")}


def main(args) -> int:
    import json

    from jscaler import PlanError

    models = [args.model] if args.model else MODELS
    gpus = [args.devices] if args.devices else GPUS
    if set(models) - set(MODELS) or set(gpus) - set(GPUS):
        raise PlanError(
            f"bench paper runs the paper's models {list(MODELS)} at {list(GPUS)} GPUs; got "
            f"--model {args.model} --devices {args.devices}"
        )
    start = time.perf_counter()
    done = []

    def progress(r):
        done.append(r)
        print(
            f"  [{len(done)}/{len(models) * len(gpus)}] {r['model']} at {r['gpus']} GPUs "
            f"({time.perf_counter() - start:.0f} s)",
            flush=True,
        )

    results = run(models, gpus, progress=None if args.json else progress)
    if args.json:
        print(json.dumps(results, indent=1, default=str))
        return 0
    print(
        "nnScaler's section 8.3 comparison, SIMULATED by jscaler's cost model (no GPU ran): "
        "best fitting setting per system, aggregate effective TFLOPS, fp16, global batch "
        "256 (AlphaFold2 128); 'nnScaler' column: its speedup over this row (over the best "
        "baseline on its own row; 'jscaler auto': its speedup over the best of every other "
        "row); 'paper': the speedup the paper reports there; 'search s': this machine's "
        "time planning and predicting the system's settings (auto: its whole joint search, "
        "from scratch)"
    )
    print("\n".join(table(results)))
    print()
    print("\n".join(dgx1_drop(results)))
    print(f"\ntook {time.perf_counter() - start:.0f} s")
    return 0
