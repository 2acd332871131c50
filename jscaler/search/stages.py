"""Stage slicing: where to cut the repeated layers into pipeline stages (Alpa's DP).

A pipeline of ``pp`` stages running ``m`` micro-batches takes about ``sum(t_s) + (m - 1) *
max(t_s)`` (the first micro-batch crosses every stage, the rest follow at the pace of the
slowest). Given each layer's cost on a stage's devices under the stage's plan, the
contiguous split of the layers into ``pp`` stages minimising that latency is found by
dynamic programming over (layers placed, stages used) for every candidate bottleneck
``t_max`` (Alpa enumerates the same way): ``best(t_max) = min sum(t_s)`` over splits with
every ``t_s <= t_max``; the answer is ``min over t_max of best(t_max) + (m - 1) t_max``.

The units cut are the *runs* of repeated layers in execution order: a run is a layer's
ops from one start to the next op outside it, so a model that runs its layers once per
forward pass (AlphaFold2's recycling) has one run per layer per pass, and the cuts, which
place ops by execution order (``PipelinePlan.cuts``), fall where the costs say. A run's
cost comes from the cost model: each op's forward and backward on the roofline (slowest
device of the stage's plan) plus the collectives of the tensors it makes; ops outside the
layers (an embedding, a head, the glue between passes) ride with the run before them, those
before the first run with the first, as a cut at a run's first op places them.
``slice_stages`` returns the cut op ids a :class:`PipelinePlan` takes (``cuts``).
"""

from __future__ import annotations

import itertools

from jscaler.compile.comm import comm_table, needs_grad
from jscaler.compile.lower import lower
from jscaler.cost.cluster import Cluster, get_cluster
from jscaler.cost.collective import collective_time
from jscaler.cost.estimate import device_times
from jscaler.cost.precision import value_scale
from jscaler.errors import PlanError
from jscaler.ir.graph import Graph
from jscaler.plan.plan import Plan

__all__ = ["best_split", "layer_costs", "slice_stages"]


def layer_costs(
    plan: Plan, cluster: str | Cluster = "cpu", dtype: str = "fp32"
) -> list[tuple[int, float]]:
    """Per run of a repeated layer (see the module doc), in execution order: its first op
    id and the seconds of one micro-batch's forward + backward of it and of the ops outside
    the layers that ride with it, under ``plan`` (a stage group's plan)."""
    cl = get_cluster(cluster)
    g = plan.pgraph.graph
    if not plan.graph.layers():
        raise PlanError("stage slicing cuts repeated layers; the graph has none")
    recomputed = {o for grp in plan.recompute for o in grp}
    times = device_times(plan, cl, dtype, needs_grad(g), recomputed)
    op_cost = {
        o: max((f.get(d, 0.0) + b.get(d, 0.0) for d in plan.mesh.devices), default=0.0)
        for o, (f, b) in times.items()
    }
    producer = {t: o.id for o in g.ops for t in o.outputs}
    mesh = plan.mesh
    for r in comm_table(lower(plan, None), 1).rows:
        if r.tensor in producer and r.phase != "update":
            fixed = {a: 0 for a in mesh.names if a not in r.axes}
            nbytes = r.bytes * value_scale(dtype, g)
            t = collective_time(r.collective, nbytes, mesh.group(**fixed), cl) * r.times
            op_cost[producer[r.tensor]] = op_cost.get(producer[r.tensor], 0.0) + t
    starts = {ids[0]: k for k, (_, ids) in enumerate(plan.graph.layer_runs())}
    costs = [0.0] * len(starts)
    k = 0  # ops before the first run ride with it
    for o in g.ops:
        k = starts.get(o.id, k)
        costs[k] += op_cost.get(o.id, 0.0)
    return list(zip(starts, costs))


def best_split(costs: list[float], pp: int, microbatches: int) -> tuple[list[int], float]:
    """Stage sizes (layers per stage, all >= 1) minimising ``sum + (m-1) * max`` of the
    stages' summed costs, and that latency (see the module doc)."""
    n = len(costs)
    if not 1 <= pp <= n:
        raise PlanError(f"cannot cut {n} layers into {pp} stages; use 1..{n} stages")
    prefix = [0.0, *itertools.accumulate(costs)]

    def span(i, j):  # layers i..j-1
        return prefix[j] - prefix[i]

    candidates = sorted({span(i, j) for i in range(n) for j in range(i + 1, n + 1)})
    best = (float("inf"), None)
    for t_max in candidates:
        inf = float("inf")
        # dp[s][j]: least sum placing layers 0..j-1 into s stages, each <= t_max
        dp = [[inf] * (n + 1) for _ in range(pp + 1)]
        cut = [[0] * (n + 1) for _ in range(pp + 1)]
        dp[0][0] = 0.0
        for s in range(1, pp + 1):
            for j in range(s, n + 1):
                for i in range(s - 1, j):
                    c = span(i, j)
                    if c <= t_max + 1e-15 and dp[s - 1][i] + c < dp[s][j]:
                        dp[s][j], cut[s][j] = dp[s - 1][i] + c, i
        if dp[pp][n] == inf:
            continue
        latency = dp[pp][n] + (microbatches - 1) * t_max
        if latency < best[0] - 1e-15:
            sizes, j = [], n
            for s in range(pp, 0, -1):
                i = cut[s][j]
                sizes.append(j - i)
                j = i
            best = (latency, sizes[::-1])
    return best[1], best[0]


def slice_stages(
    graph: Graph,
    plan: Plan,
    pp: int,
    microbatches: int,
    cluster: str | Cluster = "cpu",
    dtype: str = "fp32",
) -> tuple[int, ...]:
    """The op ids starting stages 1..pp-1 (``PipelinePlan.cuts``) for ``graph``'s layers
    cut by :func:`best_split` of their runs' costs (:func:`layer_costs`) under ``plan`` (a
    stage group's plan)."""
    runs = layer_costs(plan, cluster, dtype)
    sizes, _ = best_split([secs for _, secs in runs], pp, microbatches)
    starts, k = [], 0
    for size in sizes[:-1]:
        k += size
        starts.append(runs[k][0])
    return tuple(starts)
