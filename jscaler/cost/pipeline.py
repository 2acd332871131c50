"""Predicted step of a pipeline plan: per-stage block costs on the schedule's timeline.

Stages are cut as the runtime cuts them (``pass_of_ops``, ``stage_of_ops``); stage ``s``
runs on group ``placement[s]`` under that group's plan. A block's duration is its stage's
share of the cost model on the group's slowest device: ``F`` (pass k) the forward of the
stage's ops of pass k plus their forward collectives and the point-to-point receives of
their inputs from other groups; ``B`` the backward (recomputation included) plus the
backward collectives and the sends of the input gradients back; with a split backward,
``B`` and ``W`` take half each; ``R`` a forward again. The schedule is simulated with these
durations (:func:`jscaler.simulate`); the step is the makespan plus the optimizer-side work
of the slowest group: parameter gradients accumulate over the micro-batches and are
reduced once after the pipeline drains, then the update runs. Each group's plan covers
the whole graph; a group is charged only the collectives of its own stages and of the
parameters they read. Collective bytes count what the runtime runs: each micro-batch's
backward program reduce-scatters its stage's parameter gradients into the stage's
accumulator (``Lowered.accumulator``; the timing above still assumes one reduction per
step, as Megatron-LM accumulates before reducing). Memory per device: the parameter
copies, the gradients as made and the accumulator of its group's stages plus each stage's kept
activations times the micro-batches the schedule holds in flight there, summed over the
groups a device belongs to; plus, once, the update's share of the master parameters and
optimizer state, which the runtime splits over every pipeline device.
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass

import jax.numpy as jnp

from jscaler.compile.comm import comm_table, from_params_only, needs_grad
from jscaler.compile.lower import lower
from jscaler.cost.cluster import Cluster, get_cluster
from jscaler.cost.collective import Combined, collective_time
from jscaler.cost.estimate import Estimate, check_expert_skew, device_times, flops_of
from jscaler.cost.memory import (
    cotangent_extra,
    local_bytes,
    memory_breakdown,
    recompute_groups,
    recomputed_ops,
    reduced_bytes,
    saved_for_backward,
    shared_params,
    unreduced_grad,
    working_set,
)
from jscaler.cost.precision import row_scale, state_scale, value_scale
from jscaler.errors import ScheduleError
from jscaler.ir.graph import Literal
from jscaler.plan.pipeline import PipelinePlan, pass_of_ops, stage_of_ops
from jscaler.plan.schedule import Schedule, one_f_one_b
from jscaler.plan.timeline import simulate

__all__ = ["estimate_pipeline", "shared_costs"]


def _schedule(plan: PipelinePlan, schedule, microbatches: int) -> Schedule:
    schedule = schedule or plan.schedule or one_f_one_b
    if callable(schedule) and not isinstance(schedule, Schedule):
        built, key = _BUILT.get(), (schedule, plan.pipeline_groups, microbatches)
        if built is not None and not isinstance(schedule, Hashable):
            built = None  # a callable object that defines equality but no hash
        if built is not None and key in built:
            return built[key]
        schedule = schedule(plan.pipeline_groups, microbatches)
        if built is not None and isinstance(schedule, Schedule):
            built[key] = schedule
    if not isinstance(schedule, Schedule):
        raise ScheduleError(f"schedule must be a Schedule or a function, got {schedule!r}")
    return schedule


def estimate_pipeline(
    plan: PipelinePlan,
    cluster: str | Cluster = "cpu",
    *,
    microbatches: int,
    schedule=None,
    dtype: str = "fp32",
    optimizer_slots: int = 0,
    algorithm: str = "ring",
    expert_skew: float = 1.0,
) -> Estimate:
    """Predicts a pipeline plan's step (see the module doc); ``schedule``: a Schedule or
    a function ``(groups, microbatches) -> Schedule`` (default the plan's own, else 1F1B);
    ``expert_skew``: the router's load imbalance, as :func:`jscaler.estimate` takes it."""
    check_expert_skew(expert_skew)
    cl = get_cluster(cluster)
    sched = _schedule(plan, schedule, microbatches)
    costs = _shared_costs(plan, sched, cl, microbatches, dtype, algorithm, expert_skew)
    fwd_cost, bwd_cost, last = costs.fwd, costs.bwd, sched.passes - 1
    split = sched.split_backward

    def duration(b) -> float:
        if b.kind in ("F", "R"):
            return fwd_cost.get((b.stage, b.pass_ if b.kind == "F" else last), 0.0)
        return bwd_cost.get(b.stage, 0.0) * (0.5 if split else 1.0)

    timeline = simulate(sched, duration)
    step = timeline.makespan + max(costs.update.values(), default=0.0)
    busy = max(timeline.busy(gi) for gi in range(len(plan.groups)) if gi not in sched.whole)
    flight = sched.in_flight()
    memory = {gi: m.with_flight(flight) for gi, m in costs.memory.items()}
    # a device in several groups (the all-device group of an interlaced plan) holds each
    per_device: dict[int, dict] = {}
    for gi, group in enumerate(plan.groups):
        for d in group.devices:
            acc = per_device.setdefault(d, dict.fromkeys(memory[gi], 0.0))
            for key, v in memory[gi].items():
                acc[key] += v
    # the update's state, once per device: master parameters and optimizer moments split
    # over every pipeline device (ZeRO-1 across the pipeline, jscaler.runtime.handoff)
    masters = state_scale(dtype, plan.graph)  # fp32 masters of a graph traced in bf16
    state = masters * (1 + optimizer_slots) * _update_share(plan.graph, len(plan.devices))
    for acc in per_device.values():
        acc["optimizer"] += state
        acc["total"] += state
    worst = max(per_device.values(), key=lambda m: m["total"])
    n_devices = len(plan.devices)
    total_comm = sum(costs.update.values())
    return Estimate(
        plan.name or "pipeline",
        cl.name,
        n_devices,
        busy,
        total_comm,
        max(0.0, step - busy),
        step,
        worst,
        max(costs.moved.values(), default=0),
        costs.model * microbatches,
        costs.hardware * microbatches,
        cl.peak(dtype),
        timeline.bubble(),
        timeline,
        dict(sorted(per_device.items())),
    )


@dataclass(frozen=True)
class _GroupMemory:
    """A group's memory per device but its stages' activations held per micro-batch in
    flight: ``(stage, bytes)`` per micro-batch (before ``scale``), the rest fixed."""

    params: float
    grads: float
    optimizer: float
    batch: float
    scale: float  # of the activations' bytes (the compute dtype's)
    stage_bytes: tuple[tuple[int, float], ...]
    working: float  # the working set of a recomputed group (scaled)

    def with_flight(self, flight) -> dict:
        acts = 0.0
        for s, nbytes in self.stage_bytes:
            acts += self.scale * flight[s] * nbytes
        acts += self.working
        return memory_breakdown(self.params, self.grads, self.optimizer, self.batch, acts)


@dataclass(frozen=True)
class _Costs:
    """What a pipeline's prediction takes from its stages, whatever the schedule's order
    of blocks: per (stage, pass) forward and per stage backward seconds, per group the
    optimizer-side seconds, collective bytes and memory, and the model and hardware FLOPs
    of one micro-batch."""

    fwd: dict
    bwd: dict
    update: dict
    moved: dict
    memory: dict
    model: float
    hardware: float


# the last pipeline's costs (its groups, the key, the costs) while a shared_costs() block
# runs: plan="auto" predicts a pipeline under every schedule one after another
_LAST: ContextVar[list | None] = ContextVar("jscaler_pipeline_costs", default=None)
# (schedule function, groups, micro-batches) -> the schedule it made, in the same block:
# every pipeline of a search with as many groups is timed under the same few schedules
_BUILT: ContextVar[dict | None] = ContextVar("jscaler_pipeline_schedules", default=None)


@contextmanager
def shared_costs() -> Iterator[None]:
    """Within it, a pipeline predicted again under another schedule of the same stages,
    passes, placement and micro-batches (1F1B, GPipe, zero-bubble) reuses its per-stage
    costs: only the timeline and the activations in flight are the schedule's (holds the
    last pipeline's costs only); and a schedule function called again with the same
    groups and micro-batches is not called again (schedules are immutable values)."""
    token, built = _LAST.set([]), _BUILT.set({})
    try:
        yield
    finally:
        _LAST.reset(token)
        _BUILT.reset(built)


def _shared_costs(plan, sched, cl, microbatches, dtype, algorithm, expert_skew) -> _Costs:
    key = (
        plan.cuts, sched.stages, sched.passes, sched.placement, sched.microbatches, cl,
        microbatches, dtype, algorithm, expert_skew,
    )  # fmt: skip
    slot = _LAST.get()
    if slot and slot[1] == key and len(slot[0]) == len(plan.groups):
        if all(a.plan is b.plan and a.devices == b.devices for a, b in zip(slot[0], plan.groups)):
            return slot[2]
    costs = _costs(plan, sched, cl, microbatches, dtype, algorithm, expert_skew)
    if slot is not None:
        slot[:] = [plan.groups, key, costs]
    return costs


def _costs(plan, sched, cl, microbatches, dtype, algorithm, expert_skew) -> _Costs:
    g = plan.graph
    act, masters = value_scale(dtype, g), state_scale(dtype, g)
    pass_of, stage_of = g.memo(  # shared by every prediction cutting g alike: read only
        (_cut, sched.passes, sched.stages, plan.cuts), lambda: _cut(g, sched, plan.cuts)
    )
    last = sched.passes - 1
    needs = needs_grad(g)
    fwd_cost: dict[tuple[int, int], float] = {}  # (stage, pass) -> seconds
    bwd_cost: dict[int, float] = {}
    update: dict[int, float] = {}  # group -> optimizer-side collectives
    memory: dict[int, dict] = {}
    moved: dict[int, int] = {}  # group -> collective bytes per device per step
    hardware = 0.0
    producer = {t: o for o in g.ops for t in o.outputs}
    first_user = {}
    for o in g.ops:
        if o.id in stage_of:
            for t in o.tensor_inputs:
                first_user.setdefault(t, o)
    by_block: dict[tuple[int, int], list] = {}  # (stage, pass) -> its ops, in graph order
    for o in g.ops:
        if o.id in stage_of:
            by_block.setdefault((stage_of[o.id], pass_of[o.id]), []).append(o)
    for gi, group in enumerate(plan.groups):
        gp = group.plan
        low = lower(gp, None)
        recomputed = recomputed_ops(gp)
        times = device_times(gp, cl, dtype, needs, recomputed, expert_skew)
        mesh = gp.mesh
        stages = [s for s in range(sched.stages) if sched.placement[s] == gi]

        def where(t):
            op = producer.get(t)
            if op is None or op.id not in stage_of:
                op = first_user.get(t)
            return (stage_of[op.id], pass_of[op.id]) if op is not None else (None, None)

        for s in stages:
            for k in range(sched.passes):
                ops = by_block.get((s, k), [])
                f = {d: 0.0 for d in mesh.devices}
                b = dict(f)
                for o in ops:
                    for d, t in times[o.id][0].items():
                        f[d] += t
                    if k == last:
                        for d, t in times[o.id][1].items():
                            b[d] += t
                fwd_cost[s, k] = max(f.values())
                if k == last:
                    bwd_cost[s] = max(b.values())
                    hardware += flops_of(g, needs, recomputed, ops)[1]
                else:
                    hardware += sum(o.flops for o in ops)
        # the group's plan covers the whole graph: charge it only what its stages run
        pg = gp.pgraph
        on_here = [o for o in pg.graph.ops if _on(o, gi, stage_of, sched, pg.graph)]
        read_here = {x for o in on_here for x in o.inputs}
        # a parameter read on several stages (a tied embedding and LM head) has each
        # reader's gradient reduced on its own stage (by op: T5's two lookups share a path)
        here_ids = {o.id for o in on_here}
        opt = {d: 0.0 for d in mesh.devices}  # optimizer-side ops, once per step
        for vop in (*pg.grad_ops, *pg.update_ops):
            if vop.inputs[0] in read_here:
                for d, t in times[vop.id][1].items():
                    opt[d] += t
        update[gi] = max(opt.values())
        moved[gi] = 0
        combined = Combined(cl, algorithm)  # gradient reductions, ZeRO all-gathers
        from_params = from_params_only(pg.graph)
        for r in comm_table(low, 1, accumulate=True).rows:
            role = pg.graph.tensors[r.tensor].role
            s, k = where(r.tensor)
            if role == "param" and r.phase == "backward":
                if r.op not in here_ids:
                    continue
            elif role == "param" or r.phase == "update":
                if r.tensor not in read_here:
                    continue
            elif s is None or sched.placement[s] != gi:
                continue
            fixed = {a: 0 for a in mesh.names if a not in r.axes}
            devs = [group.devices[mesh.devices.index(d)] for d in mesh.group(**fixed)]
            grad = r.phase == "backward" and r.tensor in from_params
            nbytes = r.bytes * row_scale(r.phase, grad, act, masters)
            # each micro-batch's backward program reduces its parameter gradients (the
            # stages run one program per micro-batch); the update side runs once
            moved[gi] += r.bytes * r.times * (1 if r.phase == "update" else microbatches)
            if grad or r.phase == "update":  # once per step, after the pipeline drains
                combined.add(None, r.collective, devs, nbytes)
                continue
            t = collective_time(r.collective, nbytes, devs, cl, algorithm) * r.times
            if r.phase == "backward":
                bwd_cost[s] = bwd_cost.get(s, 0.0) + t
            else:
                fwd_cost[s, k] = fwd_cost.get((s, k), 0.0) + t
        update[gi] += combined.seconds().get(None, 0.0)
        memory[gi] = _group_memory(
            act, gp, low, g, stages, stage_of, by_block, last, sched, cl, masters
        )

    # point-to-point: a value crossing groups is received before the consumer's forward
    # and its gradient sent back before the producer's backward ends
    for o in g.ops:
        if o.id not in stage_of:
            continue
        dst = (stage_of[o.id], pass_of[o.id])
        for x in o.tensor_inputs:
            op = producer.get(x)
            if op is None or op.id not in stage_of:
                continue
            src = (stage_of[op.id], pass_of[op.id])
            ga, gb = sched.placement[src[0]], sched.placement[dst[0]]
            if ga == gb:
                continue
            devs = [*plan.groups[ga].devices[:1], *plan.groups[gb].devices[:1]]
            tensor = g.tensors[x]
            nbytes = math.prod(tensor.shape) * jnp.dtype(tensor.dtype).itemsize
            nbytes *= act / len(plan.groups[gb].devices)
            t = collective_time("send", nbytes, devs, cl)
            fwd_cost[dst] = fwd_cost.get(dst, 0.0) + t
            if x in needs and src[1] == last:
                bwd_cost[src[0]] = bwd_cost.get(src[0], 0.0) + t

    model, _ = flops_of(g, needs, set(), [o for o in g.ops if pass_of[o.id] == last])
    model += sum(o.flops for o in g.ops if pass_of[o.id] != last)
    return _Costs(fwd_cost, bwd_cost, update, moved, memory, model, hardware)


def _cut(g, sched, cuts) -> tuple[dict, dict]:
    """Op id -> its forward pass, and op id -> its stage, as the runtime cuts them."""
    pass_of = pass_of_ops(g, sched.passes)
    return pass_of, stage_of_ops(g, sched.stages, cuts, pass_of)


def _on(op, gi: int, stage_of, sched, graph) -> bool:
    """Whether a (plan graph) op runs on group gi: its stage's group, or for an op outside
    the base graph (a ZeRO-3 gather), a consumer's."""
    s = stage_of.get(op.id)
    if s is not None:
        return sched.placement[s] == gi
    users = [u for t in op.outputs for u in graph.consumers(t)]
    return any(_on(u, gi, stage_of, sched, graph) for u in users)


def _update_share(g, n: int) -> float:
    """Bytes of one copy of the parameters per device when the update splits each over
    ``n`` devices along its first axis ``n`` divides (else keeps it whole), as
    ``jscaler.runtime.handoff.zero_spec`` lays out the master copy and its moments."""
    return g.memo((_update_share, n), lambda: _share_of(g, n))


def _share_of(g, n: int) -> float:
    total = 0.0
    for p in g.params():
        nbytes = math.prod(p.shape) * jnp.dtype(p.dtype).itemsize
        total += nbytes / n if any(d % n == 0 for d in p.shape) else nbytes
    return total


def _group_memory(
    scale, gp, low, g, stages, stage_of, by_block, last, sched, cl, state: float = 1.0
) -> _GroupMemory:
    """A group's stages' memory per device: their parameter copies and gradients (see
    below), batch and kept activations per micro-batch in flight (the update's master
    copy and optimizer state are not the group's: :func:`_update_share`); ``by_block``:
    (stage, pass) -> its ops in graph order, as :func:`_costs` groups them."""
    sizes = gp.mesh.shape

    def size(t, layout):
        return local_bytes(g, t, layout, sizes)

    mine = [o for o in g.ops if stage_of.get(o.id) in stages]
    read = {x for o in mine for x in o.tensor_inputs}
    params = [t for t in low.update if t in read]
    p_bytes = sum(size(t, low.storage[t]) for t in params)
    # a micro-batch's backward program holds its gradients unreduced and reduced into the
    # stage's accumulator layout, beside the sum over the earlier micro-batches (donated
    # into it, split over the group's devices: Stage.accumulators). Without a native
    # reduce-scatter (XLA CPU) the reduction writes the whole gradient, then slices it
    # (measured: swin-tiny megatron(pp=2), stage 1, 2.0x its gradients in temp). Where the
    # gradient is made split over every axis (tp alone), nothing is reduced: it is added
    # into the accumulator as made (measured: the variant bench's megatron(tp=4, pp=2))
    acc = {t: low.accumulator(t) for t in params}
    grads = 0.0
    for t in params:
        made = unreduced_grad(low, t)
        grads += size(t, made)
        if made != acc[t]:
            grads += reduced_bytes(low, t, cl, acc[t] if cl.reduce_scatter else None)
    if sched.microbatches > 1:
        grads += sum(size(t, acc[t]) for t in params)
    # a parameter read by several of the group's ops (T5's embedding: both lookups and
    # the tied LM head) has each reader's gradient contribution and their sum live, as in
    # one SPMD step (memory.shared_params)
    mine_ids = {o.id for o in mine}
    for t, readers in shared_params(g).items():
        here = sum(o.id in mine_ids for o in readers)
        if t in params and here > 1:
            grads += 2 * (here - 1) * size(t, unreduced_grad(low, t))
    opt = 0.0
    batch = sum(
        size(t, low.storage[t]) for t in g.inputs if g.tensors[t].role == "batch" and t in read
    )
    # the residuals a stage's forward program returns are what JAX's vjp saves, not what
    # XLA would keep in one fused step: Cluster.fuses_elementwise does not apply to them
    saved = saved_for_backward(g, recompute_groups(gp), views=True)
    stage_bytes, extra = [], 0.0
    for s in stages:
        ops = by_block.get((s, last), [])
        kept = {
            t: size(t, lay)
            for o in ops
            for t, lay in zip(o.outputs, low.ops[o.id].outputs)
            if t in saved and not isinstance(t, Literal)
        }
        stage_bytes.append((s, sum(kept.values())))
        # a micro-batch's backward holds its cotangents beside the residuals not yet freed
        extra = max(extra, cotangent_extra(low, g, ops, kept, cl.fuses_elementwise))
    # a recomputed layer is rerun inside the backward program, one XLA step: fused there
    working = scale * max(extra, working_set(low, {o.id for o in mine}, cl.fuses_elementwise))
    return _GroupMemory(
        state * p_bytes, state * grads, opt, batch, scale, tuple(stage_bytes), working
    )
