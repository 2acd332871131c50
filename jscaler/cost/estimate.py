"""Predicted step time and memory of an SPMD plan on a cluster, without running it.

* **Compute**: every leaf sub-op runs ``op.flops`` times the fraction its splits leave it
  (1/n per split level, 1 per replicate level), forward once, backward twice for
  contractions (input and weight gradients) and once for other differentiable ops, again
  forward when recomputed. Its time is the roofline ``max(flops / (peak * efficiency),
  bytes / memory bandwidth)``, bytes being the op's inputs and outputs scaled the same way,
  plus ``Cluster.kernel_seconds`` per kernel it launches (a GPU's per-kernel cost; see
  :func:`jscaler.cost.fusion.kernels`). A device's compute time is the sum over its
  sub-ops; the step takes the slowest device.
  A ``ragged_dot`` split along its groups (the experts of a dropless MoE over ``ep``)
  does work in proportion to its groups' rows, which the router decides: its pieces are
  charged ``expert_skew`` times their even share (the busiest device's rows over the
  mean, at most the split's ways), since the partial sums' reduction waits for the
  busiest. A capacity dispatch's expert matmuls have a fixed size and no skew.
* **Communication**: the plan's comm table (the collectives its layouts imply, the same
  table a test holds the compiled HLO to), each timed by :func:`collective_time` on the
  links its group spans. Gradient reductions of parameters happen once per step
  (accumulated over micro-batches first, as Megatron-LM and DeepSpeed do; jscaler's SPMD
  runtime still reduces inside each micro-batch) and overlap the backward compute (as DDP
  buckets do); everything else is exposed, the optimizer side (ZeRO's all-gather of the
  updated parameters) included.
* **Memory per device**: :mod:`jscaler.cost.memory`.
* **MFU / HFU**: model FLOPs per step (forward + backward of the unsplit graph, 3x its
  forward FLOPs as in PaLM's appendix B) over step time x devices x peak; HFU counts the
  recomputed forward too.

The estimate is an order-of-magnitude model, not a profiler: beyond the fusion and
per-kernel cost of the GPU presets, it ignores XLA's scheduling, rematerialisation and
buffer reuse. ``tests/test_cost.py`` and
``jscaler bench cost`` compare it against XLA's ``memory_analysis()`` and compiled HLO.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import jax.numpy as jnp

from jscaler.compile.comm import NON_DIFFERENTIABLE, comm_table, from_params_only, needs_grad
from jscaler.compile.lower import lower
from jscaler.cost.cluster import Cluster, get_cluster
from jscaler.cost.collective import Combined, collective_time
from jscaler.cost.fusion import fused_op_bytes, kernels
from jscaler.cost.memory import CONTRACTIONS, local_bytes, recomputed_ops, spmd_memory
from jscaler.cost.precision import compute_roofs, row_scale, state_scale, value_scale
from jscaler.errors import PlanError
from jscaler.plan.plan import Plan

__all__ = [
    "Estimate",
    "check_expert_skew",
    "device_times",
    "estimate",
    "flops_of",
    "roofline_seconds",
]


@dataclass(frozen=True)
class Estimate:
    """One plan's predicted step on one cluster (seconds, bytes per device, FLOPs)."""

    plan: str
    cluster: str
    devices: int
    compute: float  # slowest device's compute seconds
    comm: float  # all collectives, seconds
    exposed_comm: float  # not hidden behind the backward pass
    step_time: float
    memory: dict = field(default_factory=dict)  # params/grads/optimizer/batch/activations/total
    comm_bytes: int = 0
    model_flops: float = 0.0
    hardware_flops: float = 0.0
    peak: float = 0.0
    bubble: float = 0.0  # pipelines: the idle fraction of device-time
    timeline: object = field(default=None, repr=False, compare=False)
    # pipelines: each device's memory dict (``memory`` is the fullest's); empty for an
    # SPMD plan, whose devices all hold ``memory``
    device_memory: dict = field(default_factory=dict, repr=False, compare=False)

    @property
    def mfu(self) -> float:
        return self.model_flops / (self.step_time * self.devices * self.peak)

    @property
    def hfu(self) -> float:
        return self.hardware_flops / (self.step_time * self.devices * self.peak)

    def format(self) -> str:
        mem = self.memory
        return (
            f"{self.plan} on {self.devices} x {self.cluster}: step {self.step_time * 1e3:.2f} ms "
            f"(compute {self.compute * 1e3:.2f}, comm {self.comm * 1e3:.2f}, exposed "
            f"{self.exposed_comm * 1e3:.2f}), MFU {self.mfu:.1%}, HFU {self.hfu:.1%}; memory "
            f"per device {mem['total'] / 2**20:.1f} MiB (params {mem['params'] / 2**20:.1f}, "
            f"grads {mem['grads'] / 2**20:.1f}, optimizer {mem['optimizer'] / 2**20:.1f}, "
            f"activations {mem['activations'] / 2**20:.1f}); collectives "
            f"{self.comm_bytes / 1e6:.2f} MB per device"
        )


