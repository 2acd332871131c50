"""The op-trans + op-assign search problem on one device mesh (Alpa's intra-op ILP).

Every op picks a *strategy*: for each mesh axis, the annotation dim it splits over that
axis (the axis size must divide it), or none (replicated over the axis). Choosing a
strategy per op fixes every tensor's layout on the mesh, hence:

* a **node cost** per (op, strategy): its compute (the roofline of the cost model,
  forward + backward, on the share its splits leave each device), the all-reduce of its
  partial sums when it splits a reduced ('+') dim, and in the backward pass the
  all-reduce of each input's cotangent over the axes the op is split on but the input is
  not (a weight read whole by a batch-split op: data parallelism's gradient all-reduce);
* an **edge cost** per (producer strategy, consumer strategy) of every tensor: the
  collectives converting the producer's layout into the consumer's (``convert`` of the
  comm table: all-gather, all-to-all; slices are free), and back for the cotangent when
  the tensor carries a gradient; a graph input read by several ops (a tied embedding) is
  stored as its first reader reads it and converted for the others;
* a **memory** per (op, strategy): the activations it keeps for the backward pass and,
  for the first reader of a parameter, the parameter, its gradient and optimizer state in
  the layout that reader wants (parameters are stored as read);
* a **regathered** value per activation a non-linear op reads in a larger layout than its
  producer made it in (sequence parallelism's norm output, gathered for the matmuls
  after it): the backward keeps that copy, once per distinct layout
  (:class:`Regather`; the estimate's ``regathered_bytes``);
* a **peak** per phase of the step beyond what is kept throughout, as the estimate has
  them: each recomputed layer's backward (the values of the layer the backward reads,
  made again by its recomputed forward: the estimate's working set), the backward's own
  buffers at an op near the loss head (its cotangents and weight gradient, less the
  values kept by the ops after it, which the backward has freed: the estimate's
  ``cotangent_extra``), and the gradient reduction after the backward (every
  parameter's gradient as the backward made it and reduced, the kept activations gone).
  A device's memory is the sum of the kept bytes (parameters, optimizer state,
  activations kept for the backward) plus the largest peak.

Ops of repeated layers at the same position form one *cluster* sharing a strategy (the
i-th op of every block), so a model's depth does not grow the problem; a tensor passing
from a cluster to itself (layer i to layer i+1) costs on the diagonal only. An op's node
cost is priced once per *signature* (everything it reads: primitive, annotation, operand
shapes and dtypes, roofline, which operands are kept, carry gradients, are parameters read
first here), so the ops of a cluster, layer after layer, share one pricing; layouts of an
annotation under a strategy are cached (:func:`layout`).

Times are seconds per device per micro-batch on a :class:`~jscaler.cost.Cluster`; the
objective, the sum of node and edge costs over the graph, is a device's step time when
nothing overlaps (every device runs the same SPMD program).
"""

from __future__ import annotations

import bisect
import functools
import itertools
import math
from dataclasses import dataclass, field

import jax.numpy as jnp

from jscaler.compile.comm import NON_DIFFERENTIABLE, convert, needs_grad, table_rows
from jscaler.compile.layout import Layout
from jscaler.cost.cluster import Cluster, get_cluster
from jscaler.cost.collective import collective_time
from jscaler.cost.estimate import CONTRACTIONS
from jscaler.cost.fusion import fused_kept, materialised
from jscaler.cost.memory import (
    carries_cotangent,
    holds_cotangents,
    local_bytes,
    nonlinear_readers,
    saved_for_backward,
    shared_params,
    unit_edges,
)
from jscaler.cost.precision import compute_roofs, value_scale
from jscaler.errors import OutOfMemoryError, PlanError
from jscaler.ir.graph import Graph, Literal, Op
from jscaler.plan.helpers import recomputed_layers, shard_dim
from jscaler.plan.mesh import MeshSpec

__all__ = [
    "Problem",
    "Regather",
    "Strategy",
    "Tied",
    "build_problem",
    "fits_at_all",
    "least_memory",
    "memory_unit",
    "no_fit",
    "objective",
    "phase_totals",
]

Strategy = tuple  # per mesh axis: a dim name or None


def memory_unit(capacity: float) -> int:
    """The solver's memory unit (bytes) under ``capacity``: a 2**-24 share of it, at least
    a byte (2 KiB under 32 GiB), so a capacity spans the same integer range at every scale
    and rounding each term to it moves a sum over thousands of terms by well under 1%."""
    return max(1, int(capacity) >> 24)


