"""Predicted memory per device of a plan, without running it: the terms :func:`estimate
<jscaler.cost.estimate.estimate>`, the pipeline model and the ILP's memory are built from.

Parameters and optimizer state in their stored and update layouts and the batch are held
throughout; then the larger of two phases. The backward pass holds the activations it
keeps: every forward value a non-linear consumer reads for a gradient (a matmul's operand
where the other needs one, an exp's output ...; a product with a constant reads the
constant alone, as JAX's transpose does), in its layout, except values made and read
inside one recomputed layer or coshard region (the backward reruns it from its inputs);
plus the larger of the working set of the largest recomputed group while its backward
runs (a coshard region inside it counts one colocated piece: the pieces run one at a
time) and the backward's own buffers at an op, its cotangents and weight gradient less
the kept values already freed (:func:`cotangent_extra`: at the loss head, the logits'
cotangent). The gradient reduction after it holds every gradient as the backward made it
(partial sums over data parallelism, in the layout the forward read the parameter in:
ZeRO-3's gathered one), since XLA combines a step's reductions into one collective, and
their reduced copies. On a backend without a grouped matmul (``Cluster.native_ragged_dot``
False: XLA on CPU and GPU) a ``ragged_dot`` is a dense dot over its piece's groups, whose
expanded lhs the backward keeps (:func:`ragged_expansions`). Layers stacked under an
exposed scan add a third phase, the scan's backward: the loop's kept values and those
made before it (the loss head's were freed by its own backward, which ran first), one
iteration's rerun values, its layer's weight gradients (and ZeRO-3's gathered weights),
the stacked gradient buffer of every layer the loop writes (:func:`stacked_grads`) and
the gradients the loss head already made, all held for the step's one combined
reduction. ``jscaler bench cost`` holds the total to XLA's ``memory_analysis()``.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping
from dataclasses import dataclass

import jax.numpy as jnp

from jscaler.compile.comm import NON_DIFFERENTIABLE, needs_grad
from jscaler.compile.layout import Layout
from jscaler.compile.lower import output_layout
from jscaler.compile.reshard import loop_regathers, reshard_units
from jscaler.compile.softmax import softmax_chains
from jscaler.cost.cluster import Cluster
from jscaler.cost.fusion import fused_kept, materialised
from jscaler.ir.graph import Literal
from jscaler.plan.pieces import device_pieces
from jscaler.plan.plan import Plan

__all__ = [
    "PARAM_VIEWS",
    "RaggedExpansion",
    "carries_cotangent",
    "cotangent_extra",
    "gathered_view",
    "holds_cotangents",
    "local_bytes",
    "memory_breakdown",
    "nonlinear_readers",
    "ragged_expansions",
    "recompute_groups",
    "recomputed_ops",
    "reduced_bytes",
    "regathered_bytes",
    "saved_for_backward",
    "shared_params",
    "stacked_grads",
    "spmd_memory",
    "unit_edges",
    "unreduced_grad",
    "working_set",
]


# consumers that need none of their inputs' values in the backward pass
LINEAR = {
    "add", "sub", "neg", "reshape", "transpose", "broadcast_in_dim", "convert_element_type",
    "reduce_sum", "concatenate", "slice", "squeeze", "expand_dims", "copy", "identity",
    "pad", "dynamic_slice", "rev", "select_n", "stop_gradient", "cumsum", "add_any",
}  # fmt: skip


# consumers whose backward reads only their integer operands (the indices): a scatter's
# gathers the cotangent back from them (JAX's scatter JVP finds the updates that won
# from the indices alone, not the values). A gather's backward needs only its indices
# too, but the gather a loss reads its log-probabilities with stands, in this model, for
# the vocabulary-sized buffer XLA keeps for the log-softmax's backward (dropping it took
# jscaler bench cost's Llama, BERT and T5 Megatron rows 3-4 points lower, out of 10%)
INDEXED = {"scatter", "scatter-add", "scatter_add"}


# ops that show a parameter in another layout without computing a new value (a ZeRO-3
# gather makes a new buffer: the reshard rule in _memory decides whether it is kept)
PARAM_VIEWS = {"transpose", "reshape", "squeeze", "expand_dims", "copy"}


# products: the transpose of one operand's product reads only the others (JAX's of
# ``x * c`` reads ``c``), so an operand is read only for another operand's gradient
# (a division reads its numerator only for the denominator's)
PRODUCTS = {"mul", "dot_general", "conv_general_dilated"}


# ops whose derivative is their output: the backward reads the output, not the inputs
OWN_OUTPUT = {"exp", "tanh", "logistic", "sqrt", "rsqrt", "exp2"}


def local_bytes(g, t: int, layout: Layout | None, sizes) -> float:
    """Bytes of tensor ``t`` each device holds in ``layout`` (None: whole)."""
    tensor = g.tensors[t]
    whole = _nbytes(tensor.shape, tensor.dtype)
    if layout is None:
        return whole
    return whole / math.prod(sizes[a] for axes in layout.spec for a in axes)


@functools.lru_cache(maxsize=1 << 14)
def _nbytes(shape: tuple[int, ...], dtype: str) -> int:  # asked millions of times a search
    return math.prod(shape) * jnp.dtype(dtype).itemsize


def memory_breakdown(params, grads, optimizer, batch, activations, reduced=None) -> dict:
    """The per-device memory dict of an :class:`Estimate` (bytes; ``total`` added).

    ``total`` holds the parameters, optimizer state and batch throughout, plus the
    gradients and activations together; or, given ``reduced`` (the bytes the gradient
    reduction writes), the larger of two phases of one step: the backward pass holding
    the kept activations, and the reduction after it holding every gradient unreduced
    (``grads``) and reduced.
    """
    parts = {
        "params": params,
        "grads": grads,
        "optimizer": optimizer,
        "batch": batch,
        "activations": activations,
    }
    working = grads + activations if reduced is None else max(activations, grads + reduced)
    return parts | {"total": params + optimizer + batch + working}


def saved_for_backward(
    graph, recomputed: Mapping[int, object] | None = None, views: bool = False
) -> frozenset[int]:
    """Forward values the backward pass reads: inputs of non-linear consumers, outputs of
    ops whose derivative is their output (exp, tanh, logistic, sqrt, rsqrt), and of ops
    some gradient flows through. ``recomputed`` maps op id -> its recomputed group (see
    :func:`recompute_groups`): a value made and read inside one group is not kept (the
    backward reruns the group from its inputs); the group's inputs and the values it makes
    for readers outside it are. Parameters are not activations, nor (unless ``views``)
    views of them (:data:`PARAM_VIEWS`): in one compiled step XLA folds the view into the
    matmul reading it, but a pipeline stage's forward program returns it among its
    residuals, a copy per micro-batch in flight. Once per graph and arguments."""
    groups = recomputed or {}
    key = (saved_for_backward, frozenset(groups.items()), views)
    return graph.memo(key, lambda: _saved(graph, groups, views))


def _saved(graph, groups: Mapping[int, object], views: bool) -> frozenset[int]:
    reads, own = _backward_reads(graph)
    saved = {t for op_id, outs in own if op_id not in groups for t in outs}
    for t, producer, reader in reads:
        group = groups.get(producer)
        if group is None or groups.get(reader) != group:
            saved.add(t)
    # the backward reruns a group from its inputs, read linearly or not (a bf16 block's
    # input, which its norm first converts to fp32)
    for op in graph.ops:
        group = groups.get(op.id)
        if group is not None:
            for t in op.tensor_inputs:
                made = graph.producer(t)
                if made is None or groups.get(made.id) != group:
                    saved.add(t)
    return frozenset(saved & _activation_tensors(graph, views))


def _backward_reads(graph) -> tuple[tuple, tuple]:
    """What the backward pass may read, before recomputation decides what is kept (once
    per graph): ``(tensor, its producer's id or None, reader's id)`` per value a
    non-linear differentiable op reads, and ``(op id, outputs)`` per op whose derivative
    is its output."""
    return graph.memo((_backward_reads,), lambda: _find_backward_reads(graph))


def _find_backward_reads(graph) -> tuple[tuple, tuple]:
    needs = needs_grad(graph)
    producer = {t: op.id for op in graph.ops for t in op.outputs}
    reads, own = [], []
    # a softmax's ops are differentiated by its rule, which reads its output alone
    # (jscaler.compile.softmax)
    chains = softmax_chains(graph)
    in_chain = {i for _, _, ids in chains.values() for i in ids}
    for op in graph.ops:
        if op.primitive in NON_DIFFERENTIABLE or op.primitive in LINEAR:
            continue
        if not any(t in needs for t in op.outputs):
            continue
        if op.id in chains:
            own.append((op.id, op.outputs))
            continue
        if op.id in in_chain:
            continue
        if op.primitive in OWN_OUTPUT:
            own.append((op.id, op.outputs))
            continue
        operands = [(k, t) for k, t in enumerate(op.inputs) if not isinstance(t, Literal)]
        for k, t in operands:
            if op.primitive in INDEXED and jnp.issubdtype(graph.tensors[t].dtype, jnp.inexact):
                continue
            if op.primitive in PRODUCTS or (op.primitive == "div" and k == 0):
                # x * c: the transpose reads c alone; x is read for c's gradient
                if not any(u in needs for j, u in operands if j != k):
                    continue
            reads.append((t, producer.get(t), op.id))
    return tuple(reads), tuple(own)


def _activation_tensors(graph, views: bool) -> frozenset[int]:
    """The tensors that count as activations: values, not parameters, nor (unless
    ``views``) views of them (a parameter seen through a transpose or reshape, GPT-2's
    ``kernel.T``, is the parameter itself, kept anyway: XLA folds the view into the
    matmul reading it). Once per graph."""
    return graph.memo(
        (_activation_tensors, views),
        lambda: frozenset(
            t
            for t, tensor in graph.tensors.items()
            if tensor.role == "value" and (views or graph.param_behind(t, PARAM_VIEWS) is None)
        ),
    )


def recompute_groups(plan: Plan) -> dict[int, object]:
    """op id -> the outermost recomputed unit it belongs to: a recomputed group (its index),
    else a coshard region (each colocated piece is recomputed), else a user's checkpoint
    in a scan's body (its policy is taken as saving nothing)."""
    out: dict[int, object] = {}
    for k, grp in enumerate(plan.recompute):
        for o in grp:
            out.setdefault(o, k)
    for j, r in enumerate(plan.regions):
        if r.kind == "coshard":
            for o in r.ops:
                out.setdefault(o, ("coshard", j))
    for o in plan.pgraph.graph.ops:  # a user's checkpoint inside a scan's body
        if o.remat is not None:
            out.setdefault(o.id, ("remat", o.loop.index, o.remat.index))
    return out