def _bwd_factor(op, needs) -> float:
    if op.primitive in NON_DIFFERENTIABLE or not any(t in needs for t in op.outputs):
        return 0.0
    return 2.0 if op.primitive in CONTRACTIONS else 1.0


def _backward_factors(g, needs) -> dict[int, float]:
    """op id -> :func:`_bwd_factor` of each op of ``g``, once per graph and ``needs``
    (kept with the table, so its id names it while the graph lives)."""
    key = (_backward_factors, id(needs))
    return g.memo(key, lambda: (needs, {op.id: _bwd_factor(op, needs) for op in g.ops}))[1]


def estimate(
    plan: Plan,
    cluster: str | Cluster = "cpu",
    *,
    dtype: str = "fp32",
    microbatches: int = 1,
    optimizer_slots: int = 0,
    algorithm: str = "ring",
    expert_skew: float = 1.0,
) -> Estimate:
    """Predicts ``plan``'s training step on ``cluster`` (see the module doc).

    Args:
      dtype: the compute dtype (picks the cluster's peak FLOP/s).
      microbatches: gradient-accumulation steps; the graph is one micro-batch.
      optimizer_slots: fp32 values of optimizer state per parameter (SGD 0, momentum 1,
        Adam 2).
      expert_skew: the router's load imbalance, the rows of the busiest device's experts
        over the mean (1: balanced), assumed or measured (``models.moe.expert_skew``);
        it scales the ``ragged_dot`` pieces split along their groups.
    """
    check_expert_skew(expert_skew)
    cl = get_cluster(cluster)
    peak = cl.peak(dtype)
    pg = plan.pgraph
    g = pg.graph
    act, state = value_scale(dtype, g), state_scale(dtype, g)
    mesh = plan.mesh
    sizes = mesh.shape
    low = lower(plan, None)
    needs = needs_grad(g)
    recomputed = recomputed_ops(plan)

    times = device_times(plan, cl, dtype, needs, recomputed, expert_skew)
    fwd = {d: 0.0 for d in mesh.devices}
    bwd = dict(fwd)
    once = dict(fwd)  # optimizer-side ops: once per step, not per micro-batch
    optimizer_ops = {v.id for v in (*pg.grad_ops, *pg.update_ops)}
    for op_id, (f, b) in times.items():
        for d, t in f.items():
            fwd[d] += t
        for d, t in b.items():
            (once if op_id in optimizer_ops else bwd)[d] += t
    model_flops, hardware = flops_of(g, needs, recomputed)
    m = microbatches
    compute = max(m * (fwd[d] + bwd[d]) + once[d] for d in mesh.devices)
    bwd_time = max(m * bwd[d] for d in mesh.devices)

    table = comm_table(low, m)
    params = from_params_only(g)
    hidden = exposed = 0.0
    combined = Combined(cl, algorithm)
    for r in table.rows:
        fixed = {a: 0 for a in mesh.names if a not in r.axes}
        group = mesh.group(**fixed)
        grad = r.phase == "backward" and r.tensor in params
        nbytes = r.bytes * row_scale(r.phase, grad, act, state)
        if grad or r.phase == "update":
            # gradients accumulate over micro-batches and reduce once, behind the
            # backward; the optimizer side (a ZeRO all-gather of the new parameters) runs
            # after it. Both are independent collectives XLA's combiner merges.
            combined.add(grad, r.collective, group, nbytes)
            continue
        exposed += collective_time(r.collective, nbytes, group, cl, algorithm) * r.times
    merged = combined.seconds()
    hidden += merged.get(True, 0.0)
    exposed += merged.get(False, 0.0)
    exposed_total = exposed + max(0.0, hidden - bwd_time)
    step = compute + exposed_total

    memory = spmd_memory(low, g, sizes, optimizer_slots, act, cl, state)
    return Estimate(
        plan.name or "plan",
        cl.name,
        mesh.size,
        compute,
        hidden + exposed,
        exposed_total,
        step,
        memory,
        table.total_bytes,
        model_flops * m,
        hardware * m,
        peak,
    )