@dataclass(frozen=True)
class Tied:
    """A parameter several ops read (a tied embedding). The lowering stores a graph input
    as its readers read it where they all read it alike, else whole: the problem's tables
    count it as its first reader reads it, and where another reader reads it otherwise,
    the first reader's cluster pays, per strategy, the difference."""

    cluster: int  # its first reader's
    # per other reader: (its cluster, per strategy of ``cluster``: its strategies that
    # read the parameter in the same layout)
    agree: tuple[tuple[int, tuple[tuple[int, ...], ...]], ...]
    seconds: tuple[float, ...]  # per strategy of ``cluster``: the update of the rest
    kept: tuple[float, ...]  # the rest of the parameter and its optimizer state
    held: tuple[float, ...]  # the rest of its gradients at the reduction (the last peak)

    def apart(self, choice) -> bool:
        """Whether the readers read it in different layouts under ``choice``."""
        s = choice[self.cluster]
        return any(choice[c] not in same[s] for c, same in self.agree)


@dataclass(frozen=True)
class Regather:
    """An activation non-linear ops read for a gradient, some in a larger layout than its
    producer may make it in: the backward keeps each such reader's gathered copy (jax
    saves the matmul's operand), once per distinct layout, beside the value as made
    (counted with its producer). ``count`` such values alike (the same position in each
    repeated layer)."""

    cluster: int  # its producer's
    made: tuple[float, ...]  # per strategy of ``cluster``: its bytes as made
    # per reader: (its cluster, per strategy: (the layout it reads the value in, bytes))
    readers: tuple[tuple[int, tuple[tuple[tuple, float], ...]], ...]
    count: int = 1

    def layouts(self, choice) -> dict[tuple, float]:
        """The gathered copies kept under ``choice``: layout -> bytes (of all ``count``)."""
        made = self.made[choice[self.cluster]]
        out = {}
        for c, per in self.readers:
            spec, b = per[choice[c]]
            if b > made:
                out[spec] = self.count * b
        return out

    def options(self) -> dict[tuple, float]:
        """Every layout some choice may keep a gathered copy in -> its bytes (all ``count``)."""
        least = min(self.made)
        return {spec: self.count * b for _, per in self.readers for spec, b in per if b > least}


@dataclass
class Problem:
    """Clusters of ops with their strategies and costs; see the module doc."""

    graph: Graph
    mesh: MeshSpec
    cluster: Cluster
    clusters: list[list[int]]  # op ids per cluster
    strategies: list[list[Strategy]]  # per cluster, in a stable order
    node: list[list[float]]  # per cluster, per strategy: seconds (compute + exposed comm)
    hidden: list[list[float]]  # parameter-gradient reductions, overlappable with backward
    backward: list[list[float]]  # backward compute (what hides the reductions)
    memory: list[list[float]]  # per cluster, per strategy: bytes per device
    edges: dict = field(default_factory=dict)  # (cluster a, cluster b) -> [[seconds]]
    capacity: float | None = None
    zero: list = field(default_factory=list)  # per cluster, per strategy: ZeRO-2 its params
    # per phase: {cluster: bytes per strategy} beyond the kept ones (may be negative): each
    # distinct recomputed layer's backward, and last the gradient reduction's
    peaks: list = field(default_factory=list)
    tied: tuple[Tied, ...] = ()  # parameters several ops read, where their layouts matter
    regathers: tuple[Regather, ...] = ()  # activations kept again as gathered for a reader

    @property
    def size(self) -> int:
        return sum(len(s) for s in self.strategies)


def objective(p: Problem, choice: list[int]) -> tuple[float, float]:
    """(seconds, bytes per device) of one strategy index per cluster: node and edge costs,
    plus the gradient reductions the backward compute does not hide."""
    t = sum(p.node[c][s] for c, s in enumerate(choice))
    t += sum(m[choice[a]][choice[b]] for (a, b), m in p.edges.items())
    hidden = sum(p.hidden[c][s] for c, s in enumerate(choice))
    t += max(0.0, hidden - sum(p.backward[c][s] for c, s in enumerate(choice)))
    mem = sum(p.memory[c][s] for c, s in enumerate(choice))
    mem += sum(b for r in p.regathers for b in r.layouts(choice).values())
    phases = [sum(row[choice[c]] for c, row in pk.items()) for pk in p.peaks]
    for tie in p.tied:
        if tie.apart(choice):
            s = choice[tie.cluster]
            t, mem, phases[-1] = t + tie.seconds[s], mem + tie.kept[s], phases[-1] + tie.held[s]
    return t, mem + max([0.0, *phases])