def spmd_memory(low, g, sizes, slots: int, scale: float, cl: Cluster, state: float = 1.0) -> dict:
    """An SPMD plan's :attr:`~jscaler.cost.estimate.Estimate.memory` per device (the module
    doc): lowering ``low`` of graph ``g`` on a mesh of ``sizes``, ``slots`` optimizer
    slots, activations scaled by ``scale`` and parameter state by ``state``."""

    def size(t, layout):
        return local_bytes(g, t, layout, sizes)

    params = state * sum(size(t, low.storage[t]) for t in low.update)
    grads = state * sum(size(t, unreduced_grad(low, t)) for t in low.grad)
    opt = state * slots * sum(size(t, low.update[t]) for t in low.update)
    batch = sum(size(t, low.storage[t]) for t in g.inputs if g.tensors[t].role == "batch")
    produced = {}
    for op in g.ops:
        for t, lay in zip(op.outputs, low.ops[op.id].outputs):
            produced[t] = lay
    units = recompute_groups(low.plan)
    saved = saved_for_backward(g, units)
    # a view of a gathered weight (GPT-2's transposed FlaxConv1D kernels, a tied LM head)
    # is the gathered weight to XLA, which folds the view into the matmul: kept or dropped
    # with it below
    saved = {gathered_view(g, t) or t for t in saved}
    # ZeRO-3's gathered weights are dropped after each layer's forward (reshard after
    # forward): one layer's are alive at a time, not every layer's until the backward
    gathered = [
        [t for o in unit if o.kind == "identity" for t in o.outputs]
        for unit in reshard_units(low, list(g.ops)).values()
    ]
    dropped = {t for ts in gathered for t in ts}
    saved -= dropped
    if cl.fuses_elementwise:
        # a value crossing into or out of a recomputed unit is kept as it is: the chain
        # that made it is not rerun from its inputs, which are not kept
        saved = fused_kept(g, saved, unit_edges(g, units)) - dropped
    in_loops = {t for o in g.ops if o.loop is not None for t in o.outputs}
    kept = {t: size(t, produced[t]) for t in saved if t in produced and t not in in_loops}
    regathered = regathered_bytes(low, g, kept, sizes, units)
    looped, iteration = loop_residuals(low, g, sizes)
    kept.update(looped)
    work = max(
        working_set(low, None, cl.fuses_elementwise),
        *(sum(size(t, produced[t]) for t in ts) for ts in gathered),
        0.0,
    )
    # the backward's own buffers where it starts, or a recomputed layer's working set
    extra = cotangent_extra(low, g, g.ops, kept, cl.fuses_elementwise)
    acts = scale * (sum(kept.values()) + regathered + max(work, extra))
    if not cl.native_ragged_dot:
        masks = not cl.fuses_elementwise
        acts = scale * (_dense_ragged_peak(low, g, kept, work, extra, masks) + regathered)
    if looped:
        last = max(k for k, o in enumerate(g.ops) if o.loop is not None)  # the last scan's
        stacked = state * sum(size(t, low.storage[t]) for t in stacked_grads(g, low.grad))
        # one iteration's backward holds its layer's weight gradients before they join
        # the stack and, under ZeRO-3, the layer's weights gathered again
        layer = sum(_layer_bytes(g, o, produced, size) for o, _ in _layer_slices(g, low.grad))
        during = _loop_backward(g, kept, last) + regathered + iteration + layer
        # the gradients the backward made before the loop's (the loss head's weights, a
        # tied embedding's head part), held for the step's one combined reduction
        after = {_stored(g, t) for o in g.ops[last + 1 :] for t in o.inputs} & set(low.grad)
        made = state * sum(size(t, unreduced_grad(low, t)) for t in after)
        acts = max(acts, scale * during + stacked + made)
    reduced = state * sum(reduced_bytes(low, t, cl) for t in low.grad)
    reduced += state * sum(
        2 * (len(readers) - 1) * size(t, unreduced_grad(low, t))
        for t, readers in shared_params(g).items()
        if t in low.grad
    )
    return memory_breakdown(params, grads, opt, batch, acts, reduced)


