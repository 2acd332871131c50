"""What a step's compute dtype makes of a traced graph: the bytes its values weigh and the
peak its ops run at.

Two cases. A graph traced in fp32 predicted as a half-precision step (the what-if of
``estimate(plan, cluster, dtype="bf16")``, as the paper's and calibrate's benches ask):
activations weigh half, every op runs at the half peak. A graph traced in half precision
(a trainer with ``precision="bf16"`` traces so, :mod:`jscaler.runtime.precision`): its
sizes are the step's, its fp32 master parameters and their gradients twice their traced
size, each op at its own operands' dtype's peak.
"""

from __future__ import annotations

import math

from jscaler.cost.cluster import Cluster

__all__ = [
    "HALF",
    "aligned",
    "compute_roofs",
    "op_compute_dtypes",
    "row_scale",
    "state_scale",
    "traced_in_half",
    "value_scale",
]

HALF = ("fp16", "bf16")


HALF_DTYPES = {"bfloat16": "bf16", "float16": "fp16"}


def traced_in_half(g) -> bool:
    """Whether ``g`` was traced with half-precision parameters: a trainer computing in
    bf16 traces the loss so (:mod:`jscaler.runtime.precision`), its sizes already half
    (once per graph)."""
    return g.memo(
        (traced_in_half,),
        lambda: any(str(g.tensors[p.id].dtype) in HALF_DTYPES for p in g.params()),
    )


def value_scale(dtype: str, g=None) -> float:
    """What a traced activation (or collective, or kernel operand) weighs when the step
    computes in ``dtype``: half of a traced fp32 value for fp16/bf16 mixed precision
    (parameters, their gradients and optimizer state stay fp32 masters); a graph ``g``
    traced in half precision already has the step's sizes."""
    if dtype not in HALF or (g is not None and traced_in_half(g)):
        return 1.0
    return 0.5


def state_scale(dtype: str, g) -> float:
    """What a traced parameter (its gradient, its optimizer state) weighs: the fp32
    masters of a graph traced in half precision are twice its traced size."""
    return 2.0 if dtype in HALF and traced_in_half(g) else 1.0


def row_scale(phase: str, grad: bool, act: float, state: float) -> float:
    """What a comm-table row's traced bytes weigh: the update's collectives move the
    masters (``state``), a gradient reduction the fp32 gradients of a graph traced in half
    precision (``state``), any other row, a gradient reduction of the what-if included,
    what an activation does (``act``)."""
    return state if phase == "update" or (grad and state > 1) else act


def compute_roofs(g, cl: Cluster, dtype: str) -> dict[int, float]:
    """op id -> the FLOP/s its kernels reach: every op at ``dtype``'s peak for a graph
    traced in fp32 and run in half precision (the what-if of ``estimate(dtype="bf16")``),
    else each op at its own operands' dtype's (a model that computes its matmuls in bf16
    gets the bf16 peak, its fp32 ones the fp32 one: TF32 on presets where JAX's default
    precision runs them so, see :attr:`Cluster.fp32_matmul`). A ``ragged_dot`` on a
    backend without a grouped matmul (``Cluster.native_ragged_dot`` False) multiplies
    every row by every group's matrix: its useful FLOPs run at a g-th of the roof. A
    matrix product with a dim that is not a multiple of 16 bytes runs at
    :attr:`Cluster.unaligned_matmul` of it (:func:`aligned`)."""
    kinds = op_compute_dtypes(g)
    if dtype in HALF and not traced_in_half(g):
        roof = cl.peak(dtype) * cl.efficiency
        found = dict.fromkeys((op.id for op in g.ops), roof)
        kinds = dict.fromkeys(kinds, dtype)
    else:
        roofs = {
            k: cl.peak(k if k in cl.flops else "fp32") * cl.efficiency for k in ("fp32", *HALF)
        }
        found = {op: roofs[kind] for op, kind in kinds.items()}
    for op in g.ops:
        if op.primitive == "ragged_dot_general" and not cl.native_ragged_dot:
            # a dense dot over every group: a g-th of it is useful
            found[op.id] /= g.tensors[op.tensor_inputs[2]].shape[-1]
        if cl.unaligned_matmul != 1.0 and not aligned(g, op, 2 if kinds[op.id] in HALF else 4):
            found[op.id] *= cl.unaligned_matmul
    return found


MATMULS = ("dot_general", "ragged_dot_general")


def aligned(g, op, itemsize: int) -> bool:
    """Whether a matrix product's ``m``, ``n`` and ``k`` (each the product of its dims, as
    XLA collapses them into one GEMM) are multiples of 16 bytes at ``itemsize``: the
    tensor cores' alignment, 4 elements of TF32, 8 of bf16. The backward contracts the
    forward's ``m`` and ``n``, so all three count. Any other op (or one without its
    equation) is aligned."""
    if op.primitive not in MATMULS or op.eqn is None:
        return True
    params = op.eqn.params
    if op.primitive == "dot_general":
        (lc, rc), (lb, rb) = params["dimension_numbers"]
        groups = ()
    else:
        rdn = params["ragged_dot_dimension_numbers"]
        (lc, rc), (lb, rb) = rdn.dot_dimension_numbers
        groups = tuple(rdn.rhs_group_dimensions)
    ls, rs = (g.tensors[t].shape for t in op.tensor_inputs[:2])
    per = 16 // itemsize
    m = math.prod(d for i, d in enumerate(ls) if i not in (*lc, *lb))
    n = math.prod(d for i, d in enumerate(rs) if i not in (*rc, *rb, *groups))
    k = math.prod(ls[i] for i in lc)
    return not (m % per or n % per or k % per)


def op_compute_dtypes(g) -> dict[int, str]:
    """op id -> the dtype name its operands compute in, its first floating input's (once
    per graph)."""

    def make() -> dict[int, str]:
        found = {}
        for op in g.ops:
            kind = "fp32"
            for t in op.tensor_inputs:
                name = str(g.tensors[t].dtype)
                if name in HALF_DTYPES or name.startswith("float"):
                    kind = HALF_DTYPES.get(name, "fp32")
                    break
            found[op.id] = kind
        return found

    return g.memo((op_compute_dtypes,), make)