# ---- building -------------------------------------------------------------------------


def _strategies(op: Op, mesh: MeshSpec) -> list[Strategy]:
    ann = op.annotation
    axes = list(mesh.axes)
    if ann is None:
        return [(None,) * len(axes)]
    dims = ann.splittable()
    per_axis = [[None] + [d for d in dims if ann.sizes[d] % size == 0] for _, size in axes]
    out = []
    for combo in itertools.product(*per_axis):
        ways: dict[str, int] = {}
        for (_, size), d in zip(axes, combo):
            if d is not None:
                ways[d] = ways.get(d, 1) * size
        if all(ann.sizes[d] % n == 0 for d, n in ways.items()):
            out.append(tuple(combo))  # a dim may split over several axes (major first)
    return out


def layout(dims, strategy: Strategy, mesh: MeshSpec, kinds, output: bool) -> Layout:
    """The layout of a tensor with annotation ``dims`` under an op's strategy."""
    plus = ()
    if output:  # the split dims that leave partial sums
        plus = tuple(d for d in strategy if d is not None and kinds.get(d) == "+")
    return _layout(dims, strategy, mesh.names, plus)


@functools.lru_cache(maxsize=1 << 16)
def _layout(dims, strategy: Strategy, names: tuple[str, ...], plus: tuple[str, ...]) -> Layout:
    """:func:`layout`, cached: a search asks the same few (dims, strategy) millions of times."""
    spec = tuple(
        tuple(a for a, d in zip(names, strategy) if d is not None and d == ax[0]) for ax in dims
    )
    present = {ax[0] for ax in dims}
    partial = tuple(a for a, d in zip(names, strategy) if d in plus and d not in present)
    return Layout(spec, partial)


def _cluster_ops(graph: Graph) -> list[list[int]]:
    """Repeated layers' ops by position; every other op alone."""
    layers = graph.layers()
    groups: list[list[int]] = []
    placed: set[int] = set()
    if layers:
        by_shape: dict[tuple, list] = {}
        for lay in layers:
            key = tuple(  # same ops on the same shapes: Swin's stages differ in width
                (o.primitive, tuple(graph.tensors[t].shape for t in (*o.tensor_inputs, *o.outputs)))
                for o in lay.graph.ops
            )
            by_shape.setdefault(key, []).append(lay)
        for family in by_shape.values():
            for k in range(len(family[0].graph.ops)):
                ids = [lay.graph.ops[k].id for lay in family]
                groups.append(ids)
                placed.update(ids)
    for op in graph.ops:
        if op.id not in placed:
            groups.append([op.id])
    first = {min(g): g for g in groups}
    return [first[k] for k in sorted(first)]


