"""A fusing backend's view of a graph (XLA's GPU backend; ``Cluster.fuses_elementwise``):
an elementwise chain is one kernel, its intermediates neither moved through memory nor
kept for the backward, which recomputes them from the chain's materialised inputs."""

from __future__ import annotations

import math

import jax.numpy as jnp

from jscaler.ir.graph import Literal
from jscaler.ir.rules_elementwise import BINARY, TERNARY, UNARY

__all__ = [
    "FUSIBLE",
    "FUSION_ROOTS",
    "VIEWS",
    "fused_kept",
    "fused_op_bytes",
    "kernels",
    "materialised",
]

# what a fusing backend (XLA's GPU one) fuses into one kernel: elementwise ops, their
# broadcasts and reshapes, with a reduction as the fusion's root (an input fusion)
FUSIBLE = {
    *UNARY, *BINARY, *TERNARY, "broadcast_in_dim", "reshape", "squeeze", "expand_dims",
    "iota", "transpose",
}  # fmt: skip
FUSION_ROOTS = {"reduce_sum", "reduce_max", "reduce_min", "reduce_prod", "argmax", "argmin"}
# ops XLA compiles to a bitcast of their input's buffer: no kernel of their own; and a
# scan's boundary ops: one iteration's slice of a stack is read in place by the ops that
# use it, a pipeline chunk's rows likewise, a carry is the loop's buffer, a stacked
# output is written in place
VIEWS = {
    "reshape", "squeeze", "expand_dims",
    "scan_carry", "scan_slice", "scan_final", "scan_stack", "scan_chunk",
}  # fmt: skip


def materialised(g) -> frozenset[int]:
    """Tensors a fusing backend holds in memory (once per graph): the step's inputs, every
    output of an op it does not fuse, and a fusible op's outputs read by an op that is
    neither fusible nor a reduction (a matmul, a gather), or by none (the graph's
    outputs). An elementwise chain's other intermediates stay in registers inside one
    kernel."""

    def make() -> frozenset[int]:
        fused_readers = FUSIBLE | FUSION_ROOTS
        outputs = {t for t in g.outputs if not isinstance(t, Literal)}
        found = {t for t in g.tensors if g.producer(t) is None}  # the step's inputs
        for op in g.ops:
            for t in op.outputs:
                readers = g.consumers(t)
                if (
                    op.primitive not in FUSIBLE
                    or t in outputs
                    or not readers
                    or any(r.primitive not in fused_readers for r in readers)
                ):
                    found.add(t)
        return frozenset(found)

    return g.memo((materialised,), make)


def kernels(g, fuses: bool) -> dict[int, int]:
    """op id -> kernels its forward launches (once per graph and backend): none for a
    view, or on a fusing backend for an op fused into its readers' kernel; one for any
    other op, which on a fusing backend is the root of its fused chain (an op with a
    :func:`materialised` output: a matmul, a gather, a chain's end). Its backward launches
    as many per forward as it costs forwards of time (two matmuls for a matmul's)."""

    def make() -> dict[int, int]:
        done = materialised(g) if fuses else None
        return {
            op.id: int(
                op.primitive not in VIEWS and (done is None or any(t in done for t in op.outputs))
            )
            for op in g.ops
        }

    return g.memo((kernels, fuses), make)


def fused_op_bytes(g) -> dict[int, int]:
    """op id -> bytes it moves on a fusing backend: its inputs and outputs that are
    :func:`materialised` (once per graph)."""

    def make() -> dict[int, int]:
        done = materialised(g)
        size = {t: math.prod(x.shape) * jnp.dtype(x.dtype).itemsize for t, x in g.tensors.items()}
        return {
            o.id: sum(size[t] for t in (*o.tensor_inputs, *o.outputs) if t in done) for o in g.ops
        }

    return g.memo((fused_op_bytes,), make)


def fused_kept(g, saved: set[int], whole: frozenset[int] = frozenset()) -> set[int]:
    """What a fusing backend keeps for the backward of ``saved``: a materialised value as
    it is; an intermediate of an elementwise chain is recomputed by the backward's fusion
    from the chain's materialised inputs, which are kept instead. A value in ``whole``
    (one crossing a recomputed layer's edge, which the backward does not remake from
    values before it) is kept as it is."""
    done = materialised(g) | whole
    kept, seen = set(), set()
    stack = list(saved)
    while stack:
        t = stack.pop()
        if t in seen:
            continue
        seen.add(t)
        if t in done:
            kept.add(t)
        else:
            stack.extend(g.producer(t).tensor_inputs)
    return kept
