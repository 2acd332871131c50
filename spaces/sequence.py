"""Sequence parallelism for long sequences: Ulysses, ring attention, and USP (both).

Every activation is split along the sequence over an ``sp`` mesh axis, parameters are
replicated (their gradients all-reduced over dp and sp together). Attention needs every
key for each query, so DeepSpeed-Ulysses switches layouts around it: the core of attention
(rotary embedding, scores, softmax, the weighted sum of values) is split by heads instead,
and the switch from "sequence-split, all heads" to "heads-split, whole sequence" and back
is an all-to-all each way. Here that is just a choice of split per op; the layouts imply
the all-to-alls and XLA emits them.

The attention core is found from the graph, not from names: the op that carries the
sequence class twice (queries and keys of the score matmul) marks attention, and its
output dims that are neither batch nor sequence are the heads. Ops reading a parameter
(the q/k/v/o projections) stay split by sequence, so the weights never need splitting.

Ring attention (``ring(sp)``) keeps the sequence split through attention too: the
attention subgraph becomes a manual region (``manual("ring_attention", "sp")``) in which
each device keeps its queries and passes key/value blocks around the ring, folding them
into an online softmax; no device ever holds the whole sequence. USP
(``usp(ulysses=u, ring=r)``) nests the two on a 2-D sequence mesh: the sequence is split
over ``ring`` (major) and ``uly`` (minor); around attention an all-to-all over ``uly``
trades the minor sequence split for heads, and the ring runs over ``ring``.
"""

from __future__ import annotations

from dataclasses import dataclass

import jscaler
from jscaler.plan import (
    DimClasses,
    MeshSpec,
    Plan,
    assign_mesh,
    batch_axes,
    manual,
    op_trans,
    recompute_layers,
    split_classes,
)
from spaces.knobs import check_int
from spaces.megatron import infer_dp, param_source, sequence_axes
from spaces.zero import zero_over


def attention_heads(graph: jscaler.Graph, classes: DimClasses):
    """The heads class of each attention in the graph, and the score ops marking them.

    Returns ``(head_seeds, score_ops)``: tensor axes ``(tensor id, axis)`` whose classes
    are attention heads, and the ops that carry the sequence class twice.
    """
    seq_roots = {classes.of(*s) for s in sequence_axes(graph)}
    batch_roots = {classes.of(*s) for s in batch_axes(graph)}
    seeds, scores, seen = [], [], set()
    for op in graph.ops:
        ann = op.annotation
        if ann is None or not op.outputs:
            continue
        if not any(len(classes.dims_in(op, r)) >= 2 for r in seq_roots):
            continue
        scores.append(op)
        out = op.outputs[0]
        for axis, ax in enumerate(ann.outputs[0]):
            cls = classes.of(out, axis)
            if cls in seq_roots or cls in batch_roots or cls in seen:
                continue
            if ann.kinds[ax[0]] == "":
                seeds.append((out, axis))
                seen.add(cls)
    return seeds, scores


def _split_heads(plan, graph, classes, n, knob, activations) -> Plan:
    """One tree level of Ulysses: attention cores split n ways by heads, the projections
    and every other activation (``activations(op, dim)``) by sequence."""
    heads, scores = attention_heads(graph, classes)
    if not scores or not heads:
        raise jscaler.PlanError(
            "ulysses: the graph has no attention (an op reading the sequence twice, as "
            "queries and keys) whose heads could be split; use dp(), megatron() or zero()"
        )
    _check_divides(graph, heads, scores, n, knob)
    head_roots = {classes.of(*h) for h in heads}

    def choose(op, dim):
        if any(classes.dim_of(op, r) == dim for r in head_roots):
            return not any(param_source(graph, x) is not None for x in op.tensor_inputs)
        return activations(op, dim)

    return split_classes(plan, heads + sequence_axes(graph), n, classes=classes, choose=choose)


@dataclass(frozen=True)
class Ulysses:
    sp: int = 1
    dp: int | None = None
    recompute: float = 0
    precision: str = "fp32"
    zero: int = 0

    def __call__(self, graph: jscaler.Graph, n_devices: int) -> Plan:
        dp = infer_dp(n_devices, self.sp, 1, self.dp, "ulysses", "sp")
        mesh = MeshSpec.create(dp=dp, sp=self.sp)
        plan = Plan.create(graph, mesh, name=f"ulysses(sp={self.sp}, dp={dp})")
        classes = DimClasses.for_graph(plan.pgraph.graph)
        plan = split_classes(plan, batch_axes(graph, dp), dp, classes=classes)
        seq = sequence_axes(graph)
        _check_sequence(graph, seq, self.sp)
        batch_roots = {classes.of(*b) for b in batch_axes(graph)}

        def activations(op, dim):  # the sequence: only ops that also carry the batch
            return any(classes.dim_of(op, r) for r in batch_roots)

        plan = _split_heads(plan, graph, classes, self.sp, "sp", activations)
        plan = zero_over(assign_mesh(plan, ["dp", "sp"]), graph, self.zero)
        return recompute_layers(plan, self.recompute)