def _loop_backward(g, kept: Mapping, last: int) -> float:
    """What the backward of the last exposed scan (its ops end at ``g.ops[last]``) starts
    from: the kept values of the loop and of the ops before it. Those after it (the final
    norm, the loss head) were read by their own backward, which ran first, and freed.
    Keys of ``kept``: a value, or (value, layout) for an input :func:`loop_residuals`
    keeps re-laid inside a loop."""
    position = {t: k for k, o in enumerate(g.ops) for t in o.outputs}
    return sum(b for t, b in kept.items() if not isinstance(t, int) or position[t] <= last)


def _layer_bytes(g, sliced, produced, size) -> float:
    """What one iteration's backward holds of a stacked parameter's layer: its gradient,
    in the layout the body reads the layer in (the ``scan_slice``'s output, or the larger
    copy a ZeRO-3 gather makes of it), plus that gathered copy where there is one."""
    t = sliced.outputs[0]
    gathered = max(
        (size(x, produced[x]) for o in g.consumers(t) if o.kind == "identity" for x in o.outputs),
        default=0.0,
    )
    return max(size(t, produced[t]), gathered) + gathered


def _stored(g, t):
    """``t``, or the stored parameter a chain of ZeRO-3 gathers made it from."""
    made = g.producer(t) if not isinstance(t, Literal) else None
    while made is not None and made.kind == "identity":
        t = made.inputs[0]
        made = g.producer(t)
    return t