def build_problem(
    graph: Graph,
    mesh: MeshSpec,
    cluster: str | Cluster = "cpu",
    *,
    dtype: str = "fp32",
    capacity: float | None = None,
    optimizer_slots: int = 0,
    algorithm: str = "ring",
    zero: bool = True,
    recompute: float = 0,
    fail_fast: bool = False,
) -> Problem:
    """The search problem of ``graph`` on ``mesh`` (see the module doc); ``zero``: offer
    ZeRO-2 for the parameters an op reads whole (each op's strategies twice);
    ``recompute``: the fraction of repeated layers checkpointed (their ops run forward
    twice and keep only the layer's inputs); ``fail_fast``: raise the solver's
    :func:`no_fit` error before pricing the edges (most of the building) when even every
    cluster's leanest strategy exceeds ``capacity``, as the solver would find."""
    cl = get_cluster(cluster)
    roofs = compute_roofs(graph, cl, dtype)
    sizes = mesh.shape
    names = mesh.names
    ops = {o.id: o for o in graph.ops}
    clusters = _cluster_ops(graph)
    where = {o: c for c, ids in enumerate(clusters) for o in ids}
    needs = needs_grad(graph)
    layers = recomputed_layers(graph, recompute)
    groups = {o.id: k for k, lay in enumerate(layers) for o in lay.graph.ops}
    recomputed = set(groups)
    saved = saved_for_backward(graph, groups)
    whole = saved_for_backward(graph) if layers else set()  # what a recomputed layer remakes
    moves = None  # every tensor an op reads or writes moves through memory
    if cl.fuses_elementwise:  # as the estimate: only materialised ones, and kept
        saved = fused_kept(graph, saved, unit_edges(graph, groups))
        whole = fused_kept(graph, whole)
        moves = materialised(graph)
    scale = value_scale(dtype, graph)  # activations in the compute dtype
    first_reader: dict[int, int] = {}
    for op in graph.ops:
        for t in op.tensor_inputs:
            if graph.tensors[t].role in ("param", "batch"):
                first_reader.setdefault(t, op.id)
    producer = {t: o.id for o in graph.ops for t in o.outputs}
    tied = shared_params(graph)

    def nbytes(t) -> float:
        return local_bytes(graph, t, None, sizes)

    def local(t, lay: Layout) -> float:
        return local_bytes(graph, t, lay, sizes)

    groups: dict[tuple, tuple[int, ...]] = {}

    def group(axes) -> tuple[int, ...]:
        key = tuple(axes)
        if key not in groups:
            groups[key] = mesh.group(**{a: 0 for a in names if a not in axes})
        return groups[key]

    def coll(kind, b, axes, combined: bool = False) -> float:
        """``combined``: a parameter-gradient reduction or a ZeRO all-gather, which XLA
        merges with the others of its kind (their latency is paid once, not per op)."""
        return collective_time(kind, b, group(axes), cl, algorithm, latency=not combined)

    def node_cost(op: Op, s: Strategy, zero: bool = False) -> tuple[float, ...]:
        """:func:`node_once`, for an op in a scan's body once per iteration: its time,
        and the activations it keeps (at most: the body keeps its matmuls' outputs)."""
        costs = node_once(op, s, zero)
        n = op.repeats
        if n == 1 or op.primitive in ("scan_slice", "scan_carry"):
            return costs
        t, grads, back, mem_kept, held_kept, kept, cot = costs
        extra = (n - 1) * kept
        return t * n, grads, back * n, mem_kept + extra, held_kept - extra, kept + extra, cot

    def node_once(op: Op, s: Strategy, zero: bool = False) -> tuple[float, ...]:
        """(seconds exposed, seconds of parameter-gradient reduction, backward seconds,
        bytes kept, bytes at the gradient reduction beyond the kept ones, activation
        bytes kept, bytes of its cotangents in the backward); ``zero``: the
        parameters it reads first (whole) are ZeRO-2 sharded over every mesh axis:
        gradients reduce-scattered, the update and its state split, the new parameters
        all-gathered."""
        ann = op.annotation
        share = 1.0 / math.prod(sizes[a] for a, d in zip(names, s) if d is not None)
        diff = op.primitive not in NON_DIFFERENTIABLE and any(t in needs for t in op.outputs)
        back = (2.0 if op.primitive in CONTRACTIONS else 1.0) * diff
        moved = sum(
            nbytes(t) for t in (*op.tensor_inputs, *op.outputs) if moves is None or t in moves
        )
        once = max(op.flops * share / roofs[op.id], moved * share / cl.memory_bandwidth)
        again = 1.0 if op.id in recomputed and diff else 0.0
        t, grads, mem, kept, held = (1 + back + again) * once, 0.0, 0.0, 0.0, 0.0
        cot = 0.0  # the cotangents its backward holds (a weight's gradient among them)
        holds = op.id in holding
        if ann is None:
            kept = scale * sum(nbytes(x) for x in op.outputs if x in saved)
            if holds:
                cot = scale * sum(nbytes(x) for x in (*op.outputs, *op.inputs) if flows(x))
            return t, 0.0, back * once, kept, -kept, kept, cot
        used = {a for a, d in zip(names, s) if d is not None}
        for dims, x in zip(ann.outputs, op.outputs):
            lay = layout(dims, s, mesh, ann.kinds, True)
            if lay.partial:
                t += coll("all-reduce", local(x, lay), lay.partial)
            if x in saved:
                kept += scale * local(x, lay)
            if holds and flows(x):
                cot += scale * local(x, lay)
        for dims, x in zip(ann.inputs, op.inputs):
            if isinstance(x, Literal):
                continue
            lay = layout(dims, s, mesh, ann.kinds, False)
            if holds and flows(x):
                cot += scale * local(x, lay)
            missing = tuple(sorted(used - lay.axes_used()))
            param = graph.tensors[x].role == "param"
            sharded = zero and param and first_reader.get(x) == op.id and not lay.axes_used()
            if diff and x in needs and sharded:
                # reduce-scatter (hidden; none when every device computed the whole
                # gradient), and all-gather the new parameters after the update (exposed)
                if missing:
                    gathered = lookup_cotangent(op, x, s, missing)
                    if gathered is not None and gathered < local(x, lay):  # as compile.comm
                        grads += coll("all-gather", gathered, missing, combined=True)
                    else:
                        grads += coll("reduce-scatter", local(x, lay), missing, combined=True)
                t += coll("all-gather", local(x, lay), names, combined=True)
            elif diff and x in needs and missing:
                if param:
                    grads += coll("all-reduce", local(x, lay), missing, combined=True)
                else:
                    t += coll("all-reduce", local(x, lay), missing)
            if first_reader.get(x) == op.id:
                if not param:
                    mem += local(x, lay)
                    continue
                k = mesh.size if sharded else 1
                size = local(x, lay)  # stored as read (a tied one: see Problem.tied)
                t += (3 + 2 * optimizer_slots) * size / k / cl.memory_bandwidth
                mem += size + optimizer_slots * size / k
                if x in needs:
                    held += _reduction_bytes(len(tied.get(x, (x,))), size, k)
        return t, grads, back * once, mem + kept, held - kept, kept, cot

    def lookup_cotangent(op: Op, x, s: Strategy, missing) -> float | None:
        """The bytes an embedding lookup gathers (its output cotangent and indices over
        ``missing``) to scatter its table's gradient into ZeRO's row shards in place, or
        None when ``x`` is not a table split by ZeRO on an indexed dim."""
        if shard_dim(graph.tensors[x].shape, mesh.size) not in table_rows(op, x):
            return None
        ann, k = op.annotation, math.prod(sizes[a] for a in missing)
        out = local(op.outputs[0], layout(ann.outputs[0], s, mesh, ann.kinds, True))
        ids = op.inputs[1]
        if isinstance(ids, Literal):
            return k * out
        return k * (out + local(ids, layout(ann.inputs[1], s, mesh, ann.kinds, False)))

    # ops whose backward holds cotangents of their own: once per op, not per strategy
    holding = {o.id for o in graph.ops if holds_cotangents(graph, o)}

    def flows(x) -> bool:
        return carries_cotangent(x, needs, moves)

    def zero_ok(op: Op, s: Strategy) -> bool:
        """Whether ZeRO-2 applies: the op first-reads a parameter whole, with a dim the
        device count divides."""
        if not zero or op.annotation is None:
            return False
        for dims, x in zip(op.annotation.inputs, op.inputs):
            if isinstance(x, Literal) or graph.tensors[x].role != "param":
                continue
            lay = layout(dims, s, mesh, op.annotation.kinds, False)
            if first_reader.get(x) == op.id and not lay.axes_used():
                if shard_dim(graph.tensors[x].shape, mesh.size) is not None:
                    return True
        return False

    def signature(op: Op) -> tuple:
        """Everything :func:`node_cost` reads of ``op``: ops of the same signature (a
        repeated layer's op, layer after layer) cost the same under every strategy.
        Whether an operand carries a held cotangent (``flows``) follows from its needing a
        gradient and moving through memory, both in it."""
        ann = op.annotation
        ins = tuple(
            None if isinstance(x, Literal) else (
                graph.tensors[x].shape, graph.tensors[x].dtype, graph.tensors[x].role,
                x in needs, x in saved, first_reader.get(x) == op.id, len(tied.get(x, (x,))),
            )
            for x in op.inputs
        )  # fmt: skip
        outs = tuple(
            (graph.tensors[x].shape, graph.tensors[x].dtype, x in needs, x in saved)
            for x in op.outputs
        )
        moved = tuple(moves is None or t in moves for t in (*op.tensor_inputs, *op.outputs))
        dims = None if ann is None else (ann.inputs, ann.outputs, tuple(sorted(ann.kinds.items())))
        return (
            op.primitive, op.flops, roofs[op.id], op.id in recomputed, op.id in holding,
            dims, ins, outs, moved, op.repeats,
        )  # fmt: skip

    costed: dict[tuple, tuple[float, ...]] = {}
    numbered: dict[tuple, int] = {}  # signature -> its number: hashed once per op

    def cost_of(op: Op, sig: int, s: Strategy, z: bool) -> tuple[float, ...]:
        key = (sig, s, z)
        if key not in costed:
            costed[key] = node_cost(op, s, z)
        return costed[key]

    strategies, node, hidden, backward, memory, reduction, zeros = [], [], [], [], [], [], []
    acts, cots = {}, {}  # op id -> per strategy of its cluster: kept, cotangent bytes
    for ids in clusters:
        base = _strategies(ops[ids[0]], mesh)
        plain = [(s, False) for s in base]
        strats = plain + [(s, True) for s in base if zero_ok(ops[ids[0]], s)]
        sigs = [numbered.setdefault(signature(ops[o]), len(numbered)) for o in ids]
        costs = [[cost_of(ops[o], g, s, z) for o, g in zip(ids, sigs)] for s, z in strats]
        strategies.append([s for s, _ in strats])
        zeros.append([z for _, z in strats])
        for k, table in enumerate((node, hidden, backward, memory, reduction)):
            table.append([sum(c[k] for c in cs) for cs in costs])
        for i, o in enumerate(ids):
            acts[o] = [cs[i][5] for cs in costs]
            cots[o] = [cs[i][6] for cs in costs]
    peaks = _peaks(graph, mesh, layers, ops, where, strategies, whole, scale)
    peaks += _cotangent_phases(graph, where, acts, cots)
    peaks.append(dict(enumerate(reduction)))  # the gradient reduction after the backward
    ties = []
    for x, readers in sorted(tied.items()):
        first = ops[first_reader[x]]
        c = where[first.id]
        lays = [_reduced(graph, first, first.inputs.index(x), s, mesh, True) for s in strategies[c]]
        extra = [nbytes(x) - local(x, lay) for lay in lays]  # where stored whole, not split
        if not any(extra):
            continue
        agree = _agreeing(graph, mesh, x, first, lays, readers, where, strategies)
        n = len(readers)
        ties.append(
            Tied(
                c,
                agree,
                tuple((3 + 2 * optimizer_slots) * b / cl.memory_bandwidth for b in extra),
                tuple((1 + optimizer_slots) * b for b in extra),
                tuple(_reduction_bytes(n, b, 1) if x in needs else 0.0 for b in extra),
            )
        )
    if fail_fast and capacity is not None and not fits_at_all(memory, capacity, peaks):
        raise no_fit(mesh, capacity, memory, peaks)

    edges: dict[tuple[int, int], list[list[float]]] = {}
    # a conversion's price depends on the tensor's shape and dtype and the two layouts
    # only: strategies and edges of the same shape share it
    priced: dict[tuple, float] = {}
    for op in graph.ops:
        for k, x in enumerate(op.inputs):
            if isinstance(x, Literal):
                continue
            if x in producer:  # from the op that makes it
                src_op = ops[producer[x]]
                src_k, src_in = src_op.outputs.index(x), False
            elif first_reader.get(x, op.id) != op.id:  # a graph input (a tied weight)
                src_op = ops[first_reader[x]]  # is stored as its first reader reads it
                src_k, src_in = src_op.inputs.index(x), True
            else:
                continue
            a, b = where[src_op.id], where[op.id]
            shape = graph.tensors[x].shape
            isz = jnp.dtype(graph.tensors[x].dtype).itemsize
            mat = [[0.0] * len(strategies[b]) for _ in strategies[a]]
            dsts = [_reduced(graph, op, k, sc, mesh, inputs=True) for sc in strategies[b]]
            back = x in needs  # the cotangent goes back: dst -> src
            for i, sp in enumerate(strategies[a]):
                src = _reduced(graph, src_op, src_k, sp, mesh, inputs=src_in)
                for j, dst in enumerate(dsts):
                    if a == b and i != j:
                        continue
                    key = (shape, isz, back, src, dst)
                    if key not in priced:
                        steps = convert(shape, isz, src, dst, sizes)
                        if back:
                            steps += convert(shape, isz, dst, src, sizes)
                        priced[key] = sum(coll(kind, nb, axes) for kind, axes, nb in steps)
                    mat[i][j] = priced[key]
            if not any(any(row) for row in mat):
                continue
            if a == b:
                for i in range(len(mat)):
                    node[a][i] += mat[i][i]
                continue
            key = (a, b)
            if key in edges:
                old = edges[key]
                mat = [[u + v for u, v in zip(r1, r2)] for r1, r2 in zip(old, mat)]
            edges[key] = mat
    regathers = _regathers(graph, mesh, ops, where, strategies, saved, recomputed, scale)
    return Problem(
        graph, mesh, cl, clusters, strategies, node, hidden, backward, memory, edges, capacity,
        zeros, peaks, tuple(ties), regathers,
    )  # fmt: skip


