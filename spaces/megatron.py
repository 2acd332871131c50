"""Megatron-style tensor parallelism (x data parallelism), found from the graph.

No layer names are assumed. Each weight op (a matmul or convolution reading a parameter)
seeds a *dim class*: its output-feature axis, followed through the graph by the ops'
annotations. Through attention that class is the heads; through an MLP, the hidden
features; it ends where a later weight op sums it away. So the first weight op of a
class is split column-wise, the one that closes it row-wise (partial sums, reduced once),
and everything between by heads or features, as Megatron-LM does by hand. A weight op
already inside a chosen class is not seeded again, nor one whose class runs through
several repeated layers (the residual stream a linear patch embedding writes: the layers'
heads and hidden features are split instead). The embedding table is split by
vocabulary (partial-sum lookups). Ops that cannot split a class n ways get the whole
tensor instead.

A fused projection (q, k and v from one matmul, cut apart by ``split``) is traced on its
(parts, features) view (:mod:`jscaler.ir.unfuse`): its features are split, so each device
computes its heads of q, of k and of v; the kernel itself stays whole on every device.
Parts of unequal sizes (grouped-query q/k/v) and a fused output reshaped into heads then
sliced get a matmul per part on a slice of the kernel (:mod:`jscaler.ir.fused_parts`).
Grouped queries reshaped to (kv heads, group), with fewer kv heads than tp, have no dim
that splits tp ways: those ops split by query rows (the sequence) instead.

With ``sp=True`` (Megatron sequence parallelism), ops outside the tensor-parallel regions
(norms, residual adds, dropout, the loss) are split along the sequence over the same tp
devices: activations enter a region by all-gather and leave it by reduce-scatter instead
of all-reduce, and the per-device activation memory outside the regions drops tp-fold.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass, replace

import jscaler
from jscaler.ir import LOOP_PRIMITIVES
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
from spaces.zero import zero_over

WEIGHT_OPS = ("dot_general", "conv_general_dilated", "ragged_dot_general")
# a stacked weight's slice (per iteration) or a pipeline chunk's rows: outside any region
_SCAN_VIEWS = (*LOOP_PRIMITIVES, "scan_chunk")


# ops a weight passes through before its matmul: casts, the transpose of a kernel stored
# (out, in), as Hugging Face's GPT-2 Conv1D does, and the (parts, features) view of a fused
# projection's kernel (jscaler.ir.unfuse; the dim classes follow them all)
_PARAM_VIEWS = ("convert_element_type", "copy", "identity", "transpose", "reshape", "slice")


def param_source(graph: jscaler.Graph, t: int) -> int | None:
    """The parameter a tensor is (through dtype conversions and transposes), or None."""
    return graph.param_behind(t, _PARAM_VIEWS)


def tp_seeds(graph: jscaler.Graph, classes: DimClasses):
    """The tensor axes whose classes Megatron splits, in graph order, and the *heads*:
    weight ops whose output features the very next op needs whole (an LM head feeding a
    softmax), which are better not split by features."""
    seeds, covered, heads = [], set(), []
    layer_of = {o.id: i for i, lay in enumerate(graph.layers()) for o in lay.graph.ops}
    for op in graph.ops:
        ann = op.annotation
        if ann is None:
            continue
        if op.primitive == "gather" and any(ann.kinds[d] == "+" for d in ann.dims):
            table = op.inputs[0]
            if param_source(graph, table) is not None:
                seeds.append((table, 0))
            continue
        if op.primitive not in WEIGHT_OPS:
            continue
        if any(classes.dim_of(op, c) is not None for c in covered):
            continue  # this weight op closes (or lies inside) an earlier class
        for k, x in enumerate(op.tensor_inputs[:2]):
            if param_source(graph, x) is None or k == 0 and op.primitive != "dot_general":
                continue
            out_dims = {ax[0] for ax in ann.outputs[0]}
            w_dims = ann.inputs[k]
            free = [
                a for a, ax in enumerate(w_dims) if ax[0] in out_dims and ann.kinds[ax[0]] == ""
            ]
            if not free:
                continue
            # a fused projection's (parts, features) view: the parts axis is sliced apart
            # right after; its features (the heads of q, k and v) are what to split. Of
            # several, the last: an expert kernel (experts, d, f) splits its features f
            whole = [a for a in free if not _cut_apart(classes, x, a)]
            axis = whole[-1] if whole else free[0]
            cls = classes.of(x, axis)
            if _spans_layers(graph, classes, cls, layer_of):
                break  # a residual stream (a linear patch embedding's output): not a region
            if _needed_whole(graph, classes, op, cls):
                heads.append(op)
            else:
                seeds.append((x, axis))
                covered.add(cls)
            break
    return seeds, heads


def fused_kernels(graph: jscaler.Graph) -> frozenset[int]:
    """The parameters a fused projection reads: every consumer (past a stacked weight's
    per-iteration slice) is a slice or a reshape feeding a matmul (jscaler.ir.fused_parts,
    jscaler.ir.unfuse). Megatron computes their parts by heads from the whole kernel."""
    found = set()
    for p in graph.params():
        t, users = p.id, graph.consumers(p.id)
        if len(users) == 1 and users[0].primitive in _SCAN_VIEWS:
            t = users[0].outputs[0]
            users = graph.consumers(t)
        if len(graph.tensors[t].shape) < 2 or not users:
            continue
        if all(
            u.primitive in ("slice", "reshape")
            and all(c.primitive in WEIGHT_OPS for c in graph.consumers(u.outputs[0]))
            for u in users
        ):
            found.add(p.id)
    return frozenset(found)


def _cut_apart(classes: DimClasses, x: int, axis: int) -> bool:
    """True when a slice cuts the class of the tensor axis (a fused projection's parts)."""
    return any(
        op.primitive == "slice" and op.annotation.kinds[d] == "^"
        for op, d in classes.op_dims(classes.of(x, axis))
    )


def _spans_layers(graph: jscaler.Graph, classes: DimClasses, cls, layer_of: dict[int, int]) -> bool:
    """True when a tensor carrying the class flows from one repeated layer into another:
    the features of a residual stream (what a linear embedding writes), which every layer
    reads and adds to. Megatron splits the layers' own classes (heads, hidden features)
    instead, including one that several layers read from a value made outside them (T5's
    relative-position bias, computed once per stack, carries every layer's heads). Under
    a scan, the layers are one body: a class that reaches a carry's output is read by the
    next iteration."""
    for op, _ in classes.op_dims(cls):
        if op.loop is not None:  # a scan's carry: the next iteration (layer) reads it
            carried = {out for _, out in op.loop.carries}
            for t in op.outputs:
                if t not in carried or t not in graph.tensors:  # a plan graph's own op
                    continue
                if any(classes.of(t, a) == cls for a in range(len(graph.tensors[t].shape))):
                    return True
        here = layer_of.get(op.id)
        if here is None:
            continue
        for t in op.outputs:
            users = [u for u in graph.consumers(t) if layer_of.get(u.id, here) != here]
            rank = len(graph.tensors[t].shape)
            if users and any(classes.of(t, a) == cls for a in range(rank)):
                return True
    return False


def tp_regions(classes: DimClasses, seeds, pieces: int):
    """``(ops, seed)`` per tensor-parallel region: the ops carrying a seeded class (an
    attention's heads, an MLP's hidden features; ``seeds`` from :func:`tp_seeds`), when
    every one of them cuts into ``pieces``. The embedding's vocabulary class is not a
    region, nor are a scan's boundary ops and a pipeline chunk's rows of a stack (a stacked
    weight's slice is read by the region, inside the scan's body)."""
    for seed in seeds:
        dims = list(classes.op_dims(classes.of(*seed)))
        if any(op.annotation.sizes[d] % pieces for op, d in dims):
            continue
        # the vocabulary class (a lookup's indexed axis) is not a region; a gather that
        # keeps the class whole per index (a relative-position bias table's heads) is
        if not any(op.primitive == "gather" and op.annotation.kinds[d] == "+" for op, d in dims):
            ops = [op for op, _ in dims if op.primitive not in _SCAN_VIEWS]
            # a class through a stacked weight joins every pipeline chunk's layers: a
            # region per chunk (each a scan of its own)
            chunks: dict = {}
            for op in ops:
                chunks.setdefault(op.loop, []).append(op)
            if len(chunks) > 1 and None not in chunks:
                yield from ((chunk, seed) for chunk in chunks.values())
            else:
                yield ops, seed


def _closed_by_a_weight_op(graph, classes: DimClasses, seed) -> bool:
    """Whether a matmul or convolution reading a parameter sums the seed's class away (an
    attention's output projection, an MLP's down projection): a region then ends with one
    reduction. A class the loss consumes instead (the LM head's vocabulary, cut by a
    label lookup between its reductions) stays with XLA."""
    for op, d in classes.op_dims(classes.of(*seed)):
        if (
            op.primitive in ("dot_general", "conv_general_dilated")
            and op.annotation.kinds[d] == "+"
            and any(graph.param_behind(t, ()) is not None for t in op.tensor_inputs)
        ):
            return True
    return False


def _needed_whole(graph, classes, op, cls) -> bool:
    """True when a consumer of the op's output cannot split the class's dim."""
    for user in graph.consumers(op.outputs[0]):
        d = classes.dim_of(user, cls)
        if d is not None and user.annotation is not None and user.annotation.kinds[d] == "^":
            return True
    return False


@dataclass(frozen=True)
class Megatron:
    tp: int = 1
    dp: int | None = None
    pp: int = 1
    sp: bool = False
    recompute: float = 0
    precision: str = "fp32"
    zero: int = 0
    regions: bool = False

    def __call__(self, graph: jscaler.Graph, n_devices: int) -> Plan | jscaler.PipelinePlan:
        dp = infer_dp(n_devices, self.tp, self.pp, self.dp, "megatron")
        if self.pp > 1:
            return pipeline(graph, replace(self, pp=1, dp=dp), self.pp, n_devices)
        mesh = MeshSpec.create(dp=dp, tp=self.tp)
        sp = ", sp=True" if self.sp else ""
        zero = f", zero={self.zero}" if self.zero else ""
        regions = ", regions=True" if self.regions else ""
        name = f"megatron(tp={self.tp}, dp={dp}{sp}{zero}{regions})"
        # the same split serves every setting of dp x tp on this graph (ZeRO stages,
        # regions, recomputation, coshard's base): made once per graph
        key = (tensor_parallel, mesh, self.sp)
        plan = graph.memo(key, lambda: tensor_parallel(graph, mesh, self.sp)).evolve(name=name)
        _warn_whole_attention(graph, self.tp)
        # fused kernels (read through slices or a view, whole over tp) are stored split
        # over tp, as the plain rules store them, and gathered for use (ZeRO-3 over tp)
        fused = fused_kernels(graph)
        if fused and self.tp > 1:
            axes = ("dp", "tp") if self.zero == 3 and dp > 1 else ("tp",)
            plan = zero_over(plan, graph, 3, axes, only=fused)
        rest = frozenset(p.id for p in graph.params()) - fused
        plan = zero_over(plan, graph, self.zero, only=rest)
        if self.regions:
            classes = DimClasses.for_graph(plan.pgraph.graph)
            seeds = _divisible_seeds(graph, tp_seeds(graph, classes)[0], self.tp)
            for ops, seed in tp_regions(classes, seeds, self.tp):
                if _closed_by_a_weight_op(graph, classes, seed):
                    plan, _ = op_trans(plan, ops, manual())
        return recompute_layers(plan, self.recompute)


def tensor_parallel(graph: jscaler.Graph, mesh: MeshSpec, sp: bool = False) -> Plan:
    """Megatron's split on a ``dp`` x ``tp`` mesh, every op assigned: batch over dp, the
    tensor-parallel classes over tp (heads and what follows them along the sequence
    instead; with ``sp``, every activation outside the tensor-parallel regions too)."""
    dp, tp = mesh.shape["dp"], mesh.shape["tp"]
    plan = Plan.create(graph, mesh)
    classes = DimClasses.for_graph(plan.pgraph.graph)
    plan = split_classes(plan, batch_axes(graph, dp), dp, classes=classes)
    seeds, heads = tp_seeds(graph, classes)
    if not seeds and tp > 1:
        raise jscaler.PlanError(
            f"megatron(tp={tp}): the graph has no weight op (a matmul or convolution "
            f"reading a parameter) or embedding lookup to split; use dp() or zero()"
        )
    seeds = _divisible_seeds(graph, seeds, tp)
    seq = sequence_axes(graph)
    seq_roots = {classes.of(*s) for s in seq}
    batch_roots = {classes.of(*s) for s in batch_axes(graph)}
    order = {o.id: i for i, o in enumerate(graph.ops)}
    first_head = min((order[h.id] for h in heads), default=len(graph.ops))

    seed_roots = {classes.of(*s) for s in seeds}

    def heads_whole(op) -> bool:
        """The op carries a split class on a dim tp does not divide: grouped-query
        attention's queries reshaped to (kv heads, group), fewer kv heads than tp."""
        sizes = op.annotation.sizes if op.annotation is not None else {}
        return any(
            (d := classes.dim_of(op, r)) is not None and sizes.get(d, 0) % tp for r in seed_roots
        )

    def choose(op, dim):  # only activations split along the sequence
        if not any(classes.dim_of(op, r) == dim for r in seq_roots):
            return True
        if heads_whole(op):  # split by query rows where the heads cannot split
            return any(classes.dim_of(op, r) for r in batch_roots)
        after_head = order.get(op.id, -1) >= first_head
        return (sp or after_head) and any(classes.dim_of(op, r) for r in batch_roots)

    plan = split_classes(plan, seeds + seq, tp, classes=classes, choose=choose)
    return assign_mesh(plan, ["dp", "tp"])


def pipeline(graph: jscaler.Graph, inner, pp: int, n_devices: int) -> jscaler.PipelinePlan:
    """``pp`` groups of consecutive devices, each running its stages under ``inner``
    (the same plan on every group's own devices)."""
    size = n_devices // pp
    # layers stacked under a scan are cut along their layer axis, a scan per chunk
    graph = jscaler.ir.chunk_loops(graph, pp)
    plan = inner(graph, size)
    groups = [jscaler.StageGroup(tuple(range(k * size, (k + 1) * size)), plan) for k in range(pp)]
    name = plan.name[:-1] + f", pp={pp})" if plan.name.endswith(")") else f"{plan.name} pp={pp}"
    return jscaler.PipelinePlan(tuple(groups), name=name)


def sequence_axes(graph: jscaler.Graph) -> list[tuple[int, int]]:
    """Axis 1 of every batch leaf of rank >= 2: the sequence, for sequence parallelism."""
    return [
        (t, 1)
        for t in graph.inputs
        if graph.tensors[t].role == "batch" and len(graph.tensors[t].shape) >= 2
    ]


def _warn_whole_attention(graph: jscaler.Graph, tp: int) -> None:
    """Warns when an attention's heads do not split ``tp`` ways: its ops then split by
    query rows, keys and values whole on every tensor-parallel device (or run whole)."""
    if tp == 1:
        return
    for att in jscaler.find_attention(graph):
        k_heads = graph.tensors[att.k].shape[att.k_axes.heads]
        q_heads = graph.tensors[att.q].shape[att.q_axes.heads]
        if q_heads % tp or k_heads % tp:
            heads = f"{q_heads} heads" + (
                f" ({k_heads} key/value heads)" if k_heads != q_heads else ""
            )
            warnings.warn(
                f"megatron(tp={tp}): the attention at {att.path or 'the top level'} has "
                f"{heads}, which {tp} does not divide: where its heads cannot split {tp} "
                f"ways its ops split by query rows (keys and values whole on every device), "
                f"or run whole where they have no sequence axis. To split it by heads, "
                f"choose tp among the divisors of {math.gcd(q_heads, k_heads)}",
                stacklevel=3,
            )
            return


def _divisible_seeds(graph: jscaler.Graph, seeds, tp: int) -> list:
    """The seeds whose weight splits tp ways; the others (a 10-class classifier at tp=4)
    stay whole. If none splits, the space does not apply: name the first."""
    ok = [(t, axis) for t, axis in seeds if graph.tensors[t].shape[axis] % tp == 0]
    if seeds and not ok:
        t, axis = seeds[0]
        size = graph.tensors[t].shape[axis]
        user = next(o for o in graph.ops if t in o.tensor_inputs)
        raise jscaler.PlanError(
            f"megatron(tp={tp}) cannot split {user.where}: its weight "
            f"{graph.tensors[t].name!r} has {size} features along axis {axis}, which "
            f"{tp} does not divide. Choose tp among the divisors of {size}."
        )
    return ok


def infer_dp(
    n_devices: int, tp: int, pp: int, dp: int | None, space: str, degree: str = "tp"
) -> int:
    """dp from the device count; ``degree`` is what the space calls ``tp`` (a sequence
    space's ``sp``, USP's ``ring*ulysses``), for its messages."""
    check_int(space, degree, tp)
    check_int(space, "pp", pp)
    if dp is not None and (isinstance(dp, bool) or not isinstance(dp, int) or dp < 1):
        raise jscaler.PlanError(
            f"{space}: dp must be a positive int, or left out to infer it; got {dp!r}"
        )
    call = f"{space}({degree}={tp}" + (f", pp={pp}" if pp > 1 else "")
    need = f"{degree}*pp={tp * pp}" if pp > 1 else f"{degree}={tp}"
    if dp is None:
        if n_devices % (tp * pp):
            raise jscaler.PlanError(
                f"{call}) needs a device count divisible by {need}; got {n_devices} devices"
            )
        return n_devices // (tp * pp)
    if dp * tp * pp != n_devices:
        raise jscaler.PlanError(
            f"{call}, dp={dp}) uses dp*{need.split('=')[0]}={dp * tp * pp} devices; "
            f"{n_devices} were given. Leave dp out to infer it."
        )
    return dp


def megatron(
    tp: int = 1,
    dp: int | None = None,
    pp: int = 1,
    sp: bool = False,
    recompute: float = 0,
    precision: str = "fp32",
    zero: int = 0,
    regions: bool = False,
) -> Megatron:
    """Megatron tensor parallelism of degree ``tp`` times data parallelism ``dp``
    (inferred as devices / (tp * pp) when not given); ``sp`` adds sequence parallelism;
    ``recompute`` is the fraction of repeated layers to checkpoint; ``precision="bf16"``
    computes in bf16 with fp32 master parameters; ``zero`` = ZeRO stage over dp, each
    device's tensor-parallel shard split further over dp; ``regions=True`` runs each
    tensor-parallel region as a manual ``shard_map`` region (jscaler's collectives: one
    reduction of a shared input's gradient instead of one per consumer)."""
    return Megatron(tp, dp, pp, sp, recompute, precision, zero, regions)