def _layer_slices(g, grad):
    """``(scan_slice op, stored parameter)`` per layer slice an exposed scan's body takes
    of a parameter in ``grad`` (directly or through a ZeRO-3 gather)."""
    for o in g.ops:
        if o.primitive == "scan_slice":
            x = _stored(g, o.inputs[0])
            if x in grad:
                yield o, x


def stacked_grads(g, grad) -> set[int]:
    """The parameters in ``grad`` an exposed scan's body reads a layer of (through its
    ``scan_slice``, or a ZeRO-3 gather of it). The backward of a scan writes their
    gradients as the loop's stacked output, one buffer for every layer allocated before
    the loop starts, so all of them are alive beside the loop's kept values while it
    runs (XLA's buffer assignment on CPU: the ``[layers, ...]`` gradient stacks live
    across the backward ``while``), before any gradient reduction."""
    return {x for _, x in _layer_slices(g, grad)}


def nonlinear_readers(graph) -> dict[int, tuple[tuple[int, int], ...]]:
    """activation -> ``(reader op id, input position)`` per non-linear differentiable op
    outside any scan that reads it for a gradient (a matmul's operand, a norm's input):
    where such a reader reads it in a larger layout than it was made in, the backward
    keeps that gathered copy (:func:`regathered_bytes`). Once per graph."""

    def make():
        reads, _ = _backward_reads(graph)
        by_id = {o.id: o for o in graph.ops}
        out: dict[int, list] = {}
        for t, made, r in reads:
            reader = by_id[r]
            src = by_id.get(made)
            # ZeRO-3's gathers ("identity": a stored weight made whole for its reader) are
            # counted as reshard_units drops or keeps them
            if src is None or src.kind == "identity" or reader.loop or src.loop:
                continue
            for k, x in enumerate(reader.inputs):
                if x == t and (r, k) not in out.get(t, ()):
                    out.setdefault(t, []).append((r, k))
        return {t: tuple(rs) for t, rs in out.items()}

    return graph.memo((nonlinear_readers,), make)