def _regathers(graph, mesh, ops, where, strategies, saved, recomputed, scale) -> tuple:
    """:attr:`Problem.regathers`: per kept activation (made and read outside scans) that a
    non-linear reader outside the recomputed layers may read in a larger layout than its
    producer may make it in, its :class:`Regather`; alike ones (a position in each
    repeated layer) counted together."""
    sizes = mesh.shape
    found: dict[tuple, int] = {}
    for t, reads in nonlinear_readers(graph).items():
        if t not in saved:
            continue
        src = graph.producer(t)
        a, k = where[src.id], src.outputs.index(t)
        made = tuple(
            scale * local_bytes(graph, t, _reduced(graph, src, k, s, mesh), sizes)
            for s in strategies[a]
        )
        readers = set()
        for r, j in reads:
            if r in recomputed:
                continue
            c = where[r]
            lays = [_reduced(graph, ops[r], j, s, mesh, inputs=True) for s in strategies[c]]
            per = tuple((lay.spec, scale * local_bytes(graph, t, lay, sizes)) for lay in lays)
            if any(b > min(made) for _, b in per):
                readers.add((c, per))
        if readers:
            key = (a, made, tuple(sorted(readers)))
            found[key] = found.get(key, 0) + 1
    return tuple(Regather(a, made, readers, n) for (a, made, readers), n in found.items())