def _check_divides(graph, heads, scores, n, knob):
    for (t, axis), op in zip(heads, scores):
        size = graph.tensors[t].shape[axis]
        if size % n:
            raise jscaler.PlanError(
                f"ulysses({knob}={n}) cannot split the heads of {op.where}: it has {size} "
                f"heads, which {n} does not divide. Choose {knob} among the divisors of {size}, "
                f"or use ring attention (ring(sp=...)) or usp(ulysses=..., ring=...)"
            )


def _check_sequence(graph, seq, n):
    for t, axis in seq:
        size = graph.tensors[t].shape[axis]
        if size % n:
            raise jscaler.PlanError(
                f"sequence parallelism of degree {n} cannot split batch leaf "
                f"{graph.tensors[t].name!r}: its sequence axis has {size} positions; use a "
                f"degree that divides {size} or pad the sequence"
            )


def ulysses(
    sp: int = 1, dp: int | None = None, recompute: float = 0, precision: str = "fp32", zero=0
) -> Ulysses:
    """DeepSpeed-Ulysses sequence parallelism of degree ``sp`` (activations split along
    the sequence, attention by heads, all-to-all between) times data parallelism ``dp``
    (inferred as devices / sp when not given); ``zero`` = ZeRO stage over dp."""
    return Ulysses(sp, dp, recompute, precision, zero)


def _ring_plan(graph, n_devices, *, ring: int, uly: int, dp, space: str, name: str) -> Plan:
    """Sequence split over ``ring`` x ``uly`` (ring major), attentions as ring regions over
    ``ring`` and, when ``uly`` > 1, split by heads over ``uly`` (Ulysses inside)."""
    check_int(space, "ring" if space == "usp" else "sp", ring)
    check_int(space, "ulysses", uly)
    dp = infer_dp(n_devices, ring * uly, 1, dp, space, "sp" if uly == 1 else "ring*ulysses")
    axes = {"dp": dp, "ring": ring} | ({"uly": uly} if uly > 1 else {})
    plan = Plan.create(graph, MeshSpec.create(**axes), name=name.format(dp=dp))
    classes = DimClasses.for_graph(plan.pgraph.graph)
    plan = split_classes(plan, batch_axes(graph, dp), dp, classes=classes)
    seq = sequence_axes(graph)
    attentions = jscaler.find_attention(graph)
    if not attentions:
        raise jscaler.PlanError(
            f"{space}: found no attention to run as a ring (softmax(q k^T * scale [+ "
            f"constant causal mask]) v over a sequence axis); use ulysses(), dp() or zero()"
        )
    _check_sequence(graph, seq, ring * uly)
    inside = {o for a in attentions for o in a.ops}
    batch_roots = {classes.of(*b) for b in batch_axes(graph)}

    def activations(op, dim):
        return op.id not in inside and any(classes.dim_of(op, r) for r in batch_roots)

    plan = split_classes(plan, seq, ring, classes=classes, choose=activations)
    levels = ["dp", "ring"]
    if uly > 1:
        plan = _split_heads(plan, graph, classes, uly, "ulysses", activations)
        levels.append("uly")
    plan = assign_mesh(plan, levels)
    for a in attentions:
        plan, _ = op_trans(plan, a.ops, manual("ring_attention", "ring"))
    return plan


@dataclass(frozen=True)
class Ring:
    sp: int = 1
    dp: int | None = None
    recompute: float = 0
    precision: str = "fp32"
    zero: int = 0

    def __call__(self, graph: jscaler.Graph, n_devices: int) -> Plan:
        name = f"ring(sp={self.sp}, dp={{dp}})"
        plan = _ring_plan(
            graph, n_devices, ring=self.sp, uly=1, dp=self.dp, space="ring", name=name
        )
        return recompute_layers(zero_over(plan, graph, self.zero), self.recompute)


@dataclass(frozen=True)
class USP:
    ulysses: int = 1
    ring: int = 1
    dp: int | None = None
    recompute: float = 0
    precision: str = "fp32"
    zero: int = 0

    def __call__(self, graph: jscaler.Graph, n_devices: int) -> Plan:
        name = f"usp(ulysses={self.ulysses}, ring={self.ring}, dp={{dp}})"
        plan = _ring_plan(
            graph, n_devices, ring=self.ring, uly=self.ulysses, dp=self.dp, space="usp",
            name=name,
        )  # fmt: skip
        return recompute_layers(zero_over(plan, graph, self.zero), self.recompute)


def ring(
    sp: int = 1, dp: int | None = None, recompute: float = 0, precision: str = "fp32", zero=0
) -> Ring:
    """Ring attention sequence parallelism of degree ``sp`` (the sequence stays split
    through attention; key/value blocks travel around the ring) times data parallelism;
    ``zero`` = ZeRO stage over dp."""
    return Ring(sp, dp, recompute, precision, zero)


def usp(
    ulysses: int = 1,
    ring: int = 1,
    dp: int | None = None,
    recompute: float = 0,
    precision: str = "fp32",
    zero: int = 0,
) -> USP:
    """Unified sequence parallelism: Ulysses of degree ``ulysses`` inside ring attention of
    degree ``ring`` on a 2-D sequence mesh, times data parallelism ``dp``; ``zero`` = ZeRO
    stage over dp."""
    return USP(ulysses, ring, dp, recompute, precision, zero)