def regathered_bytes(low, g, kept: Mapping[int, float], sizes, units: Mapping[int, object]):
    """Bytes one device keeps beyond ``kept`` (activation -> bytes as made, outside scans)
    where a non-linear reader outside any recomputed unit reads a kept value in a larger
    layout than it was made in: the copy gathered for it, once per distinct layout (the
    readers of one gathered value share it). jax saves a matmul's operand, which is the
    gathered copy, and XLA holds it until the weight's gradient: under sequence
    parallelism the norm's output split along the sequence and all-gathered for the
    column-parallel matmuls after it (variant 49 of seed 20261207, ``megatron(tp=8,
    sp=True)``: predicted 7.34 MB without these, XLA 9.47 MB). The value as made is
    counted too. The search's :class:`~jscaler.search.problem.Regather` counts the same."""
    total = 0.0
    for t, readers in nonlinear_readers(g).items():
        base = kept.get(t)
        if base is None:
            continue
        larger = {}
        for r, k in readers:
            if units.get(r) is not None:
                continue
            lay = low.ops[r].inputs[k]
            b = local_bytes(g, t, lay, sizes)  # the spatial split alone: partial sums aside
            if b > base:
                larger[lay.spec] = b
        total += sum(larger.values())
    return total


# ops whose backward is two contractions (input and weight gradients), and whose outputs
# an exposed scan's body keeps (jscaler.compile.lower.loop_saves)
CONTRACTIONS = {"dot_general", "conv_general_dilated", "ragged_dot_general"}


def loop_residuals(low, g, sizes) -> tuple[dict, float]:
    """What the backward keeps of the exposed scans (the lowering's ``loop_saves``): per
    iteration, the carries it starts with and the values the backward's reads are rerun
    from: walking back from each value the backward reads, the first matmul output (or a
    collective's result, which a '+' matmul's is) or input re-laid for an op (a layout
    conversion's result) met. Everything between is rerun while that iteration's backward
    runs. Returns (key -> bytes kept over all iterations, the most that one iteration's
    backward holds of the values it reads beyond the kept ones, rerun). A stacked
    parameter's slice is the stack itself; ZeRO-3's gathered weights are gathered again
    where that saves memory, else kept; a recomputed or user-checkpointed body keeps its
    carries alone."""
    needs = needs_grad(g)
    rerun = recompute_groups(low.plan)
    kept: dict = {}
    iteration: dict = {}
    producer_layout = {
        t: output_layout(low, o, t, lay)
        for o in g.ops
        for t, lay in zip(o.outputs, low.ops[o.id].outputs)
    }

    def size(t, lay):
        return local_bytes(g, t, lay.reduced if lay.partial else lay, sizes)

    def root(x, reader, lay) -> bool:
        """Keep ``x`` as ``reader`` reads it when it is re-laid for it; True if so."""
        if producer_layout.get(x) in (None, lay):
            return False
        made = g.producer(x)
        if made is None or made.kind != "identity" or not loop_regathers(low, reader.loop):
            kept[(x, lay)] = reader.repeats * local_bytes(g, x, lay, sizes)
        return True

    def walk(t, seen):
        """Keep the roots the value ``t`` (made in a scan's body) is rerun from."""
        if t in seen:
            return
        seen.add(t)
        o = g.producer(t)
        if o is None or o.loop is None or o.id in rerun:
            return
        if o.primitive in ("scan_carry", "scan_slice") or o.kind == "identity":
            return  # a carry (kept below), a weight's slice, a gathered weight
        if o.primitive in CONTRACTIONS:
            kept[t] = o.repeats * size(t, producer_layout[t])
            return
        for x, lay in zip(o.inputs, low.ops[o.id].inputs):
            if not isinstance(x, Literal) and x in needs and not root(x, o, lay):
                walk(x, seen)

    seen: set = set()
    read: dict = {}  # loop -> the values one iteration's backward reads
    for o in g.ops:
        if o.primitive == "scan_carry":
            kept[o.outputs[0]] = o.repeats * size(o.outputs[0], low.ops[o.id].outputs[0])
    reads, own = _backward_reads(g)
    by_id = {o.id: o for o in g.ops}
    pairs = [(t, by_id[r]) for t, _, r in reads] + [(t, by_id[i]) for i, outs in own for t in outs]
    for t, reader in pairs:
        if reader.loop is None or t not in producer_layout:
            continue
        made = g.producer(t)
        if made is None or made.loop is None or made.primitive == "scan_slice":
            continue
        k = reader.outputs.index(t) if t in reader.outputs else reader.inputs.index(t)
        lays = low.ops[reader.id]
        lay = lays.outputs[k] if t in reader.outputs else lays.inputs[k]
        read.setdefault(reader.loop, {})[t] = size(t, lay)
        if reader.id in rerun:  # rerun from the body's inputs: nothing kept for it
            continue
        if t in reader.outputs or not root(t, reader, lay):
            walk(t, seen)
    # while one iteration's backward runs, the values it reads that are not kept are rerun
    for loop, values in read.items():
        iteration[loop] = sum(b for t, b in values.items() if t not in kept)
    return kept, max(iteration.values(), default=0.0)