def flops_of(g, needs, recomputed, ops=None) -> tuple[float, float]:
    """(model FLOPs, hardware FLOPs) of one forward + backward of ``ops`` (default all)."""
    model = hardware = 0.0
    factors = _backward_factors(g, needs)
    for op in ops if ops is not None else g.ops:
        factor = factors[op.id]
        flops = op.flops * op.repeats
        model += flops * (1 + factor)
        hardware += flops * (1 + factor + (1.0 if op.id in recomputed and factor else 0.0))
    return model, hardware


def device_times(
    plan: Plan, cl: Cluster, dtype: str, needs, recomputed, expert_skew: float = 1.0
) -> dict:
    """op id -> ({device: forward seconds}, {device: backward seconds}) on the roofline,
    recomputation counted in the backward; optimizer-side ops (gradient, update) under
    their own ids, in the backward. ``expert_skew`` scales a ragged_dot's pieces split
    along its groups (see the module doc).

    Once per plan and arguments (plans are frozen; a pipeline's group plans are predicted
    under every schedule a search tries): callers share the result and must not change
    it."""
    memo = plan.memo((device_times,), dict)
    key = (cl, dtype, expert_skew, id(needs), frozenset(recomputed))
    found = memo.get(key)
    if found is None or found[0] is not needs:  # the id is needs' own while it is kept
        found = memo[key] = (needs, _device_times(plan, cl, dtype, needs, recomputed, expert_skew))
    return found[1]


def _device_times(plan: Plan, cl: Cluster, dtype: str, needs, recomputed, expert_skew) -> dict:
    pg = plan.pgraph
    g = pg.graph
    roofs = compute_roofs(g, cl, dtype)
    default = plan.mesh.devices[0]
    out = {}
    scale = value_scale(dtype, g)
    moved = fused_op_bytes(g) if cl.fuses_elementwise else _op_bytes(g)
    launched = kernels(g, cl.fuses_elementwise)
    shares: dict = {}  # tree -> ((device, share), ...): repeated layers share trees
    for op in g.ops:
        backward = _backward_multiple(op, needs, recomputed)
        nbytes = scale * moved[op.id]
        tree = plan.tree(op.id)
        group = _ragged_group_dim(op) if expert_skew != 1 else None
        per = shares.get((tree, group))
        if per is None:
            per = shares[tree, group] = tuple(
                (
                    leaf.device if leaf.device is not None else default,
                    _share(tree, path) * _busiest(tree, path, group, expert_skew),
                )
                for path, leaf in tree.leaves()
            )
        f, b = {}, {}
        launch = launched[op.id] * cl.kernel_seconds  # per piece: each is a kernel
        for dev, share in per:
            t = _piece_seconds(op, share, nbytes, roofs[op.id], cl.memory_bandwidth) + launch
            t *= op.repeats  # an op in a scan's body runs once per iteration
            f[dev] = f.get(dev, 0.0) + t
            b[dev] = b.get(dev, 0.0) + t * backward
        out[op.id] = (f, b)
    for vop in (*pg.grad_ops, *pg.update_ops):  # elementwise, memory bound
        tree = plan.tree(vop.id)
        t0 = vop.inputs[0]
        nbytes = 3 * math.prod(g.tensors[t0].shape) * jnp.dtype(g.tensors[t0].dtype).itemsize
        b = {}
        for path, leaf in tree.leaves():
            dev = leaf.device if leaf.device is not None else default
            t = nbytes * _share(tree, path) / cl.memory_bandwidth + cl.kernel_seconds
            b[dev] = b.get(dev, 0.0) + t
        out[vop.id] = ({}, b)
    return out