def _agreeing(graph, mesh, x, first, lays, readers, where, strategies) -> tuple:
    """:attr:`Tied.agree` of parameter ``x``: per reader but ``first``, its cluster and,
    per layout in ``lays`` (``first`` reading ``x`` under each of its strategies), that
    cluster's strategies reading ``x`` in that layout."""
    out = []
    for r in readers:
        for k, y in enumerate(r.inputs):
            if y != x or r.id == first.id:
                continue
            c = where[r.id]
            theirs = [_reduced(graph, r, k, s, mesh, True) for s in strategies[c]]
            out.append(
                (c, tuple(tuple(j for j, t in enumerate(theirs) if t == lay) for lay in lays))
            )
    return tuple(out)


def _reduction_bytes(readers: int, size: float, k: int) -> float:
    """A parameter's bytes at the gradient reduction, as the estimate counts them: its
    gradient as the backward makes it and reduced (split over ``k`` devices by ZeRO-2),
    and two contributions per reader past the first beside them
    (:func:`~jscaler.cost.memory.shared_params`)."""
    return (1 + 2 * (readers - 1)) * size + size / k


def _peaks(graph, mesh, layers, ops, where, strategies, whole, scale) -> list[dict]:
    """Per recomputed layer, {cluster: bytes per strategy} of the values its backward
    reads (``whole``: what the backward reads with nothing recomputed), as the estimate's
    working set counts them; layers of the same shapes give one entry. ``ops``: op id ->
    op; ``where``: op id -> its cluster."""
    sizes = mesh.shape
    out, seen = [], set()
    for lay in layers:
        peak = {}
        for op in lay.graph.ops:
            outs = [(k, x) for k, x in enumerate(op.outputs) if x in whole]
            if not outs:
                continue
            c = where[op.id]
            ann = ops[op.id].annotation
            row = []
            for s in strategies[c]:
                lays = [None] * len(op.outputs)
                if ann is not None:
                    lays = [layout(d, s, mesh, ann.kinds, True) for d in ann.outputs]
                row.append(scale * sum(local_bytes(graph, x, lays[k], sizes) for k, x in outs))
            peak[c] = row
        key = tuple(sorted((c, tuple(r)) for c, r in peak.items()))
        if peak and key not in seen:
            seen.add(key)
            out.append(peak)
    return out