def unit_edges(g, units: Mapping[int, object]) -> frozenset[int]:
    """The values crossing a recomputed unit's edge (``units`` as :func:`recompute_groups`
    gives them): made outside one and read inside it, or made inside one and read
    outside. A fusing backend keeps them as they are (:func:`jscaler.cost.fusion.
    fused_kept`): the backward reruns a unit from them, not the chain that made them."""
    if not units:
        return frozenset()
    found = set()
    for t in g.tensors:
        op = g.producer(t)
        home = units.get(op.id) if op is not None else None
        if any(units.get(r.id) != home for r in g.consumers(t)):
            found.add(t)
    return frozenset(found)


def shared_params(g) -> dict[int, tuple]:
    """parameter -> the ops that read it, for those read by more than one (a tied
    embedding: the lookup and the LM head). Each reader's backward makes a gradient
    contribution of the parameter's size (a lookup's scatter-add into zeros, a matmul's
    product) and XLA sums them into another: at the gradient reduction two such buffers
    per extra reader are live beside the gradient (measured: Hugging Face GPT-2's tied
    ``wte`` under dp, XLA's temp exceeded the estimate by twice its size at vocabularies
    of 512 and 2048 and widths of 64 and 128)."""
    out = {}
    for p in g.params():
        readers = g.consumers(p.id)
        if len(readers) == 1 and readers[0].kind == "identity":  # a ZeRO-3 gather's
            readers = g.consumers(readers[0].outputs[0])
        if len(readers) > 1:
            out[p.id] = tuple(readers)
    return out


def gathered_view(g, t: int) -> int | None:
    """The gathered parameter (an ``identity`` op's output: a ZeRO-3 gather) that ``t`` is
    or shows through :data:`PARAM_VIEWS`, or None."""
    for _ in range(4):
        op = g.producer(t)
        if op is None:
            return None
        if op.kind == "identity":
            return t if g.param_behind(op.inputs[0], PARAM_VIEWS) is not None else None
        if op.primitive not in PARAM_VIEWS or isinstance(op.inputs[0], Literal):
            return None
        t = op.inputs[0]
    return None


@dataclass(frozen=True)
class RaggedExpansion:
    """What a backend without a native ``ragged_dot`` holds for the ragged_dots reading one
    lhs (per device, bytes before dtype scaling); see :func:`ragged_expansions`."""

    first: int  # position in the graph's op order of the first of these ragged_dots
    kept: float  # the lhs expanded over the piece's groups, and its mask, to the backward
    forward: float  # the expansion copied into the dot's operand layout
    backward: float  # the output cotangents expanded over the groups, in two layouts


def ragged_expansions(low, masks: bool = True) -> list[RaggedExpansion]:
    """The dense ``ragged_dot`` of backends without a grouped matmul (``Cluster.
    native_ragged_dot`` False: XLA's lowering on CPU and GPU), per lhs its ragged_dots
    read; ``masks``: whether the expansion's mask is kept beside it (XLA:CPU; a fusing
    backend computes it inside the masking select from the group sizes).

    Measured on XLA:CPU (moe-tiny-dropless, the ragged_dots' ``select_n`` buffers in the
    compiled step's live ranges): a ragged_dot over ``n`` local groups (the piece's experts
    when its groups are split over ``ep``, all of them when whole) multiplies
    ``lhs [n, rows, k]``, the lhs copied once per group with the other groups' rows
    zeroed. The forward's expansion is the one the weight gradient (a ragged contraction
    of the same lhs) needs, and XLA keeps it from the forward to the backward, one per
    distinct lhs (a MoE's gate and up projections share theirs), with its mask (one byte
    an element); the dot reads it in another layout, a copy while it runs. In the
    backward each ragged_dot's output cotangent is expanded the same way, in the two
    layouts of its input- and weight-gradient dots, for the ragged_dots of one lhs at
    once (their input gradients add up). On an H200 (moe-small-dropless, bf16) XLA keeps
    the same expansions, ``bf16[8, 8192, 512]`` and ``bf16[8, 8192, 704]`` per layer,
    without their masks."""
    plan = low.plan
    g = plan.pgraph.graph
    sizes = plan.mesh.shape
    needs = needs_grad(g)
    found: dict = {}
    for pos, op in enumerate(g.ops):
        if op.primitive != "ragged_dot_general" or not any(t in needs for t in op.outputs):
            continue
        rdn = op.eqn.params["ragged_dot_dimension_numbers"]
        if len(rdn.rhs_group_dimensions) != 1:
            continue
        lhs, rhs = op.tensor_inputs[0], op.tensor_inputs[1]
        lay = low.ops[op.id]
        gdim = rdn.rhs_group_dimensions[0]
        groups = g.tensors[rhs].shape[gdim]
        if lay.inputs[1] is not None:
            groups //= math.prod(sizes[a] for a in lay.inputs[1].spec[gdim])
        rows = local_bytes(g, lhs, lay.inputs[0], sizes)
        mask = rows / jnp.dtype(g.tensors[lhs].dtype).itemsize if masks else 0.0
        cot = local_bytes(g, op.outputs[0], lay.outputs[0], sizes)
        first, kept, fwd, bwd = found.get((lhs, groups), (pos, 0.0, 0.0, 0.0))
        kept = max(kept, groups * (rows + mask))
        found[lhs, groups] = (first, kept, max(fwd, groups * rows), bwd + 2 * groups * cot)
    return [RaggedExpansion(*v) for v in found.values()]