def roofline_seconds(g, cluster: str | Cluster, dtype: str, recomputed=frozenset()) -> float:
    """The least device-seconds one forward and backward of ``g`` takes on ``cluster``
    under any plan: each op's roofline time at its whole size and its kernel's
    ``kernel_seconds``, as :func:`device_times` charges its pieces (a piece costs its
    share of the op, and the shares of a split or replicated op add up to at least one;
    each piece is a kernel), the ops in ``recomputed`` run forward again.
    Divided by the devices, a lower bound on any plan's compute per micro-batch."""
    cl = get_cluster(cluster)
    roofs = compute_roofs(g, cl, dtype)
    scale = value_scale(dtype, g)
    moved = fused_op_bytes(g) if cl.fuses_elementwise else _op_bytes(g)
    launched = kernels(g, cl.fuses_elementwise)
    needs = needs_grad(g)
    total = 0.0
    for op in g.ops:
        t = _piece_seconds(op, 1.0, scale * moved[op.id], roofs[op.id], cl.memory_bandwidth)
        t += launched[op.id] * cl.kernel_seconds
        total += t * op.repeats * (1.0 + _backward_multiple(op, needs, recomputed))
    return total


def _piece_seconds(op, share: float, nbytes: float, roof: float, bandwidth: float) -> float:
    """A piece's forward seconds on the roofline: ``share`` of ``op``'s FLOPs at ``roof``
    or of its ``nbytes`` at ``bandwidth``, whichever takes longer."""
    return max(op.flops * share / roof, nbytes * share / bandwidth)


def _backward_multiple(op, needs, recomputed) -> float:
    """The backward's time in forwards: its own factor, plus one forward again when
    ``op`` is recomputed (an op with no backward is not rerun)."""
    factor = _bwd_factor(op, needs)
    return factor + (1.0 if op.id in recomputed and factor else 0.0)


def _op_bytes(g) -> dict[int, int]:
    """op id -> bytes of its tensor inputs and outputs (once per graph)."""

    def make():
        size = {t: local_bytes(g, t, None, None) for t in g.tensors}
        return {o.id: sum(size[t] for t in (*o.tensor_inputs, *o.outputs)) for o in g.ops}

    return g.memo((_op_bytes,), make)


def _share(tree, path) -> float:
    node, share = tree, 1.0
    for i in path:
        if node.algo == "split":
            share /= len(node.children)
        node = node.children[i]
    return share


def check_expert_skew(expert_skew) -> float:
    """``expert_skew`` if it is a finite number >= 1, else a :class:`PlanError` saying
    what it means and how to get one (the estimates and ``plan="auto"`` take it)."""
    if (
        isinstance(expert_skew, bool)
        or not isinstance(expert_skew, int | float)
        or not 1 <= expert_skew < float("inf")
    ):
        raise PlanError(
            f"expert_skew must be a number >= 1 (the busiest expert-parallel device's rows "
            f"over the mean; 1: balanced), got {expert_skew!r}; measure it with "
            f"models.moe.expert_skew or leave it at 1"
        )
    return float(expert_skew)


def _ragged_group_dim(op):
    """The annotation dim of a ragged_dot's rhs group axis (its experts), or None."""
    if op.primitive != "ragged_dot_general" or op.eqn is None or op.annotation is None:
        return None
    groups = op.eqn.params["ragged_dot_dimension_numbers"].rhs_group_dimensions
    return op.annotation.inputs[1][groups[0]][0] if len(groups) == 1 else None


def _busiest(tree, path, dim, skew: float) -> float:
    """How much more than its even share the piece at ``path`` works when ``tree``
    splits ``dim`` (a ragged_dot's groups) ``n`` ways and the busiest piece holds
    ``skew`` times the mean rows: ``min(skew, n)``; 1 where ``dim`` is not split."""
    if dim is None:
        return 1.0
    node, ways = tree, 1
    for i in path:
        if node.algo == "split" and node.dim == dim:
            ways *= len(node.children)
        node = node.children[i]
    return min(skew, ways)