def _cotangent_phases(graph, where, acts: dict, cots: dict) -> list[dict]:
    """Per op whose backward may hold more than the kept values it has freed: {cluster:
    bytes per strategy} of its cotangents (``cots``: op id -> bytes per strategy of its
    cluster; its outputs' and the inputs a gradient flows to, in its layouts) less the
    values kept (``acts``, alike) by the ops after it, as the estimate's
    :func:`~jscaler.cost.memory.cotangent_extra` counts them. None for an op no choice
    can make fuller than 0 or than another op's under every choice, nor for one whose
    cluster has an op after it with cotangents as large under each strategy (a repeated
    layer's: only the last layer's can be the fullest)."""
    ids = [op.id for op in graph.ops]
    n = len(ids)
    least_after, most_after = [0.0] * (n + 1), [0.0] * (n + 1)
    for i in range(n - 1, -1, -1):
        least_after[i] = least_after[i + 1] + min(acts[ids[i]])
        most_after[i] = most_after[i + 1] + max(acts[ids[i]])
    live = [i for i in range(n) if any(cots[ids[i]])]
    floor = max([0.0, *(min(cots[ids[i]]) - most_after[i + 1] for i in live)])
    later: dict[int, list] = {}
    chosen = []
    for i in reversed(live):
        cot, c = cots[ids[i]], where[ids[i]]
        if max(cot) - least_after[i + 1] <= floor:
            continue
        if any(all(a <= b for a, b in zip(cot, big)) for big in later.get(c, ())):
            continue
        later.setdefault(c, []).append(cot)
        chosen.append(i)
    if not chosen:
        return []
    # per cluster, the kept bytes of its ops from position i on, at each of its positions
    suffix: dict[int, list] = {}
    for i in range(n - 1, min(chosen), -1):
        row = acts[ids[i]]
        if any(row):
            c = where[ids[i]]
            prev = suffix[c][-1][1] if c in suffix else [0.0] * len(row)
            suffix.setdefault(c, []).append((i, [a + b for a, b in zip(prev, row)]))
    keys = {c: [-pos for pos, _ in rows] for c, rows in suffix.items()}
    out = []
    for i in sorted(chosen):
        phase = {where[ids[i]]: list(cots[ids[i]])}
        for c, rows in suffix.items():
            # rows run from the last position back: the last of those past i
            k = bisect.bisect_left(keys[c], -i) - 1
            if k < 0:
                continue
            prev = phase.get(c, [0.0] * len(rows[k][1]))
            phase[c] = [a - b for a, b in zip(prev, rows[k][1])]
        out.append(phase)
    return out