def _dense_ragged_peak(low, g, kept: dict, work: float, extra: float, masks: bool) -> float:
    """The activations' peak with dense ragged_dots (:func:`ragged_expansions`): the
    largest of the forward's end (every kept value and expansion, the largest working
    set, or the backward's buffers where it starts: ``extra``, :func:`cotangent_extra`)
    and the backward of each lhs's ragged_dots, when the values made after them have
    been read and freed: what the forward kept before them, their expansions and the
    earlier ones, and their cotangents' expansions."""
    found = ragged_expansions(low, masks)
    if not found:
        return sum(kept.values()) + max(work, extra)
    position = {t: pos for pos, op in enumerate(g.ops) for t in op.outputs}
    expanded = sum(e.kept for e in found)
    end = sum(kept.values()) + expanded + max(work, extra, *(e.forward for e in found))
    during = max(
        sum(b for t, b in kept.items() if position[t] < e.first)
        + sum(o.kept for o in found if o.first <= e.first)
        + e.backward
        for e in found
    )
    return max(end, during)


def cotangent_extra(low, g, ops, kept: Mapping[int, float], fuses: bool) -> float:
    """Bytes (per device, before dtype scaling) the backward holds beyond ``kept`` (tensor
    -> bytes, the values ``ops`` keep for it) while it runs one of ``ops`` (in forward
    order): that op's cotangents, of its outputs and of its inputs a gradient flows to (a
    weight's gradient), in the op's layouts, while the values made after it have been read
    and freed; on a fusing backend only the :func:`~jscaler.cost.fusion.materialised`
    ones. The largest over ``ops``, at least 0. At the backward's start, the loss head,
    this is the logits' cotangent and the LM head's weight gradient beside nearly every
    kept value (measured on XLA:CPU, Hugging Face BERT ``megatron(tp=2)``: 213 KB of its
    1.10 MB peak temp in the logits' cotangent, the decoder's weight gradient and the
    embedding's scatter-add)."""
    made = {t: i for i, op in enumerate(ops) for t in op.outputs}
    after = [0.0] * (len(ops) + 1)  # kept values made by ops[i:]
    for t, b in kept.items():
        if t in made:
            after[made[t]] += b
    for i in range(len(ops) - 1, -1, -1):
        after[i] += after[i + 1]
    best = 0.0
    for i, op in enumerate(ops):
        cot = _op_cotangents(low, g, op, fuses)
        if cot is not None:
            best = max(best, cot - after[i + 1])
    return best


def _op_cotangents(low, g, op, fuses: bool) -> float | None:
    """The bytes of the cotangents ``op``'s backward holds (:func:`cotangent_extra`), None
    where it holds none; once per lowering and op (a pipeline asks per stage)."""

    def make():
        if not holds_cotangents(g, op):
            return None
        needs = needs_grad(g)
        done = materialised(g) if fuses else None
        sizes = low.plan.mesh.shape
        lay = low.ops[op.id]
        pairs = (*zip(op.outputs, lay.outputs), *zip(op.inputs, lay.inputs))
        return sum(
            local_bytes(g, t, layout, sizes)
            for t, layout in pairs
            if carries_cotangent(t, needs, done)
        )

    return low.memo((_op_cotangents, id(g), op.id, fuses), make)


def carries_cotangent(t, needs, materialised: frozenset[int] | None) -> bool:
    """Whether operand ``t`` of an op that :func:`holds_cotangents` adds its cotangent to
    the backward's buffers (:func:`cotangent_extra`, and the ILP's phases): a gradient
    flows to it (``needs``) and, on a fusing backend (``materialised`` given), XLA
    materialises it."""
    if isinstance(t, Literal) or t not in needs:
        return False
    return materialised is None or t in materialised


def holds_cotangents(g, op) -> bool:
    """Whether ``op``'s backward holds cotangents of its own (:func:`cotangent_extra`):
    it is differentiable, a gradient flows through it, and it is not a view of a weight
    (a parameter or a ZeRO-3 gathered one through :data:`PARAM_VIEWS`: XLA folds the view
    into the matmul reading it, whose weight gradient is the weight's)."""
    return g.memo((holds_cotangents, op.id), lambda: _holds_cotangents(g, op))


