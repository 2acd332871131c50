"""Stage slicing: where to cut the repeated layers into pipeline stages (Alpa's DP).

A pipeline of ``pp`` stages running ``m`` micro-batches takes about ``sum(t_s) + (m - 1) *
max(t_s)`` (the first micro-batch crosses every stage, the rest follow at the pace of the
slowest). Given each layer's cost on a stage's devices under the stage's plan, the
contiguous split of the layers into ``pp`` stages minimising that latency is found by
dynamic programming over (layers placed, stages used) for every candidate bottleneck
``t_max`` (Alpa enumerates the same way): ``best(t_max) = min sum(t_s)`` over splits with
every ``t_s <= t_max``; the answer is ``min over t_max of best(t_max) + (m - 1) t_max``.

Layer costs come from the cost model: each op's forward and backward on the roofline
(slowest device of the stage's plan) plus the collectives of the tensors it makes, summed
per repeated layer; ops outside the layers (an embedding, a head) join the first or last
stage. ``slice_stages`` returns the cut op ids a :class:`PipelinePlan` takes (``cuts``).
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


def layer_costs(plan: Plan, cluster: str | Cluster = "cpu", dtype: str = "fp32"):
    """(per repeated layer seconds, seconds before the first layer, after the last) of one
    micro-batch's forward + backward under ``plan`` (a stage group's plan)."""
    cl = get_cluster(cluster)
    g = plan.pgraph.graph
    layers = plan.graph.layers()
    if not layers:
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
    layer_of = {o.id: i for i, lay in enumerate(layers) for o in lay.graph.ops}
    order = [o.id for o in g.ops]
    head = min(k for k, o in enumerate(order) if o in layer_of)
    costs = [0.0] * len(layers)
    before = after = 0.0
    for k, o in enumerate(order):
        if o in layer_of:
            costs[layer_of[o]] += op_cost.get(o, 0.0)
        elif k < head:
            before += op_cost.get(o, 0.0)
        else:
            after += op_cost.get(o, 0.0)
    return costs, before, after


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
    cut by :func:`best_split` of their costs under ``plan`` (a stage group's plan)."""
    costs, before, after = layer_costs(plan, cluster, dtype)
    costs = list(costs)
    costs[0] += before  # the embedding rides with the first layer, the head with the last
    costs[-1] += after
    sizes, _ = best_split(costs, pp, microbatches)
    layers = graph.layers()
    starts, k = [], 0
    for size in sizes[:-1]:
        k += size
        starts.append(min(o.id for o in layers[k].graph.ops))
    return tuple(starts)