def least_memory(memory: list[list[float]], peaks=()) -> float:
    """No strategy choice needs less (bytes): every cluster's leanest strategy, with each
    phase's bytes beside its kept ones (:attr:`Problem.peaks`)."""
    return _least(memory, peaks, lambda b: b)


def fits_at_all(memory: list[list[float]], capacity: float, peaks=()) -> bool:
    """Whether some strategy choice may meet the solver's memory constraint, in its units
    (each term's bytes rounded to :func:`memory_unit`, the capacity rounded down): every
    cluster's leanest strategy, with each phase's bytes beside its kept ones, a tied
    parameter split, no activation kept gathered for a reader (a lower bound: exact where
    one choice is the leanest in every phase and gathers nothing)."""
    unit = memory_unit(capacity)
    return _least(memory, peaks, lambda b: round(b / unit)) <= int(capacity // unit)


def _least(memory, peaks, unit) -> float:
    """:func:`least_memory` with every term in ``unit`` (bytes, or the solver's units)."""
    kept, phases = phase_totals(memory, peaks, unit, min)
    return max([kept, *phases])


def phase_totals(memory, peaks, unit, pick) -> tuple[float, list[float]]:
    """The kept bytes, and each phase's kept and phase bytes together, with every cluster
    at the strategy ``pick`` chooses (``min``: the leanest, ``max``: the fullest), chosen
    apart for the kept bytes and for each phase; every term in ``unit``. A cluster a phase
    leaves out holds its kept bytes in it."""
    kept = [[unit(b) for b in row] for row in memory]
    chosen = [pick(row) for row in kept]
    base = sum(chosen)
    return base, [
        base + sum(pick(k + unit(b) for k, b in zip(kept[c], r)) - chosen[c] for c, r in pk.items())
        for pk in peaks
    ]


def no_fit(mesh: MeshSpec, capacity: float, memory: list[list[float]], peaks=()) -> PlanError:
    """The error of a problem no strategy choice fits (``memory``: bytes per cluster
    and strategy; ``peaks``: the phases' :attr:`Problem.peaks`)."""
    least = least_memory(memory, peaks)
    return OutOfMemoryError(
        f"no plan on mesh {mesh} fits {capacity / 2**30:.2f} GiB per device: every "
        f"strategy choice needs {least / 2**30:.2f} GiB or more (parameter state, "
        f"activations kept for the backward pass, a recomputed layer's while its backward "
        f"runs, the backward's cotangents beside them, gradients at their reduction); add "
        f"devices, recompute, or use pipeline stages"
    )


def _whole(shape) -> Layout:
    return Layout(tuple(() for _ in shape))


def _reduced(graph: Graph, op: Op, k: int, s: Strategy, mesh: MeshSpec, inputs=False) -> Layout:
    """The reduced layout of op's k-th output (or input) under strategy ``s``."""
    ann = op.annotation
    if ann is None:
        return _whole(graph.tensors[(op.inputs if inputs else op.outputs)[k]].shape)
    dims = (ann.inputs if inputs else ann.outputs)[k]
    return layout(dims, s, mesh, ann.kinds, not inputs).reduced