def _holds_cotangents(g, op) -> bool:
    needs = needs_grad(g)
    if op.primitive in NON_DIFFERENTIABLE or not any(t in needs for t in op.outputs):
        return False
    if op.primitive in PARAM_VIEWS:
        t = op.outputs[0]
        return g.param_behind(t, PARAM_VIEWS) is None and gathered_view(g, t) is None
    return True


def reduced_bytes(low, t: int, cl: Cluster, into: Layout | None = None) -> float:
    """Bytes (per device, before dtype scaling) the reduction of parameter ``t``'s
    gradient writes: its reduced layout's; or, on a backend without a reduce-scatter
    (``cl.reduce_scatter``: XLA's CPU backend all-reduces, then slices), the whole
    gradient's where the parameter is stored sharded and gathered for the forward (ZeRO-3,
    whose gradients leave the resharded layers through optimization barriers). Measured on
    XLA CPU: ZeRO-3's all-reduce writes a second whole copy; ZeRO-2's (a replicated
    parameter) reuses its operand's buffer, so only the reduced slice is new. ``into``:
    the layout the reduction leaves (default the plan's gradient layout; a pipeline
    stage's accumulator)."""
    g = low.plan.pgraph.graph
    sizes = low.plan.mesh.shape
    out = local_bytes(g, t, low.grad[t] if into is None else into, sizes)
    if cl.reduce_scatter:
        return out
    whole = local_bytes(g, t, unreduced_grad(low, t), sizes)
    return whole if local_bytes(g, t, low.storage[t], sizes) < whole else out


def unreduced_grad(low, t: int) -> Layout:
    """The layout of parameter ``t``'s gradient as the backward pass makes it, before its
    reduction: the layout the forward reads the parameter in (ZeRO-3: the gathered one),
    partial sums over the data-parallel axes it is reduced over. XLA combines the
    gradient reductions of a step into one collective after the backward (on CPU a
    ZeRO reduce-scatter is an all-reduce then a slice), so every parameter's gradient is
    alive at this size at once, whatever layout the reduction leaves it in."""
    g = low.plan.pgraph.graph
    sizes = low.plan.mesh.shape
    best = low.grad[t]
    seen = {t}
    todo = [t]
    while todo:
        x = todo.pop()
        for o in g.consumers(x):
            if o.kind == "identity":  # a ZeRO-3 gather: the forward reads its output
                todo.extend(y for y in o.outputs if y not in seen)
                seen.update(o.outputs)
                continue
            for y, lay in zip(o.inputs, low.ops[o.id].inputs):
                if y == x and lay is not None:
                    if local_bytes(g, t, lay, sizes) > local_bytes(g, t, best, sizes):
                        best = lay
    return best


def recomputed_ops(plan: Plan) -> set[int]:
    """Ops whose forward runs again in the backward pass: recomputed groups and coshard
    regions (each colocated piece is recomputed)."""
    return set(recompute_groups(plan))


def working_set(low, scope: set[int] | None = None, fuses: bool = False) -> float:
    """Bytes (before dtype scaling) the backward of one recomputed group holds at once,
    the largest over groups with an op in ``scope`` (default all): the group's values the
    backward reads, a coshard region inside it counting one colocated piece; a coshard
    region outside any group counts its piece alone."""
    plan = low.plan
    g = plan.pgraph.graph
    sizes = plan.mesh.shape
    by_id = {op.id: op for op in g.ops}
    whole = saved_for_backward(g)
    if fuses:  # a fusing backend's rerun layer holds only its materialised values
        whole = g.memo((working_set,), lambda: frozenset(fused_kept(g, whole)))

    def kept(o):
        pairs = zip(by_id[o].outputs, low.ops[o].outputs)
        return sum(local_bytes(g, t, lay, sizes) for t, lay in pairs if t in whole)

    regions = []  # (ops, colocated pieces per device)
    for r in plan.regions:
        if r.kind == "coshard":
            regions.append((set(r.ops), device_pieces(plan, by_id[r.ops[0]])[1]))
    best = 0.0
    for ops, count in regions:
        if scope is None or ops & scope:
            best = max(best, sum(kept(o) for o in ops) / count)
    for grp in map(set, plan.recompute):
        if scope is not None and not grp & scope:
            continue
        # a region inside the group (or its part there) holds one piece at a time
        parts = [(ops & grp, count) for ops, count in regions if ops & grp]
        inside = set().union(*(part for part, _ in parts))
        rest = sum(kept(o) for o in grp - inside)
        piece = max((sum(kept(o) for o in part) / c for part, c in parts), default=0.0)
        best = max(best, rest + piece)
    return best
